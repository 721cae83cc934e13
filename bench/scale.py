"""`grove bench scale`: samples/s with 1 vs 2 CPU processes on the same work, checkpoint save/load time and
size per domain, and the bytes each process holds of the trained state under FSDP2 with 1, 2 and 4 processes.

Both process counts run the same config, seed and global batch (`rollout.groups_per_call` fixed so the work is
identical); samples/s is read from the runs' own `metrics.jsonl` (`samples_per_s` = leaves / wall time of the
whole iteration; median over the iterations after the first, which pays start-up costs). The runs alternate
1, 2, 1, 2 processes (``REPEATS`` rounds) so that load from other jobs hits both layouts alike; each layout's
value is its best round (other jobs only ever slow a run down), and the 1-minute load average seen before each
run is reported. Threads:
one process uses every core (``OMP_NUM_THREADS`` = cores), two processes one core's share each, so the ratio
compares the two ways of spending the same cores. On a 2-core machine shared with other jobs the ratio is
a noisy number: report it as measured.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared_rl.bench import write_results
from shared_rl.cli import REPO_ROOT
from shared_rl.distributed import free_port

NO_EVAL = ["eval.at_start=false", "eval.every=0", "checkpoint.every=0"]
DOMAIN_CONFIGS = {
    "toy": ("configs/toy.yaml", ["iterations=30", "rollout.groups_per_iteration=8", "rollout.groups_per_call=2",
                                 *NO_EVAL]),
    "llm": ("configs/llm/arith_grpo.yaml", ["iterations=6", "rollout.groups_per_call=2", "llm.num_threads=0",
                                            *NO_EVAL]),
    "visgen": ("configs/visgen/shapes_grpo.yaml", ["iterations=5", "rollout.groups_per_call=2", "visgen.num_threads=0",
                                                   # the sizes of the published table (the demo now uses 32 x 16)
                                                   "rollout.groups_per_iteration=8", "rollout.group_size=8",
                                                   "optim.minibatches_per_epoch=2", "visgen.rewards=[{name: shapes}]",
                                                   "advantage.weights={shapes: 1.0, shapes_strict: 0.0}",
                                                   *NO_EVAL]),
    "robotics": ("configs/robotics/metaworld_grpo.yaml", ["iterations=3", "rollout.groups_per_iteration=4",
                                                          "rollout.groups_per_call=2", "robotics.threads=0",
                                                          *NO_EVAL]),
}
REPEATS = 2


def _run(config: str, overrides: list[str], out: Path, processes: int) -> float | None:
    base = [sys.executable, "-m", "shared_rl.cli", "train", str(REPO_ROOT / config), "--out", str(out),
            "logging.progress=false", *overrides]
    if processes > 1:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(REPO_ROOT / "configs/accelerate/cpu_2proc.yaml"), "--num_processes", str(processes),
               "--main_process_port", str(free_port()), "-m", "shared_rl.cli", *base[3:]]
    else:
        cmd = base
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // processes)))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return None
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    sps = [r["samples_per_s"] for r in recs if r.get("samples_per_s")][1:]
    return statistics.median(sps) if sps else None


def _alternating(config: str, overrides: list[str], tmp: Path, name: str, repeats: int) -> dict[str, float | None]:
    """Samples/s of 1 and 2 processes, alternating 1, 2, 1, 2, ... (best round per layout) and the load averages."""
    got: dict[int, list[float]] = {1: [], 2: []}
    loads = []
    for r in range(repeats):
        for procs in (1, 2):
            loads.append(os.getloadavg()[0])
            v = _run(config, overrides, tmp / f"{name}-{procs}-{r}", procs)
            if v is not None:
                got[procs].append(v)
    one = max(got[1]) if got[1] else None
    two = max(got[2]) if got[2] else None
    return {"samples_per_s_1proc": one, "samples_per_s_2proc": two,
            "speedup_2proc": (two / one) if one and two else None,
            "load_avg_min": min(loads), "load_avg_max": max(loads)}


def _checkpoint_cost(config: str, overrides: list[str], tmp: Path) -> dict[str, float]:
    from shared_rl.config import apply_overrides, load_train_config, load_yaml
    from shared_rl.trainer import Trainer

    cfg = load_train_config(apply_overrides(load_yaml(REPO_ROOT / config), overrides))
    tr = Trainer(cfg, tmp, log=lambda *_: None)
    tr.iteration(0)  # after one update, so the optimizer state (AdamW moments) is in the checkpoint
    t = time.perf_counter()
    path = tr.save(1)
    save_s = time.perf_counter() - t
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    t = time.perf_counter()
    tr.resume()
    load_s = time.perf_counter() - t
    return {"ckpt_save_s": save_s, "ckpt_load_s": load_s, "ckpt_mb": size / 2**20}


# ---- memory per process under FSDP2 ------------------------------------------------------------------------
MEMORY_WORLDS = (1, 2, 4)


def even_token_fraction(completion_ids, **_):
    """A dense reward (TRL signature), so that the measured step has non-zero gradients."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def _memory_config(model: str):
    from shared_rl.config import load_train_config

    return load_train_config({
        "domain": "llm", "seed": 0, "iterations": 1, "logging": {"progress": False}, "eval": {"at_start": False},
        "distributed": {"strategy": "fsdp2"}, "checkpoint": {"every": 0},
        "rollout": {"groups_per_iteration": 4, "group_size": 2, "groups_per_call": 1},
        "optim": {"lr": 1e-3, "micro_batch_size": 2},
        "llm": {"model": model, "max_new_tokens": 4, "num_threads": 1, "share_prompt_forward": False,
                "rewards": [{"name": "bench.scale:even_token_fraction"}],
                "eval": {"num_prompts": 2, "batch_size": 2, "sampled": False}}})


def _memory_worker(rank: int, world: int, port: int, model: str, out: str) -> None:
    """One iteration of full fine-tuning under FSDP2, then the bytes this process holds (local shards)."""
    import torch

    from shared_rl.distributed import exit_distributed, is_dtensor
    from shared_rl.trainer import Trainer

    if world > 1:  # a worker process of its own; one process runs in the bench's process, no group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
    tr = Trainer(_memory_config(model), None, log=lambda *_: None)
    tr.iteration(0)  # after one optimizer step: gradients and AdamW moments exist

    def local(t) -> int:
        return (t.to_local() if is_dtensor(t) else t).numel() * t.element_size()

    params = tr.optim.params
    got = {"params": sum(local(p) for p in params), "grads": sum(local(p.grad) for p in params if p.grad is not None),
           "optimizer": sum(local(v) for st in tr.optimizer.state.values() for v in st.values()
                            if torch.is_tensor(v) and v.dim())}
    Path(f"{out}.{rank}").write_text(json.dumps(got))
    if world > 1:
        exit_distributed(0)


def _memory_rows(tmp: Path) -> list[dict]:
    """Per-process bytes of trained parameters, gradients and AdamW state of a tiny Llama (full fine-tuning, 4
    layers) under FSDP2 with 1, 2 and 4 CPU processes (gloo): expect ~1/N of the one-process bytes."""
    import multiprocessing

    import torch.multiprocessing as mp

    from shared_rl.llm.model import build_tiny_llama, load_tokenizer

    model = tmp / "tiny-llama"
    tok = load_tokenizer(str(REPO_ROOT / "assets/llm-arith-tiny"))
    build_tiny_llama(tok, hidden_size=64, num_layers=4, num_heads=4, seed=0).save_pretrained(model)
    tok.save_pretrained(model)
    rows, base = [], None
    for world in MEMORY_WORLDS:
        out = tmp / f"mem{world}.json"
        if world == 1:
            _memory_worker(0, 1, 0, str(model), str(out))
        else:
            multiprocessing.set_forkserver_preload(["torch", "shared_rl.trainer", "shared_rl.llm.domain"])
            mp.start_processes(_memory_worker, args=(world, free_port(), str(model), str(out)), nprocs=world,
                               join=True, start_method="forkserver")
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
        worst = {k: max(r[k] for r in ranks) for k in ranks[0]}  # the busiest process decides what fits
        base = base or worst
        rows.append({"variant": f"memory llm fsdp2 {world} proc",
                     **{f"{k}_bytes_per_process": v for k, v in worst.items()},
                     "fraction_of_1proc": sum(worst.values()) / sum(base.values())})
    return rows


# ---- data parallel: grove's flat-buffer gradient sum vs torch DDP ------------------------------------------------
SYNC_STEPS, SYNC_ROUNDS = 12, 5


def _sync_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))


def _sync_worker(rank: int, world: int, port: int, out: str) -> None:
    """Per-step time of forward + backward + gradient sum over the 2 processes, grove's way (``Dist.sum_gradients``:
    backward, then one all-reduce of every gradient concatenated), torch's ``DistributedDataParallel`` (gloo, 25 MB
    buckets all-reduced while backward runs, gradients as views of the buckets) and FSDP2 replicated over a
    (world x 1) mesh (per-unit all-reduces during backward), alternating blocks of ``SYNC_STEPS`` steps over
    ``SYNC_ROUNDS`` rounds; and the largest difference of the summed gradients."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from shared_rl.distributed import Dist, exit_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    d = Dist()
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 512, (4, 64), generator=g)
    flat_model = _sync_model()
    ddp_model = DistributedDataParallel(_sync_model(), gradient_as_bucket_view=True)
    params = list(flat_model.parameters())
    # grove's own bucketed, overlapped data parallel: distributed.strategy fsdp2 with distributed.replicate = the
    # process count, a (world x 1) mesh: every process holds whole parameters, FSDP2 all-reduces each unit's
    # gradients (a decoder layer, then the root) as backward leaves it
    from shared_rl.distributed import FSDPShards

    hsdp_model = _sync_model()
    FSDPShards([*hsdp_model.model.layers, hsdp_model], d, torch.device("cpu"), replicate=world)

    def flat_step():
        flat_model.zero_grad(set_to_none=True)
        flat_model(input_ids=ids, labels=ids).loss.backward()
        d.sum_gradients(params)

    def ddp_step():
        ddp_model.zero_grad(set_to_none=False)
        ddp_model(input_ids=ids, labels=ids).loss.backward()  # DDP averages: x world below for the sum

    def fsdp2_step():
        hsdp_model.zero_grad(set_to_none=True)
        hsdp_model(input_ids=ids, labels=ids).loss.backward()  # summed (divide factor 1), like grove's runs

    times = {"flat": [], "ddp": [], "fsdp2": []}
    for _ in range(SYNC_ROUNDS):
        for name, step in (("flat", flat_step), ("ddp", ddp_step), ("fsdp2", fsdp2_step)):
            step()  # warm-up (DDP builds its buckets on the first backward)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(SYNC_STEPS):
                step()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / SYNC_STEPS)
    diff = max(float((p.grad - q.grad * world).abs().max())
               for p, q in zip(params, ddp_model.module.parameters()))
    diff_fsdp2 = max(float((p.grad - q.grad.full_tensor()).abs().max())
                     for p, q in zip(params, hsdp_model.parameters()))
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    Path(f"{out}.{rank}").write_text(json.dumps({"flat_s": min(times["flat"]), "ddp_s": min(times["ddp"]),
                                                 "fsdp2_s": min(times["fsdp2"]), "all": times,
                                                 "grad_diff": max(diff, diff_fsdp2), "grad_bytes": grad_bytes,
                                                 "parameters": sum(p.numel() for p in params)}))
    exit_distributed(0)


def _sync_rows(tmp: Path) -> list[dict]:
    """One row: seconds per training step (forward + backward + gradient sum) of a 2.9M-parameter Llama on 2 gloo
    processes: grove's flat buffer (``distributed.strategy: replicate``), torch DDP, and FSDP2 on a (2 x 1) mesh
    (``fsdp2`` with ``distributed.replicate: 2``); best block of each, blocks alternating so that other load hits
    all three; the summed gradients' largest difference from the flat buffer's."""
    import multiprocessing

    import torch.multiprocessing as mp

    out = tmp / "sync.json"
    multiprocessing.set_forkserver_preload(["torch", "transformers", "shared_rl.distributed"])
    mp.start_processes(_sync_worker, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="forkserver")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    flat, ddp, fsdp2 = (max(r[f"{k}_s"] for r in ranks) for k in ("flat", "ddp", "fsdp2"))
    return [{"variant": "grad sync 2 proc: flat buffer vs DDP vs fsdp2 replicate", "parameters": ranks[0]["parameters"],
             "flat_s_per_step": flat, "ddp_s_per_step": ddp, "fsdp2_replicate_s_per_step": fsdp2,
             "ddp_over_flat": ddp / flat, "fsdp2_replicate_over_flat": fsdp2 / flat,
             "flat_extra_bytes": ranks[0]["grad_bytes"], "max_grad_difference": max(r["grad_diff"] for r in ranks)}]


# ---- per-GPU memory of large models under FSDP2, computed (not measured) -------------------------------------
GPUS = (1, 8, 16)


def _meta_parameters() -> dict[str, tuple[int, str]]:
    """Parameter counts of the released architectures, built on the meta device (no weights, no download):
    diffusers' transformer classes with the published configs, and LeRobot's π0.5 model (PaliGemma 2B + the
    300M action expert)."""
    import torch

    counts: dict[str, tuple[int, str]] = {}

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    import diffusers

    with torch.device("meta"):
        flux = diffusers.FluxTransformer2DModel(guidance_embeds=True)  # FLUX.1-dev's config (guidance-distilled)
        counts["FLUX.1-dev transformer"] = (count(flux), "one transformer")
        qwen = diffusers.QwenImageTransformer2DModel()  # the defaults are Qwen-Image's config
        counts["Qwen-Image transformer"] = (count(qwen), "one transformer")
        wan = diffusers.WanTransformer3DModel()  # the defaults are the 14B Wan config (each A14B expert)
        counts["Wan 2.2 A14B (two experts)"] = (2 * count(wan), "both experts resident")
    try:
        from lerobot.policies.pi05.configuration_pi05 import PI05Config
        from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

        with torch.device("meta"):
            counts["π0.5 (LeRobot)"] = (count(PI05Pytorch(PI05Config(device="cpu"))), "VLM + action expert")
    except ImportError:  # lerobot is an optional dependency
        pass
    return counts


def memory_table() -> str:
    """Markdown: per-GPU bytes of the persistent training state under FSDP2 on 1 / 8 / 16 GPUs, from parameter
    counts (``shared_rl.memory_estimate``, the arithmetic ``grove train --dry-run`` prints). Full fine-tuning: fp32
    shards (4 B/parameter) + fp32 gradients (4) + AdamW's two fp32 moments (8) + the frozen KL reference copy,
    sharded (4) = 20 B/parameter; LoRA: the frozen base in bf16 (2 B/parameter), adapters and their state
    negligible. Divided by the number of GPUs sharing the shards (under HSDP: per replica group)."""
    from shared_rl.memory_estimate import ParameterGroup, full_finetune_groups, per_process_bytes

    rows = ["| model | parameters | full fine-tuning, 1 / 8 / 16 GPUs | LoRA (bf16 base), 1 / 8 / 16 GPUs |",
            "|---|---|---|---|"]
    for name, (n, what) in _meta_parameters().items():
        full = " / ".join(f"{per_process_bytes(full_finetune_groups(n), 'fsdp2', g) / 2**30:,.1f}" for g in GPUS)
        lora = " / ".join(f"{per_process_bytes([ParameterGroup('base', n, False, 2)], 'fsdp2', g) / 2**30:,.1f}"
                          for g in GPUS)
        rows.append(f"| {name} | {n / 1e9:.2f} B ({what}) | {full} GiB | {lora} GiB |")
    return "\n".join(rows)


def run(out_dir: Path, quick: bool = False) -> dict:
    rows = []
    domains = ["toy"] if quick else list(DOMAIN_CONFIGS)
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for name in domains:
            config, overrides = DOMAIN_CONFIGS[name]
            if not (REPO_ROOT / config).is_file():
                rows.append({"variant": name, "note": f"{config} missing"})
                continue
            if quick:
                overrides = overrides + ["iterations=3"]
            row = {"variant": name}
            row.update(_alternating(config, overrides, tmp, name, 1 if quick else REPEATS))
            row.update(_checkpoint_cost(config, [o for o in overrides if "groups_per_call" not in o], tmp / f"{name}-ck"))
            rows.append(row)
        if not quick:
            rows += _memory_rows(tmp)
            rows += _sync_rows(tmp)
    notes = ("samples/s = leaves / wall time of a whole iteration, median over the iterations after the first, from "
             "each run's metrics.jsonl; same config and global batch for 1 and 2 processes (gloo, CPU); runs "
             f"alternate 1, 2, 1, 2 ({1 if quick else REPEATS} rounds, best round per layout); load_avg = the 1-minute "
             "load average before each run (other jobs on the machine). One process uses all cores' threads, two "
             "processes one core each: on 2 cores the ratio is bounded by ~2x and noisy. Checkpoint = trainable "
             "weights + optimizer + state, written atomically with checksums; load = resume from it. memory rows: "
             "bytes of trained parameters, gradients and AdamW state held by the busiest process after one optimizer step "
             "of a tiny Llama (hidden 64, 4 layers, full fine-tuning) under distributed.strategy fsdp2 with 1, 2 "
             "and 4 gloo processes (1 process: nothing sharded). grad sync row: seconds per forward + backward + "
             "gradient sum of a 2.9M-parameter Llama on 2 gloo processes, grove's flat buffer (replicate) vs torch "
             "DDP vs FSDP2 on a 2 x 1 mesh (fsdp2 with distributed.replicate 2), best of alternating blocks.")
    return write_results(out_dir, "scale", rows, notes, doc_path=None if quick else REPO_ROOT / "docs/bench/scale.md")
