"""The method registry: a new branching method is one small class (the worked example of docs/architecture.md),
registered by name, configured as a tagged union, and trained by the unchanged domain and trainer."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer
from visgen.engine import StepSegment, grow_forest
from visgen.methods import METHODS, Grown, RolloutMethod, method_from_config, register_method


@dataclass
class LateBranchSettings:
    split_step: int = 5  # the grid step where the group branches


class LateBranch(RolloutMethod):
    """ODE to ``split_step``, one SDE step branching ``rollout.group_size`` ways, ODE to the image."""

    name = "late_branch"
    settings_class = LateBranchSettings

    def grow(self, adapter, cond, keys, group_size, sigmas, timesteps, generator, iteration, k, first_forward_id):
        T, s = int(timesteps.numel()), self.settings.split_step
        prefix = StepSegment.from_grid(sigmas, timesteps, [(i, 1) for i in range(s)], [False] * s, [False] * s,
                                       [0.0] * s)
        tail = list(range(s + 1, T))
        split = StepSegment.from_grid(sigmas, timesteps, [(s, 1)] + [(i, 1) for i in tail],
                                      [True] + [False] * len(tail), [True] + [False] * len(tail),
                                      [k.noise_level] + [0.0] * len(tail))
        x0 = adapter.prepare_latents(len(keys), cond, generator)
        forest = grow_forest(adapter, cond, x0, [(1, prefix), (group_size, split)], generator, k.kernel,
                             k.reduction, k.micro_batch, first_forward_id)
        return Grown(forest, cond, torch.arange(len(keys)), list(keys), torch.arange(len(keys)))


@pytest.fixture
def late_branch():
    register_method(LateBranch)
    yield
    METHODS.pop("late_branch")


def test_registry_lists_every_method_once_with_its_shape():
    assert {n: c.structure for n, c in METHODS.items() if n != "late_branch"} == {
        "flow_grpo": "flat", "dance_grpo": "flat", "flow_grpo_fast": "flat", "mix_grpo": "flat", "explicit": "flat",
        "ode": "flat", "dpm2": "flat",
        "branch_grpo": "tree", "branch_grpo_mix": "tree", "tree_grpo": "tree", "egrpo": "tree"}
    with pytest.raises(ValueError, match="already registered"):
        register_method(METHODS["egrpo"])


def test_a_new_method_is_one_class_and_a_yaml(late_branch, tiny_dir):
    cfg = load_train_config({
        "domain": "visgen", "seed": 0, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 3},
        "advantage": {"estimator": "depth_zscore", "weights": {"shapes_strict": 0.0}},
        "loss": {"clip_low": 1e-3}, "optim": {"lr": 1e-3}, "logging": {"progress": False},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "method": {"name": "late_branch", "split_step": 2}},
    })
    tr = Trainer(cfg, None, log=lambda *_: None)
    m = tr.iteration(0)
    assert m["tree/leaves"] == 6 and m["tree/trained_edges"] == 6  # 2 prompts x 3 children of the split
    assert m["ratio/mean"] == 1.0 and m["ratio/max"] == 1.0 and m["grad_norm"] > 0 and math.isfinite(m["loss/policy"])
    # 2 prefix forwards + 1 split forward (shared by the siblings) + 3 x 1 tail step, per prompt
    assert m["nfe/rollout"] == 2 * (2 + 1 + 3)
    with pytest.raises(ConfigError, match="unknown config key.*split_steps"):
        method_from_config({"name": "late_branch", "split_steps": [2]})
    with pytest.raises(ConfigError, match="needs tree rollouts|tree"):
        load_train_config({"domain": "visgen", "rollout": {"group_size": 4},
                           "advantage": {"estimator": "depth_zscore"},
                           "visgen": {"model": str(tiny_dir), "num_inference_steps": 4,
                                      "method": {"name": "flow_grpo"}}})
