"""Benchmarks of the visgen rewards: overlapped OCR scoring (``run``) and the batched shapes rewards (``run_shapes``).

``run`` — ``grove bench visgen-rewards``: does overlapped scoring hide the OCR reward behind sampling?

Three variants of the same Flow-GRPO run on the words task (tiny SD3 words asset, the real PP-OCRv4 OCR reward):

- ``one batch``: ``score_chunks: 1`` (sample every key of a call, then score them all);
- ``K chunks, sequential``: ``score_chunks: K``, each sub-chunk scored right after it samples;
- ``K chunks, overlapped``: ``score_chunks: K, overlap_rewards: true`` (sub-chunk i scored in a worker thread
  while sub-chunk i+1 samples; the metrics must equal the sequential variant's bit for bit, checked here too).

Per variant: mean ``time/sample``, ``time/reward`` (reward compute), ``time/reward_wait`` (what the sampler waited),
``time/rollout`` and ``time/iteration`` over the iterations after the first, and the ratio of ``time/iteration`` to
the sequential chunked run. ``grove bench visgen-rewards --out DIR [--quick]`` calls ``run(out_dir, quick)``.

``run_shapes`` — ``python -m bench.visgen_rewards shapes --out DIR [--quick] [--device cuda]``: the shapes rewards'
batched tensor path (``visgen.rewards.shapes_batched``, the default) against the per-image numpy checker
(``reference=True``), side by side in one process on one thread, on the demo's images (SDE samples of the tiny SD3
asset, 32 prompts x 16 like ``configs/visgen/shapes_grpo.yaml``; blurred, noisy renders without the asset). Rows:
each reward alone (the batched path analyses fresh images each call) and the demo's pair (``shapes_soft`` then
``shapes`` on the same tensor, as ``VisgenDomain.score`` calls them: the numpy path finds the components three
times per image, the batched one once). Rounds alternate which side runs first; the ratio is the median of the
per-round ratios (the machine is shared). The outputs are checked equal on the way. Its table goes into a section
of its own at the end of ``docs/bench/visgen_rewards.md``.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "assets" / "words-sd3-tiny"
DOC = REPO / "docs" / "bench" / "visgen_rewards.md"


def _model(quick: bool, tmp: Path) -> str:
    if (ASSET / "model_index.json").is_file():
        return str(ASSET)
    if not quick:
        from shared_rl.errors import ConfigError

        raise ConfigError(f"{ASSET} is missing; build it with `python -m visgen.pretrain "
                          "configs/visgen/words_pretrain.yaml --out assets/words-sd3-tiny` (or run with --quick)")
    from visgen import tiny
    from visgen.tasks import words

    pipe = tiny.build_pipeline(words=words.vocabulary(), seed=0)
    pipe.tokenizer = pipe.tokenizer_2 = words.build_tokenizer()
    tiny.save_pipeline(pipe, tmp / "words-random", {"task": "words"})
    return str(tmp / "words-random")


def _config(model: str, quick: bool, iterations: int, chunks: int, overlap: bool) -> dict[str, Any]:
    from visgen.tasks.words import OCR_SETTINGS

    return {
        "domain": "visgen", "seed": 0, "iterations": iterations,
        "rollout": {"groups_per_iteration": 4 if quick else 16, "group_size": 4 if quick else 8},
        "loss": {"clip_low": 1e-3}, "optim": {"lr": 1e-3, "minibatches_per_epoch": 1},
        "eval": {"at_start": False, "every": 0}, "logging": {"progress": False},
        "visgen": {"model": model, "task": "words", "num_inference_steps": 10, "num_threads": 1,
                   "method": {"name": "flow_grpo", "train_fraction": 0.3}, "lora": {"rank": 16, "alpha": 32},
                   "rewards": [{"name": "ocr", "kwargs": dict(OCR_SETTINGS)}],
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0},
                   "score_chunks": chunks, "overlap_rewards": overlap},
    }


def _run(cfg: dict) -> list[dict[str, Any]]:
    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer

    trainer = Trainer(load_train_config(cfg), None, log=lambda *_: None)
    return [r for r in trainer.fit() if "time/iteration" in r]


def run(out_dir: Path, quick: bool = False, chunks: int = 4, log=print, write_doc: bool | None = None) -> dict:
    from shared_rl.bench import write_results

    torch.set_num_threads(1)
    iterations = 2 if quick else 6
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(quick, Path(tmp))
        variants = {"one batch": (1, False), f"{chunks} chunks, sequential": (chunks, False),
                    f"{chunks} chunks, overlapped": (chunks, True)}
        records = {}
        for name, (k, overlap) in variants.items():
            log(f"visgen-rewards: {name}")
            records[name] = _run(_config(model, quick, iterations, k, overlap))
    seq, over = records[f"{chunks} chunks, sequential"], records[f"{chunks} chunks, overlapped"]
    identical = _same_outcomes(seq, over)
    base = statistics.mean(r["time/iteration"] for r in seq[1:] or seq)
    rows = []
    for name, recs in records.items():
        use = recs[1:] or recs  # the first iteration pays one-off costs (OCR engine warm-up)
        mean = lambda key: statistics.mean(r.get(key, float("nan")) for r in use)  # noqa: E731
        rows.append({"variant": name, "images_per_iter": _images(quick), "time_sample_s": mean("time/sample"),
                     "time_reward_s": mean("time/reward"),
                     "time_reward_wait_s": mean("time/reward_wait") if "time/reward_wait" in use[0] else mean("time/reward"),
                     "time_rollout_s": mean("time/rollout"), "time_iteration_s": mean("time/iteration"),
                     "iteration_vs_sequential_chunks": mean("time/iteration") / base})
    notes = (f"\n{iterations} iterations per variant ({'quick: random words pipeline' if quick else 'words asset'}), "
             f"means over iterations 2..{iterations}; overlapped metrics identical to sequential: **{identical}**; "
             f"total {time.perf_counter() - t0:.0f} s. Command: `grove bench visgen-rewards --out DIR"
             f"{' --quick' if quick else ''}`.\n")
    doc = DOC if (write_doc if write_doc is not None else not quick) else None
    result = write_results(Path(out_dir), "visgen-rewards", rows, notes, {"identical": identical}, doc_path=doc)
    log(f"visgen-rewards: identical={identical}; " + "; ".join(
        f"{r['variant']}: {r['time_iteration_s']:.2f} s/it (reward {r['time_reward_s']:.2f} s, waited "
        f"{r['time_reward_wait_s']:.2f} s)" for r in rows))
    return result


def _same_outcomes(a: list[dict], b: list[dict]) -> bool:
    """Every non-timing metric equal (``time/*`` and ``samples_per_s`` are wall-clock)."""
    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"}

    return len(a) == len(b) and all(strip(x) == strip(y) for x, y in zip(a, b))


def _images(quick: bool) -> int:
    return 16 if quick else 128


# ------------------------------------------------------------------------------------------------ shapes rewards
SHAPES_BEGIN, SHAPES_END = "<!-- shapes-rewards: begin (bench.visgen_rewards.run_shapes) -->", "<!-- shapes-rewards: end -->"
SHAPES_ASSET = REPO / "assets" / "shapes-sd3-tiny"


def _shapes_images(n: int, log=print) -> tuple[torch.Tensor, list, str]:
    """``n`` images of the demo's kind and their prompt specs: SDE samples of the asset (10 steps, noise level 0.7,
    16 per prompt), else blurred noisy renders."""
    import numpy as np
    from scipy import ndimage

    from visgen.tasks import shapes as S

    train, _ = S.split_prompts(0, 0.2)
    specs = [train[i % len(train)] for i in range(0, 7 * (n // 16), 7) for _ in range(16)][:n]
    if (SHAPES_ASSET / "model_index.json").is_file():
        from visgen import tiny
        from visgen.trajectory import sample

        pipe = tiny.load_shapes_asset(SHAPES_ASSET)
        images = []
        for start in range(0, n, 64):
            part = [s.prompt for s in specs[start:start + 64]]
            traj = sample(pipe, part, 10, 1.0, torch.Generator().manual_seed(start), "sde", 0.7, decode=True,
                          max_sequence_length=1)
            images.append(traj.images.float())
        return torch.cat(images), specs, "SDE samples of assets/shapes-sd3-tiny (10 steps, noise level 0.7)"
    log(f"visgen-rewards shapes: {SHAPES_ASSET} is missing; blurred noisy renders instead")
    rng = np.random.default_rng(0)
    images = ndimage.gaussian_filter(S.render_batch(specs, 0), sigma=(0, 0, 0.8, 0.8))
    images = np.clip(images + 0.05 * rng.standard_normal(images.shape), 0, 1).astype(np.float32)
    return torch.from_numpy(images), specs, "renders blurred (sigma 0.8 px) with noise (std 0.05)"


def run_shapes(out_dir: Path, quick: bool = False, device: str = "cpu", rounds: int | None = None, log=print,
               write_doc: bool | None = None) -> dict:
    """The shapes rewards, numpy reference vs batched, interleaved rounds (see the module docstring)."""
    import numpy as np

    from shared_rl.bench import write_results
    from visgen.rewards import get_reward
    from visgen.rewards.base import check_batch

    torch.set_num_threads(1)
    n = 64 if quick else 512
    rounds = rounds or (2 if quick else 5)
    t0 = time.perf_counter()
    images, specs, source = _shapes_images(n, log)
    prompts, metas = [s.prompt for s in specs], [s.to_dict() for s in specs]
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sides = {"numpy": {k: get_reward(k, reference=True) for k in ("shapes", "shapes_soft")},
             "batched": {k: get_reward(k) for k in ("shapes", "shapes_soft")}}
    variants = {"shapes": ("shapes",), "shapes_soft": ("shapes_soft",),
                "demo pair: shapes_soft + shapes, same images": ("shapes_soft", "shapes")}

    def timed(side: str, names: tuple) -> tuple[float, dict]:
        x = images.to(dev, copy=True)  # a fresh tensor: no analysis cached for it
        sync()
        t = time.perf_counter()
        out = {}
        for name in names:
            out.update(sides[side][name](x, prompts, metas))
        sync()
        return time.perf_counter() - t, out

    for side in sides:  # warm-up (allocator, lazy imports)
        timed(side, ("shapes",))
    times: dict[str, dict[str, list[float]]] = {v: {"numpy": [], "batched": []} for v in variants}
    equal, soft_diff, checks = True, 0.0, []
    for r in range(rounds):
        t = time.perf_counter()
        check_batch(images, prompts, metas)
        checks.append(time.perf_counter() - t)
        for variant, names in variants.items():
            for side in (("numpy", "batched") if r % 2 == 0 else ("batched", "numpy")):
                seconds, out = timed(side, names)
                times[variant][side].append(seconds)
                if side == "numpy":
                    ref = out
                else:
                    got = out
            for key in got:
                a, b = ref[key].numpy(), got[key].numpy()
                if key == "shapes_soft":
                    soft_diff = max(soft_diff, float(np.nanmax(np.abs(a - b))))
                else:
                    equal &= bool(np.array_equal(a, b, equal_nan=True))
        log(f"visgen-rewards shapes: round {r + 1}/{rounds} done")
    rows = []
    for variant, t in times.items():
        old, new = statistics.median(t["numpy"]), statistics.median(t["batched"])
        ratios = [a / b for a, b in zip(t["numpy"], t["batched"])]
        rows.append({"variant": variant, "images": n, "numpy_images_per_s": n / old, "batched_images_per_s": n / new,
                     "numpy_ms_per_image": 1e3 * old / n, "batched_ms_per_image": 1e3 * new / n,
                     "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    cmd = f"python -m bench.visgen_rewards shapes --out DIR{' --quick' if quick else ''}" + \
        (f" --device {device}" if device != "cpu" else "")
    notes = (f"\n{n} images ({source}), {rounds} interleaved rounds (the side that runs first alternates), one "
             f"thread (`torch.set_num_threads(1)`), batched path on `{device}`; per-side medians, ratio = median "
             f"of the per-round numpy/batched time ratios. `shapes`/`shapes_strict` identical: **{equal}**; "
             f"`shapes_soft` max |difference|: {soft_diff:.3g}. Both sides include the reward contract's input "
             f"check (`visgen.rewards.base.check_batch`), {1e3 * statistics.median(checks) / n:.3f} ms per image "
             f"per call. Total {time.perf_counter() - t0:.0f} s. "
             f"Command: `{cmd}`.\n")
    result = write_results(Path(out_dir), "visgen-rewards-shapes", rows, notes,
                           {"identical": equal, "soft_max_abs_diff": soft_diff})
    if write_doc if write_doc is not None else not quick:
        _write_shapes_section(Path(out_dir) / "results.md")
    log("visgen-rewards shapes: " + "; ".join(f"{r['variant']}: {r['ratio_median']:.1f}x" for r in rows))
    return result


def _write_shapes_section(results_md: Path) -> None:
    """Put the run's table in its own section of DOC (replacing the previous one; the OCR run's page rewrite keeps
    everything after its hand-written analysis mark, where this section lives)."""
    body = results_md.read_text().replace("# Benchmark `visgen-rewards-shapes`",
                                          "## Shapes rewards: batched tensors vs the numpy checker", 1)
    doc = DOC.read_text() if DOC.is_file() else ""
    if SHAPES_BEGIN in doc:
        head, rest = doc.split(SHAPES_BEGIN, 1)
        tail = rest.split(SHAPES_END, 1)[1] if SHAPES_END in rest else ""
    else:
        head, tail = doc.rstrip("\n") + "\n\n", "\n"
    DOC.write_text(f"{head}{SHAPES_BEGIN}\n{body.strip()}\n{SHAPES_END}{tail}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.visgen_rewards", description=__doc__.split("\n")[0])
    parser.add_argument("which", choices=["shapes", "ocr"], help="shapes: run_shapes; ocr: run (grove bench "
                                                                 "visgen-rewards)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu", help="shapes: where the batched path runs (cpu, cuda)")
    args = parser.parse_args(argv)
    if args.which == "shapes":
        run_shapes(Path(args.out), args.quick, args.device)
    else:
        run(Path(args.out), args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
