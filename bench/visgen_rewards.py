"""Benchmark ``visgen-rewards``: does overlapped scoring hide the OCR reward behind sampling?

Three variants of the same Flow-GRPO run on the words task (tiny SD3 words asset, the real PP-OCRv4 OCR reward):

- ``one batch``: ``score_chunks: 1`` (sample every key of a call, then score them all);
- ``K chunks, sequential``: ``score_chunks: K``, each sub-chunk scored right after it samples;
- ``K chunks, overlapped``: ``score_chunks: K, overlap_rewards: true`` (sub-chunk i scored in a worker thread
  while sub-chunk i+1 samples; the metrics must equal the sequential variant's bit for bit, checked here too).

Per variant: mean ``time/sample``, ``time/reward`` (reward compute), ``time/reward_wait`` (what the sampler waited),
``time/rollout`` and ``time/iteration`` over the iterations after the first, and the ratio of ``time/iteration`` to
the sequential chunked run. ``grove bench visgen-rewards --out DIR [--quick]`` calls ``run(out_dir, quick)``.
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
