"""Short fixed-seed training runs whose metrics are frozen as fixtures (``tests/golden/*.jsonl``).

They pin behaviour across restructurings: ``tests/test_golden.py`` reruns each and compares every non-timing
metric with the recorded one. Regenerate (only when a change is *meant* to alter results, and say so in the commit):

    .venv/bin/python -m tests.golden.runs            # all
    .venv/bin/python -m tests.golden.runs visgen_flat

Each run is a shipped recipe (its YAML) shrunk by overrides to seconds on a CPU. The overrides follow the config
schema of the day (the fixtures were recorded under the one before issue 12: ``visgen.plan``/``visgen.tree``/
``visgen.sampler``, E-GRPO's own group_size); the recorded metrics are what must not change.
"""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

_VIS = {"iterations": 2, "eval": {"at_start": True, "every": 0},
        "rollout": {"groups_per_iteration": 2}, "checkpoint": {"every": 0},
        "logging": {"progress": False},
        "visgen": {"num_threads": 1, "eval": {"max_prompts": 3, "samples_per_prompt": 1, "grid_prompts": 0}}}

# name -> (recipe, overrides merged into it)
RUNS: dict[str, tuple[str, dict]] = {
    "toy": ("configs/toy.yaml", {"iterations": 3}),
    "visgen_flat": ("configs/visgen/shapes_grpo.yaml",
                    {**_VIS, "rollout": {"groups_per_iteration": 2, "group_size": 4},
                     "optim": {"minibatches_per_epoch": 2}, "visgen": {**_VIS["visgen"], "num_inference_steps": 4}}),
    "visgen_dance": ("configs/visgen/shapes_dance.yaml",
                     {**_VIS, "rollout": {"groups_per_iteration": 2, "group_size": 4},
                      "visgen": {**_VIS["visgen"], "num_inference_steps": 5}}),
    "visgen_mix": ("configs/visgen/shapes_mix.yaml",
                   {**_VIS, "rollout": {"groups_per_iteration": 2, "group_size": 4},
                    "visgen": {**_VIS["visgen"], "num_inference_steps": 6}}),
    "visgen_branch": ("configs/visgen/shapes_branch.yaml",
                      {**_VIS, "visgen": {**_VIS["visgen"], "num_inference_steps": 5,
                                          "method": {"split_steps": [0, 2], "factor": [2]}},
                      "rollout": {"groups_per_iteration": 2, "group_size": 4}}),
    "visgen_branch_prune": ("configs/visgen/shapes_branch_prune.yaml",
                            {**_VIS, "visgen": {**_VIS["visgen"], "num_inference_steps": 6,
                                                "method": {"split_steps": [0, 2, 3], "factor": [2]}},
                            "rollout": {"groups_per_iteration": 2, "group_size": 8}}),
    "visgen_tree": ("configs/visgen/shapes_tree.yaml",
                    {**_VIS, "visgen": {**_VIS["visgen"], "num_inference_steps": 6,
                                        "method": {"branch": [2, 2]}},
                    "rollout": {"groups_per_iteration": 2, "group_size": 4}}),
    "visgen_egrpo": ("configs/visgen/shapes_egrpo.yaml",
                     {**_VIS, "visgen": {**_VIS["visgen"], "num_inference_steps": 6,
                                         "method": {}},
                     "rollout": {"groups_per_iteration": 2, "group_size": 3}}),
    "llm_flat": ("configs/llm/arith_grpo.yaml",
                 {"iterations": 2, "rollout": {"groups_per_iteration": 4, "group_size": 4},
                  "eval": {"at_start": True, "every": 0}, "checkpoint": {"every": 0}, "logging": {"progress": False},
                  "llm": {"eval": {"num_prompts": 8}}}),
    "llm_tree": ("configs/llm/arith_tree.yaml",
                 {"iterations": 2, "rollout": {"groups_per_iteration": 4},
                  "eval": {"at_start": True, "every": 0}, "checkpoint": {"every": 0}, "logging": {"progress": False},
                  "llm": {"eval": {"num_prompts": 8}}}),
    "robotics": ("configs/robotics/metaworld_grpo.yaml",
                 {"iterations": 2, "rollout": {"groups_per_iteration": 2, "group_size": 3},
                  "eval": {"at_start": True, "every": 0}, "checkpoint": {"every": 0},
                  "robotics": {"eval_states_per_task": 1, "train_states_per_task": 4, "gifs": False,
                               "env": {"horizon": 16}}}),
}

# metrics that depend on the machine's speed, not on the computation
TIMING_PREFIXES = ("time/", "samples_per_s", "env_steps_per_s", "throughput")


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def config(name: str) -> dict:
    recipe, over = RUNS[name]
    return merge(yaml.safe_load((ROOT / recipe).read_text()), over)


def is_timing(key: str) -> bool:
    return key.startswith(TIMING_PREFIXES) or "/time" in key or key.endswith("_per_s") or key.endswith("/seconds")


def run(name: str, run_dir: Path) -> list[dict]:
    """Train ``name`` in ``run_dir``; returns the non-timing metric records (as in metrics.jsonl)."""
    import torch

    from shared_rl.config import load_train_config
    from shared_rl.metrics import read_metrics
    from shared_rl.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_train_config(config(name))
    Trainer(cfg, run_dir, log=lambda *_: None).fit()
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in read_metrics(run_dir / "metrics.jsonl")]


def fixture(name: str) -> Path:
    return HERE / f"{name}.jsonl"


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in fixture(name).read_text().splitlines() if line.strip()]


# outcomes: always exact, whatever the run's float tolerance (a changed sample or episode shows here first)
EXACT_PREFIXES = ("reward/", "groups/", "nfe/", "eval/", "env/", "tree/", "frac_zero_std", "step")


def compare(expected: list[dict], got: list[dict], rel: float = 0.0, abs_: float = 0.0,
            outcome_rel: float = 0.0) -> list[str]:
    """Mismatches as readable lines (empty: identical; ``rel``/``abs_`` loosen the non-outcome floats,
    ``outcome_rel`` the outcome floats — rewards, evaluation — relative to their size)."""
    bad = []
    if len(expected) != len(got):
        return [f"{len(got)} records, expected {len(expected)}"]
    for i, (e, g) in enumerate(zip(expected, got)):
        ek = {k for k in e if not is_timing(k)}
        gk = {k for k in g if not is_timing(k)}
        if ek != gk:
            bad.append(f"record {i}: keys differ: missing {sorted(ek - gk)}, extra {sorted(gk - ek)}")
        for k in sorted(ek & gk):
            a, b = e[k], g[k]
            if isinstance(a, float) and isinstance(b, (int, float)):
                if math.isnan(a) and math.isnan(b):
                    continue
                tol = outcome_rel * abs(a) if k.startswith(EXACT_PREFIXES) else abs_ + rel * abs(a)
                if not abs(a - b) <= tol:
                    bad.append(f"record {i}: {k} = {b!r}, expected {a!r}")
            elif a != b:
                bad.append(f"record {i}: {k} = {b!r}, expected {a!r}")
    return bad


def main(names: list[str]) -> None:
    import tempfile

    for name in names or list(RUNS):
        with tempfile.TemporaryDirectory() as tmp:
            records = run(name, Path(tmp))
        fixture(name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
        print(f"{name}: {len(records)} records -> {fixture(name).relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
