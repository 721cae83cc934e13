"""The one ``# memory:`` line of every recipe's header (configs/**/*.yaml but the accelerate launch files), computed
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


def with_line(text: str, line: str) -> str:
    """``text`` with its header's ``# memory:`` line replaced by ``line``, or ``line`` appended to the header."""
    lines = text.split("\n")
    head = len(header(text))
    found = [i for i in range(head) if lines[i].startswith(PREFIX)]
    if found:
        lines[found[0]] = line
        for i in reversed(found[1:]):
            del lines[i]
    else:
        lines.insert(head, line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="recipes (default: every recipe under configs/)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a line is stale")
    args = parser.parse_args(argv)
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
