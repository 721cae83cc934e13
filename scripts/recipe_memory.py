"""The ``# memory:`` line of every recipe's header (configs/**/*.yaml but the accelerate launch files), computed
the way ``--dry-run`` estimates memory (``shared_rl.cli.memory_estimate_line``: the domain's ``parameter_groups``,
parameter counts on the meta device, through ``shared_rl.memory_estimate``), without spawning the CLI.

What the number covers is what that estimate covers: the persistent training state per process, i.e. weights,
gradients and AdamW's two moments of the trained parameters and the weights alone of the frozen ones (a LoRA base,
the KL reference copy, encoders). Not activations, rollout buffers, envs, caches or the allocator's slack.

Where the domain counts nothing before loading (an uncached hub id, a LeRobot policy, the world-model strategies,
a supervised job) the line says so; the GPU recipes whose model docs/scaling.md's computed table covers take their
number from that table (``FROM_DOCS``) and say so. Recipes launched on several processes state the process count
their header's ``WORLD_SIZE=N ... --dry-run`` names.

    .venv/bin/python scripts/recipe_memory.py            # write / update the line in every recipe
    .venv/bin/python scripts/recipe_memory.py --check    # exit 1, naming them, when a line is missing or stale
    .venv/bin/python scripts/recipe_memory.py configs/toy.yaml   # only these recipes
    .venv/bin/python scripts/recipe_memory.py --measure configs/toy.yaml   # also measure a peak (see below)

``--measure`` runs each named recipe (default: ``MEASURE``, the CPU recipes that fit a 2-core, few-GB machine) for
ONE iteration, as written but for the overrides ``MEASURE_OVERRIDES`` gives (``iterations=1``, plus, per recipe, only
what the line names), each in its own subprocess (``grove train RECIPE iterations=1 --out TMP``, run one at a time),
and writes a second header line, ``# peak memory (measured): ~N GB resident, ...``, right after the ``# memory:``
one. The peak is the larger of (a) the child's ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` (the kernel's exact
peak of the largest single process of the tree; read in a fresh intermediate process per recipe, so one recipe's
peak never leaks into the next) and (b) the largest sum of the tree's resident set sizes seen by polling it every
0.1 s with psutil (env worker processes run beside the trainer, so the sum at one instant is what the machine must
hold; pages a forked worker shares with its parent count in both, so it errs high); the line says which one it is.
Without psutil, (b) reads /proc/<pid>/status (VmRSS) of the tree instead. The evaluation a recipe runs before the
first update and at the end runs too: it is part of what the machine must hold. Recipes not measured keep only the
estimate line; a measured line is never touched by the estimate pass nor by ``--check`` (rerun ``--measure`` after a
change that moves memory: the numbers are one machine's, at one code version).

Comments only: the YAML a recipe parses to is never changed (checked before each write).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PREFIX = "# memory: "
WHAT = "weights, plus gradients and AdamW moments of the trained ones"
MEASURED = "# peak memory (measured): "
# the recipes --measure runs by default: the README's first-hour ones first, then the other CPU recipes that fit
MEASURE = ["configs/toy.yaml", "configs/visgen/shapes_grpo.yaml", "configs/llm/arith_grpo.yaml",
           "configs/robotics/metaworld_grpo.yaml",
           *(f"configs/llm/arith_{m}.yaml" for m in ("dapo", "drgrpo", "gspo", "mcgrpo", "rloo", "tree")),
           "configs/robotics/metaworld_mt5_rl.yaml", "configs/visgen/shapes_fast.yaml",
           "configs/robotics/metaworld_grpo_door.yaml", "configs/robotics/metaworld_mt5_ppo.yaml",
           "configs/visgen/words_ocr_grpo.yaml", "configs/visgen/video_shapes_grpo.yaml",
           "configs/visgen/video_shapes_branch.yaml", "configs/visgen/video_shapes_tree.yaml",
           "configs/visgen/shapes_dpo.yaml"]
# not measured: the supervised jobs (no iterations), GPU / uncached-hub recipes, and the LIBERO ones (~7-13 GB by
# their headers' prose; measuring them needs a machine with that much free)
# extra overrides per recipe beyond iterations=1, only where the recipe's evaluation alone would take most of an hour
# on 2 cores; the shrunk evaluation runs in the same env worker processes the rollouts use, so the peak still holds
# every env and the rollout's buffers
MEASURE_OVERRIDES: dict[str, list[str]] = {
    "configs/robotics/metaworld_mt5_rl.yaml": ["eval.at_start=false", "robotics.eval_states_per_task=8"],
    "configs/robotics/metaworld_mt5_ppo.yaml": ["eval.at_start=false", "robotics.eval_states_per_task=8"],
}
NOT_INCLUDED = "activations, rollout buffers and envs not included"
# recipe -> (row of docs/scaling.md's computed table, "full" or "lora", GPUs sharing the shards)
FROM_DOCS = {
    "configs/visgen/flux_dev_full_fsdp2.yaml": ("FLUX.1-dev transformer", "full", 8),
    "configs/visgen/flux_hps.yaml": ("FLUX.1-dev transformer", "lora", 1),
    "configs/visgen/qwen_image_ocr.yaml": ("Qwen-Image transformer", "lora", 1),
    "configs/visgen/wan22_a14b_hsdp.yaml": ("Wan 2.2 A14B (two experts)", "lora", 8),
    "configs/robotics/pi05_base_grpo_gpu.yaml": ("π0.5 (LeRobot)", "lora", 1),
    "configs/robotics/pi05_libero_grpo_gpu.yaml": ("π0.5 (LeRobot)", "lora", 1),
}
DOCS_GPUS = (1, 8, 16)  # the table's columns (bench.scale.GPUS)


def recipes() -> list[Path]:
    return [p for p in sorted((ROOT / "configs").rglob("*.yaml")) if "accelerate" not in p.parts]


def header(text: str) -> list[str]:
    """The leading comment block's lines."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def _processes(text: str) -> int:
    m = re.search(r"WORLD_SIZE=(\d+)", "\n".join(header(text)))
    return int(m.group(1)) if m else 1


def _from_docs(row: str, mode: str, shards: int) -> str:
    table = (ROOT / "docs/scaling.md").read_text()
    m = re.search(rf"^\| {re.escape(row)} \|[^|]*\|([^|]*)\|([^|]*)\|", table, re.M)
    if m is None:
        raise SystemExit(f"docs/scaling.md has no computed row {row!r}")
    column = (m.group(1) if mode == "full" else m.group(2)).replace("GiB", "").split("/")
    return f"{column[DOCS_GPUS.index(shards)].strip()} GiB"


def _layout(strategy: str, world: int, shards: int) -> str:
    layout = f"{strategy}, {world} process{'es' if world > 1 else ''}"
    return layout + (f", sharded {shards}-way" if strategy == "fsdp2" and shards not in (1, world) else "")


def _no_estimate(cfg) -> str:
    d = cfg.domain_config
    if cfg.domain == "robotics":
        from robotics.part_settings import WORLD_MODEL_ROLLOUTS

        why = ("a LeRobot policy" if d.policy.type != "tiny_vla" else
               "the world-model strategy" if d.rollout.name in WORLD_MODEL_ROLLOUTS else "its policy checkpoint")
        return f"no estimate: --dry-run counts no parameters of {why} (the run logs a memory line once loaded)"
    model = getattr(d, "model", "its model")
    return f"not estimated here: {model} is not in the local Hugging Face cache (--dry-run counts it once it is)"


def memory_line(path: Path) -> str:
    """The ``# memory:`` line ``path``'s header should carry, computed now."""
    from shared_rl.config import load_train_config, load_yaml
    from shared_rl.memory_estimate import _size, per_process_bytes

    text = path.read_text()
    data = load_yaml(path)
    if data.get("kind") == "supervised":
        return PREFIX + "no estimate: a supervised job (its --dry-run checks the job's settings, counts no parameters)"
    cfg = load_train_config(data)
    strategy, world = cfg.distributed.strategy, _processes(text)
    shards = world // max(1, cfg.distributed.replicate or 1) if strategy == "fsdp2" else 1
    name = str(path.relative_to(ROOT))
    groups = cfg.domain_config.parameter_groups(cfg)
    if groups:
        size = _size(per_process_bytes(groups, strategy, shards))
        return (PREFIX + f"~{size} per process ({_layout(strategy, world, shards)}): {WHAT} (--dry-run's estimate "
                f"from parameter counts; {NOT_INCLUDED})")
    if name in FROM_DOCS:
        row, mode, docs_shards = FROM_DOCS[name]
        size, layout = _from_docs(row, mode, docs_shards), _layout(strategy, world, docs_shards)
        gathered = ", nor the rollout's gathered copy" if strategy == "fsdp2" else ""
        if mode == "full":
            return (PREFIX + f"~{size} per process ({layout}): {WHAT} (from docs/scaling.md's computed table: {row}, "
                    f"full fine-tuning; {NOT_INCLUDED}{gathered})")
        return (PREFIX + f"~{size} per process ({layout}): the frozen bf16 base's weights (from docs/scaling.md's "
                f"computed table: {row}, LoRA; adapters, other components, {NOT_INCLUDED}{gathered})")
    return PREFIX + _no_estimate(cfg)


def _with_header_line(text: str, prefix: str, line: str, insert_after: str | None = None) -> str:
    """``text`` with its header's one ``prefix`` line replaced by ``line`` (extra copies dropped), or ``line`` put
    right after the header's ``insert_after`` line when there is one, else at the header's end."""
    lines = text.split("\n")
    head = len(header(text))
    found = [i for i in range(head) if lines[i].startswith(prefix)]
    if found:
        lines[found[0]] = line
        for i in reversed(found[1:]):
            del lines[i]
        return "\n".join(lines)
    after = [i for i in range(head) if insert_after and lines[i].startswith(insert_after)]
    lines.insert(after[0] + 1 if after else head, line)
    return "\n".join(lines)


def with_line(text: str, line: str) -> str:
    """``text`` with its header's ``# memory:`` line replaced by ``line``, or ``line`` appended to the header."""
    return _with_header_line(text, PREFIX, line)


def with_measured(text: str, line: str) -> str:
    """``text`` with its header's measured line replaced by ``line``, or ``line`` put right after the ``# memory:``
    line (or at the header's end)."""
    return _with_header_line(text, MEASURED, line, insert_after=PREFIX)


def _tree_rss(pid: int) -> tuple[int, int]:
    """(summed resident bytes, process count) of ``pid`` and its descendants now."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return 0, 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total, len(procs)
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    todo, total, count = [pid], 0, 0
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            status = (Path("/proc") / str(p) / "status").read_text()
        except OSError:
            continue
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        total, count = total + (int(m.group(1)) * 1024 if m else 0), count + 1
    return total, count


def _measure_one(recipe: str) -> dict:
    """Run ``recipe`` for one iteration in a child; its peaks. Called in a fresh process per recipe (``--_one``)."""
    import resource
    import subprocess
    import tempfile
    import time

    overrides = ["iterations=1"] + MEASURE_OVERRIDES.get(recipe, [])
    with tempfile.TemporaryDirectory(prefix="grove-measure-") as tmp:
        cmd = [sys.executable, "-m", "shared_rl.cli", "train", str(ROOT / recipe), *overrides, "--out", f"{tmp}/run"]
        start = time.time()
        log = open(f"{tmp}/log.txt", "w")
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        tree_peak, most = 0, 1
        while child.poll() is None:
            total, count = _tree_rss(child.pid)
            tree_peak, most = max(tree_peak, total), max(most, count)
            time.sleep(0.1)
        log.close()
        tail = Path(f"{tmp}/log.txt").read_text()[-3000:]
    single = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    return {"recipe": recipe, "rc": child.returncode, "overrides": overrides, "single_peak": single,
            "tree_peak": tree_peak, "processes": most, "seconds": round(time.time() - start, 1), "tail": tail}


def measured_line(result: dict) -> str:
    """The fixed-form measured line from ``_measure_one``'s result."""
    import os

    single, tree = result["single_peak"], result["tree_peak"]
    cores = len(os.sched_getaffinity(0))
    if result["processes"] > 1 and tree > single:
        try:
            import psutil  # noqa: F401
            how = "psutil"
        except ImportError:
            how = "/proc"
        size, source = tree, f"{result['processes']} processes summed, polled by {how}"
    else:
        size, source = single, "largest process, getrusage ru_maxrss"
    gb = size / 1e9
    shown = f"{gb:.1f}" if gb >= 0.95 else f"{gb:.2f}"
    command = " ".join(["grove train", result["recipe"], *result["overrides"]])
    return (MEASURED + f"~{shown} GB resident ({source}), one iteration on {cores} CPU core{'s' * (cores > 1)} "
            f"({command}; scripts/recipe_memory.py --measure)")


def measure(paths: list[Path]) -> int:
    import json
    import subprocess

    import yaml

    failed = []
    for path in paths:
        recipe = str(path.relative_to(ROOT))
        out = subprocess.run([sys.executable, __file__, "--_one", recipe], cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            failed.append(recipe)
            print(f"{recipe}: the measuring process failed\n{out.stderr[-2000:]}")
            continue
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if result["rc"] != 0:
            failed.append(recipe)
            print(f"{recipe}: exit {result['rc']} after {result['seconds']} s; nothing written\n{result['tail']}")
            continue
        line = measured_line(result)
        text = path.read_text()
        new = with_measured(text, line)
        assert yaml.safe_load(new) == yaml.safe_load(text), path  # comments only
        path.write_text(new)
        print(f"{recipe} ({result['seconds']} s; largest process {result['single_peak'] / 1e9:.2f} GB, tree "
              f"{result['tree_peak'] / 1e9:.2f} GB over {result['processes']} process(es))\n  {line}", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="recipes (default: every recipe under configs/)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a line is stale")
    parser.add_argument("--measure", action="store_true",
                        help="run each recipe (default: MEASURE) for one iteration and write its measured peak line")
    parser.add_argument("--_one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._one:
        import json

        print(json.dumps(_measure_one(args._one)))
        return 0
    if args.measure:
        return measure([p.resolve() for p in args.paths] or [ROOT / r for r in MEASURE])
    stale = []
    for path in [p.resolve() for p in args.paths] or recipes():
        text = path.read_text()
        new = with_line(text, memory_line(path))
        if new == text:
            continue
        stale.append(str(path.relative_to(ROOT)))
        if not args.check:
            assert yaml.safe_load(new) == yaml.safe_load(text), path  # comments only
            path.write_text(new)
    verb = "stale or missing" if args.check else "updated"
    print(f"{len(stale)} recipe(s) {verb}" + "".join(f"\n  {s}" for s in stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
