"""Sol-RL two-stage benchmark: low-precision explore, full-precision train, at equal full-precision NFE.

``grove bench visgen-two-stage --out DIR [--quick]`` calls ``run(out_dir, quick)``. The demo recipe as in
``bench/visgen_methods.py``; variants: flat Flow-GRPO (the budget), NFT, two-stage + NFT with the mxfp8, mxfp4 and
nvfp4 explorers, two-stage + GRPO (nvfp4), and fp8 where the hardware has it (CUDA SM >= 8.9; skipped on CPU with
a note). The budget counts full-precision forwards only (rollout + training): the explorer's are ``explore_nfe``.
Rows add ``rank_spearman`` (explorer vs full-precision reward ranking of the kept seeds, mean over iterations) and
``speedup_fp_nfe_vs_flat`` (= ``speedup_nfe_vs_flat``: flat's full-precision NFE to its final strict over this
variant's). On CPU every low-precision format is emulated and *slower*: only the algorithmic gain counts here;
wall-time gains need FP8/FP4 hardware.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from . import visgen_methods as vm

DOC = vm.ROOT / "docs" / "bench" / "visgen_two_stage.md"
NFT = vm.VARIANTS["nft"]


def _two_stage(precision: str, objective: str) -> dict:
    base = NFT if objective == "nft" else {}
    out = vm._merge(base, {"visgen": {"two_stage": {"enabled": True, "precision": precision, "candidates": 64}}})
    return out


VARIANTS: dict[str, dict[str, Any]] = {
    "flat": {},
    "nft": NFT,
    "two-stage-mxfp8-nft": _two_stage("mxfp8", "nft"),
    "two-stage-mxfp4-nft": _two_stage("mxfp4", "nft"),
    "two-stage-nvfp4-nft": _two_stage("nvfp4", "nft"),
    "two-stage-nvfp4-grpo": _two_stage("nvfp4", "grpo"),
    "two-stage-fp8-nft": _two_stage("fp8", "nft"),
}


def run(out_dir: Path, quick: bool = False, variants: list[str] | None = None, log=print, flat_iters: int | None = None,
        flat_seeds: int | None = None, eval_every: int | None = None, write_doc: bool | None = None,
        reuse: list[Path | str] | None = None, candidates: int | None = None,
        variant_seeds: int = 1) -> dict[str, Any]:
    """The benchmark (sizes as ``bench.visgen_methods.run``; ``reuse``: earlier results.json / partial.json of either
    bench whose runs are taken, not re-run; ``candidates`` overrides stage 1's pool per prompt; ``variant_seeds``
    seeds of every non-flat variant)."""
    from shared_rl.bench import markdown_table, write_results
    from visgen.lowprec import native

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    vm._quiet()
    t0 = time.perf_counter()
    flat_iters = flat_iters or (2 if quick else 30)
    flat_seeds = flat_seeds or (1 if quick else 2)
    eval_every = eval_every or (1 if quick else 5)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    names = [n for n in (variants or list(VARIANTS)) if n != "flat"]
    skipped = [n for n in names if "fp8-" in n and "mxfp8" not in n and not native("fp8", device)]
    names = [n for n in names if n not in skipped]
    pool = candidates or (32 if quick else None)  # quick: stage 1 small too
    variants_used = vm._merge(VARIANTS, {})
    if pool:
        for n in names:
            if "two_stage" in variants_used[n].get("visgen", {}):
                variants_used[n]["visgen"]["two_stage"]["candidates"] = pool
    earlier = vm.load_runs(reuse, flat_iters, eval_every) if reuse else {}
    results: dict[str, list[dict]] = {"flat": earlier.get("flat", [])[:flat_seeds]}
    for seed in range(len(results["flat"]), flat_seeds):
        log(f"visgen-two-stage: flat seed {seed} sets the full-precision budget")
        results["flat"].append(vm.run_variant("flat", seed, None, flat_iters, eval_every, quick, log,
                                              variants=variants_used))
        vm._save_partial(out_dir, results)
    budget = statistics.mean(r["nfe"] for r in results["flat"])
    for name in names:  # seeds 0..variant_seeds-1 of each variant, taking the reused ones first
        results[name] = earlier.get(name, [])[:variant_seeds]
        for seed in range(len(results[name]), variant_seeds):
            log(f"visgen-two-stage: {name} seed {seed}")
            results[name].append(vm.run_variant(name, seed, budget, 3 * flat_iters, eval_every, quick, log,
                                                variants=variants_used))
            vm._save_partial(out_dir, results)
    rows, summary = vm.rows_from(results, budget)
    for r in rows:
        r["speedup_fp_nfe_vs_flat"] = r.pop("speedup_nfe_vs_flat")
    total = time.perf_counter() - t0
    command = (f"python -m bench.visgen_two_stage --flat-iters {flat_iters} --flat-seeds {flat_seeds}"
               + (f" --reuse {' '.join(map(str, reuse))}" if reuse else "") + (f" --candidates {pool}" if pool else "")
               + (f" --variant-seeds {variant_seeds}" if variant_seeds > 1 else "")
               if not quick and flat_iters != 30 else f"grove bench visgen-two-stage{' --quick' if quick else ''}")
    notes = (f"Command: `nice -n 5 {command}` ({total / 60:.1f} min, "
             f"device {device}). Full-precision budget {budget:.0f} NFE (flat, {flat_seeds} seed(s), {flat_iters} "
             f"iterations); flat strict {summary['flat_start']:.3f} -> {summary['flat_final']:.3f}, band "
             f"{summary['band']:.3f}. Low-precision formats are "
             f"{'native' if device.type == 'cuda' else 'EMULATED on this CPU (slower, numerics only)'}."
             + (f" Skipped (no kernels on {device}): {', '.join(skipped)}." if skipped else "") + "\n")
    doc = DOC if ((not quick) if write_doc is None else write_doc) else None
    result = write_results(out_dir, "visgen-two-stage", rows, notes=notes,
                           extra={"curves": {k: [r["points"] for r in v] for k, v in results.items()},
                                  "flat_runs": results["flat"], "runs": results, "budget_nfe": budget, **summary, "skipped": skipped, "quick": quick,
                                  "table": markdown_table(rows)}, doc_path=doc)
    log(f"visgen-two-stage: done in {total:.0f} s")
    return result


def rank_agreement(precisions: tuple[str, ...] = ("bf16", "mxfp8", "mxfp4", "nvfp4"), prompts: int = 8,
                   candidates: int = 16, seed: int = 0, log=print) -> list[dict[str, Any]]:
    """Spearman between each explorer's and the full-precision model's rewards of the SAME seeds (all candidates,
    ODE, the demo asset and reward): the number the two-stage rollout lives on. Per-prompt mean and pooled."""
    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer
    from shared_rl.two_stage import spearman
    from visgen.engine import flat_forest
    from visgen.lowprec import LowPrecisionExplorer

    cfg = load_train_config(vm.variant_config("flat", seed, 1, False))
    dom = Trainer(cfg, None, log=lambda s: None).domain
    keys = dom.train_keys()[:prompts]
    ad = dom.adapter
    cond = ad.encode_prompts([dom.train_prompts[k] for k in keys], guidance_scale=1.0, **dom._sample_kwargs())
    sig, ts = ad.schedule(cfg.domain_config.num_inference_steps, cond)
    rep = cond[torch.arange(prompts).repeat_interleave(candidates)]
    seeds = torch.randint(0, 2**62, (prompts * candidates,), generator=torch.Generator().manual_seed(seed))
    off = torch.zeros(prompts * candidates, int(ts.numel()), dtype=torch.bool)

    def rewards(adapter) -> torch.Tensor:
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds.tolist()]
        x = ad.prepare_latents(prompts * candidates, rep, gens)
        f = flat_forest(adapter, rep, x, off, off, sig, ts, None, "ode", 0.0)
        z = f.node_latent[f.leaves()]
        images = torch.cat([ad.decode(z[i:i + 64], rep[torch.arange(i, min(i + 64, len(z)))])
                            for i in range(0, len(z), 64)])
        ks = [k for k in keys for _ in range(candidates)]
        return dom.score(images, [dom.train_prompts[k] for k in ks], [dom.train_meta[k] for k in ks])["shapes_soft"]

    with torch.no_grad():
        ref = rewards(ad)
        rows = []
        for p in precisions:
            t = time.perf_counter()
            ex = LowPrecisionExplorer(dom.pipe, p).sync()
            r = rewards(ex.adapter)
            per_prompt = [spearman(r.view(prompts, -1)[i], ref.view(prompts, -1)[i]) for i in range(prompts)]
            rows.append({"variant": f"explorer-{p}", "rank_spearman_pooled": spearman(r, ref),
                         "rank_spearman_per_prompt": statistics.mean(x for x in per_prompt if x == x),
                         "mean_abs_reward_diff": float((r - ref).abs().mean()),
                         "quantized_fraction": ex.quantized_fraction, "s": time.perf_counter() - t})
            log(f"  {rows[-1]}")
    return rows


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-visgen-two-stage")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", nargs="*")
    p.add_argument("--flat-iters", type=int)
    p.add_argument("--flat-seeds", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--candidates", type=int)
    p.add_argument("--variant-seeds", type=int, default=1, help="seeds of every non-flat variant")
    p.add_argument("--reuse", nargs="*", help="earlier results.json / partial.json whose runs are taken, not re-run")
    p.add_argument("--no-doc", action="store_true")
    a = p.parse_args()
    run(Path(a.out), a.quick, a.variants, flat_iters=a.flat_iters, flat_seeds=a.flat_seeds, eval_every=a.eval_every,
        write_doc=False if a.no_doc else None, reuse=a.reuse, candidates=a.candidates, variant_seeds=a.variant_seeds)
