"""``configs/robotics/libero_grpo_small.yaml`` is ``libero_grpo.yaml`` with the override set its header names, and
nothing else: the recipe cannot drift from the one it shrinks, and the override set the header gives for the SmolVLA
recipe is the one that made it. The envs it holds at once (an env serves one task; a run keeps, per task, as many as
its largest batch of that task: docs/methods/libero.md) are counted from the settings. Reads YAML only."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from shared_rl.config import apply_overrides, load_yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "robotics"


def _header_overrides(path: Path, recipe: str) -> list[str]:
    header = "\n".join(line[1:] for line in path.read_text().splitlines() if line.startswith("#"))
    header = re.sub(r"\\\n\s*", " ", header)
    command = re.search(rf"grove train configs/robotics/{re.escape(recipe)} ([^\n]*)", header)
    assert command, f"{path.name}'s header names no override set for {recipe}"
    return shlex.split(command.group(1))


def _envs_held(data: dict) -> int:
    env, rollout = data["robotics"]["env"], data["rollout"]
    tasks = len(env["tasks"])
    per_call = rollout.get("groups_per_call") or rollout["groups_per_iteration"]
    return tasks * max(per_call * rollout["group_size"], -(-env.get("eval_batch", 0) // tasks))


def test_the_small_preset_is_libero_grpo_with_its_header_s_overrides():
    small = CONFIGS / "libero_grpo_small.yaml"
    overrides = _header_overrides(small, "libero_smolvla_tiny_grpo.yaml")
    assert apply_overrides(load_yaml(CONFIGS / "libero_grpo.yaml"), overrides) == load_yaml(small)


def test_the_small_override_set_holds_two_envs_per_task_where_the_recipes_hold_eight():
    small = CONFIGS / "libero_grpo_small.yaml"
    overrides = _header_overrides(small, "libero_smolvla_tiny_grpo.yaml")
    for recipe in ("libero_grpo.yaml", "libero_smolvla_tiny_grpo.yaml"):
        data = load_yaml(CONFIGS / recipe)
        assert _envs_held(data) == 32, recipe
        shrunk = apply_overrides(data, overrides)
        assert _envs_held(shrunk) == 8 and shrunk["robotics"]["env"]["num_workers"] == 0, recipe
