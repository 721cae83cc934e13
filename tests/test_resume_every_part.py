"""Exact resume for every registered part (issue 65): one test, its list read from the registries.

``registered()`` reads what a config can name from the registries themselves — the domains
(``shared_rl.registry.DOMAINS``), the advantage estimators, policy losses and KL estimators, the key samplers and group
filters (``SelectionConfig``'s choices), visgen's rollout methods and objectives, robotics' rollout strategies and
every ``robotics.parts.Part`` subclass (the critic, replays, adapter steps, keep-best, the strategies), robotics'
per-task balance. ``CASES`` are tiny configs, each naming what it covers; ``EXCLUDED`` names what has no case and
why. ``test_every_registered_part_is_covered`` fails when a registered name is in neither: a new part, method or
estimator without a resume case fails CI by construction.

``test_resume_equals_uninterrupted[case]`` runs each case three ways (``tests/resume_harness.py``): uninterrupted,
killed inside the third of three iterations (after its rollout), and resumed from the checkpoint — the records, the final weights
(``Domain.state_dict``) and the exported ``final/`` files must be identical. Each case is a few seconds at most.
"""
from __future__ import annotations

import copy
import os
import typing
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import pytest
import torch
import yaml

from tests.golden.runs import merge
from tests.resume_harness import resume_mismatches

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- the registries
def _part_classes() -> set[str]:
    """Every ``robotics.parts.Part`` subclass, the strategies' modules imported (each strategy is a Part)."""
    import importlib

    from robotics.parts import Part
    from robotics.rollouts import ROLLOUTS

    import robotics.domain  # noqa: F401  (the critic, replays, adapters)

    for target in ROLLOUTS.values():
        importlib.import_module(target.partition(":")[0])
    out, todo = set(), [Part]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith(("robotics.", "visgen.", "shared_rl.")):  # not a test's own subclass
                out.add(sub.__name__)
            todo.append(sub)
    return out


def registered() -> set[tuple[str, str]]:
    from shared_rl.advantages import ESTIMATORS
    from shared_rl.config import SelectionConfig
    from shared_rl.losses import KL_ESTIMATORS, POLICY_LOSSES
    from shared_rl.registry import DOMAINS

    from robotics.rollouts import ROLLOUTS
    from visgen.methods import METHODS
    from visgen.objectives import OBJECTIVES

    hints = typing.get_type_hints(SelectionConfig)
    out = {("domain", n) for n in DOMAINS}
    out |= {("estimator", n) for n in ESTIMATORS} | {("policy_loss", n) for n in POLICY_LOSSES}
    out |= {("kl_estimator", n) for n in KL_ESTIMATORS}
    out |= {("sampler", n) for n in typing.get_args(hints["sampler"])}
    out |= {("filter", n) for n in typing.get_args(hints["filter"])}
    out |= {("visgen_method", n) for n in METHODS} | {("visgen_objective", n) for n in OBJECTIVES}
    out |= {("robotics_rollout", n) for n in ROLLOUTS} | {("robotics_part", n) for n in _part_classes()}
    from robotics.balance import BalanceConfig
    from shared_rl.two_stage import SELECTORS

    out |= {("robotics_balance", n) for n in typing.get_args(typing.get_type_hints(BalanceConfig)["by"])}
    out |= {("two_stage_selector", n) for n in SELECTORS}  # the explorers' selectors (visgen two-stage, verified)
    return out


EXCLUDED: dict[tuple[str, str], str] = {
    ("robotics_part", "RolloutStrategy"): "the strategies' base class: each strategy has its own case",
    ("policy_loss", "guard"): "GRPO-Guard reweights by the per-step transition std of flow domains; the toy has "
                              "none (it is stateless: a function of the batch)",
}


# ---------------------------------------------------------------------------------------------------- the cases
TOY = {"domain": "toy", "seed": 3, "rollout": {"groups_per_iteration": 2, "group_size": 4},
       "optim": {"lr": 0.2, "minibatches_per_epoch": 2}, "eval": {"at_start": True},
       "toy": {"num_contexts": 4, "num_actions": 3, "horizon": 2, "reward_noise": 0.1}}

FLAT_ESTIMATORS = ["grpo", "batch_std", "batch_std_population", "dr_grpo", "grpo_population", "mc_median", "rloo"]
TREE_ESTIMATORS = ["depth_zscore", "leaf_global", "sibling", "tree_leaf_zscore", "treerl"]
TOY_LOSSES = ["clipped", "gspo", "cispo", "sapo"]
SAMPLERS = ["uniform", "vade", "history"]
FILTERS = ["none", "zero_std", "band"]


def _toy_cases() -> dict[str, tuple[dict, set]]:
    """Every flat and tree estimator with a loss, a sampler and a filter each in turn (round-robin: each name in
    at least one case, not the cross product)."""
    cases = {}
    for i, est in enumerate(FLAT_ESTIMATORS + TREE_ESTIMATORS):
        tree = est in TREE_ESTIMATORS
        loss, sampler, filt = TOY_LOSSES[i % 4], SAMPLERS[i % 3], FILTERS[i % 3]
        cfg = merge(TOY, {"advantage": {"estimator": est}, "loss": {"policy_loss": loss, "kl_coef": 0.05 * (i % 2)},
                          "selection": {"sampler": sampler, "filter": filt, "max_refill_rounds": 1,
                                        "band": [0.05, 0.95]}})
        if est == "mc_median":
            cfg["rollout"]["group_size"] = 5
        if tree:
            cfg["toy"] |= {"tree_branch": 2, "tree_depth": 2}
        covers = {("domain", "toy"), ("estimator", est), ("policy_loss", loss), ("sampler", sampler),
                  ("filter", filt), ("kl_estimator", "k3" if i % 2 else "k1")}
        if i % 2:
            cfg["loss"]["kl_estimator"] = "k3"
        cases[f"toy-{est}"] = (cfg, covers)
    return cases


_VIS_BASE = {"eval": {"at_start": False, "every": 0}, "rollout": {"groups_per_iteration": 2, "group_size": 2},
             "optim": {"backward_steps": 0},
             "visgen": {"num_threads": 1, "num_inference_steps": 4,
                        "eval": {"max_prompts": 1, "samples_per_prompt": 1, "grid_prompts": 0}}}

# method/objective -> (recipe, overrides): the shipped recipe shrunk to seconds
VISGEN: dict[str, tuple[str, dict]] = {
    "flow_grpo": ("shapes_grpo", {"loss": {"kl_coef": 0.01, "kl_estimator": "domain"},
                                  "visgen": {"ema": {"enabled": True}}}),
    # Sol-RL: the explorer is re-synced from the live weights at every rollout (state: none of its own)
    "two_stage": ("shapes_grpo", {"visgen": {"two_stage": {"enabled": True, "precision": "bf16", "candidates": 4,
                                                           "selector": "top_bottom"}}}),
    "dance_grpo": ("shapes_dance", {}),
    "flow_grpo_fast": ("shapes_fast", {"visgen": {"method": {"range_end": 2, "max_window": 2}}}),
    "mix_grpo": ("shapes_mix", {"visgen": {"num_inference_steps": 6}}),
    "explicit": ("shapes_grpo", {"visgen": {"method": None}, "loss": {"policy_loss": "gspo"}}),
    "branch_grpo": ("shapes_branch", {"visgen": {"method": {"split_steps": [0, 2], "factor": [2]}},
                                      "rollout": {"group_size": 4}}),
    "branch_grpo_mix": ("shapes_branch_mix", {"visgen": {"method": {"split_steps": [0, 2], "factor": [2],
                                                                     "sde_windows": [[0, 2]]}},
                                              "rollout": {"group_size": 4}}),
    "tree_grpo": ("shapes_tree", {"visgen": {"method": {"branch": [2, 2]}}, "rollout": {"group_size": 4}}),
    "egrpo": ("shapes_egrpo", {"visgen": {"method": {}}, "rollout": {"group_size": 2}}),
    "nft": ("shapes_nft", {}),
    "awm": ("shapes_awm", {"visgen": {"objective": {"timesteps_per_sample": 2}}}),
    "dgpo": ("shapes_dgpo", {"visgen": {"objective": {"timesteps_per_sample": 2, "trunc_steps": 2}}}),
    "dpo": ("shapes_dpo", {"visgen": {"objective": {"timesteps_per_sample": 2}}}),
    "flow_dppo": ("shapes_flowdppo", {}),  # its old copy (decay 0) is part of the state
    # the teacher is frozen (never in the checkpoint): the base asset serves, the student's LoRA moves off it
    "opd": ("shapes_opd", {"visgen": {"objective": {"teacher": "assets/shapes-sd3-tiny"}}}),
    "crd": ("shapes_crd", {"visgen": {"objective": {"timesteps_per_sample": 2}}}),  # old and sampling snapshots
    # its old copy (soft-updated each iteration), the EMA and the dpm2 sampler's rollouts
    "diffusion_opsd": ("shapes_diffusion_opsd", {"visgen": {"method": {"name": "dpm2"},
                                                            "objective": {"n_ascent": 1, "target_micro_batch": 2}}}),
}


def _visgen_cases() -> dict[str, tuple[dict, set]]:
    cases = {}
    for name, (recipe, over) in VISGEN.items():
        cfg = merge(merge(yaml.safe_load((ROOT / "configs/visgen" / f"{recipe}.yaml").read_text()), _VIS_BASE), over)
        v = cfg["visgen"]
        if name == "explicit":  # a whole method section of its own, not merged into the recipe's
            v["method"] = {"name": "explicit", "sde_steps": [0, 1, 2], "train_steps": [1]}
        method = (v.get("method") or {}).get("name")
        objective = (v.get("objective") or {}).get("name", "log_prob")
        covers = {("domain", "visgen"), ("visgen_objective", objective)}
        covers.add(("visgen_method", method or "ode"))
        if v.get("two_stage", {}).get("enabled"):
            covers.add(("two_stage_selector", v["two_stage"]["selector"]))
        if (cfg.get("loss") or {}).get("kl_estimator") == "domain":
            covers.add(("kl_estimator", "domain"))
        loss = (cfg.get("loss") or {}).get("policy_loss")
        if objective != "log_prob":
            covers.add(("policy_loss", objective))
        elif isinstance(loss, (str, dict)):
            covers.add(("policy_loss", loss if isinstance(loss, str) else loss["name"]))
        cases[f"visgen-{name}"] = (cfg, covers)
    return cases


# robotics: the point env and tiny models (tests/robotics/test_world_model_fixtures.py)
TINY_MODEL = {"cnn_channels": [8, 8, 8, 8], "feature_dim": 32, "text_dim": 8, "hidden": 64, "num_denoise_steps": 3}
POINT = {"kind": "point", "tasks": ["point-reach"], "horizon": 12}


def _robotics(policy: Path | None = None, **robotics) -> dict:
    """A point-env run of a fresh tiny VLA, or of the saved one at ``policy`` (the world model's asset's)."""
    start = {"checkpoint": str(policy)} if policy else {"checkpoint": "", "model": TINY_MODEL}
    return {"domain": "robotics", "seed": 0, "rollout": {"groups_per_iteration": 2, "group_size": 3},
            "optim": {"lr": 3e-2, "inner_epochs": 1, "minibatches_per_epoch": 1}, "eval": {"at_start": True},
            "robotics": merge({"env": POINT, **start, "head_mode": "flow_sde", "train_states_per_task": 6,
                               "eval_states_per_task": 2, "gifs": False}, robotics)}


def _robotics_cases(wm_asset: Path, policy: Path, demos: Path) -> dict[str, tuple[dict, set]]:
    part = lambda *names: {("robotics_part", n) for n in names}  # noqa: E731
    dom = {("domain", "robotics")}
    cases = {
        "robotics-flat-successes-adapters-balance": (
            _robotics(replay={"source": "successes", "coef": 1.0, "batch": 8, "success_window": 2},
                      adapters={"rank": 4, "keep_best": True, "val_states_per_task": 2},
                      balance={"enabled": True, "by": "need"}, rollout={"name": "flat"}),
            dom | part("FlatRollout", "SuccessReplay", "AdapterSteps", "KeepBestAdapters")
            | {("robotics_rollout", "flat"), ("robotics_balance", "need")}),
        "robotics-tree-demos-balance": (
            merge(_robotics(replay={"data": str(demos), "coef": 0.5, "batch": 8}, balance={"enabled": True},
                            rollout={"name": "tree", "branch": {"at_chunks": [0, 1], "factors": [2, 2]}}),
                  {"rollout": {"group_size": 4}, "advantage": {"estimator": "depth_zscore"}}),
            dom | part("TreeRollout", "DemoReplay") | {("robotics_rollout", "tree"), ("robotics_balance", "equal")}),
        "robotics-critic-gae": (
            merge(_robotics(critic={"enabled": True}), {"advantage": {"estimator": {"name": "gae", "lam": 0.9}}}),
            dom | part("Critic", "FlatRollout") | {("estimator", "gae")}),
    }
    wm = {"checkpoint": str(wm_asset), "horizon": 12, "keyframe_states": 6, "keyframe_stride": 1,
          "coevolve_every": 1, "coevolve_episodes": 2, "refit_steps": 3, "refit_success_steps": 3}
    base = lambda name, **w: _robotics(policy, rollout={"name": name, "world_model": {**wm, **w}})  # noqa: E731
    cases["robotics-world_model-audit"] = (
        base("world_model", audit_fraction=0.5, learn_from_audit=True),
        dom | part("WorldModelRollout") | {("robotics_rollout", "world_model")})
    verified = base("verified", audit_fraction=0.0, refit_steps=0, refit_success_steps=0)  # as the ranker recipe
    verified["robotics"]["rollout"]["verify"] = {"candidates": 6, "selector": "max_variance", "score": "ranker",
                                                 "ranker_from": "own_groups", "ranker_refit_steps": 5,
                                                 "learn_from_verified": True, "probe_every": 1, "probe_keys": 1,
                                                 "probe_states": 2}
    cases["robotics-verified-ranker"] = (verified, dom | part("VerifiedRollout") | {("robotics_rollout", "verified"),
                                                                                    ("two_stage_selector", "max_variance")})
    short = base("short_horizon", audit_fraction=0.0)
    short["advantage"] = {"estimator": "grpo", "weights": {"return": 1.0}}
    short["robotics"]["rollout"]["short_horizon"] = {"horizon": 8, "real_episodes": 2, "critic_steps": 5,
                                                     "audit_groups": 1}
    cases["robotics-short_horizon"] = (short, dom | part("ShortHorizonRollout")
                                       | {("robotics_rollout", "short_horizon")})
    return cases


_LLM_BASE = {"rollout": {"groups_per_iteration": 2, "group_size": 2}, "eval": {"at_start": False, "every": 0},
             "llm": {"dataset": {"num_train": 64, "num_eval": 8}, "eval": {"num_prompts": 4}}}


def _llm_cases() -> dict[str, tuple[dict, set]]:
    """The text domain, flat (its fast engine, deferred behaviour log-probs, a shared prompt forward) and tree."""
    out = {}
    for recipe, covers in (("arith_grpo", {("domain", "llm")}), ("arith_tree", {("domain", "llm")})):
        cfg = merge(yaml.safe_load((ROOT / "configs/llm" / f"{recipe}.yaml").read_text()), _LLM_BASE)
        out[f"llm-{recipe}"] = (cfg, covers | {("estimator", cfg["advantage"]["estimator"])})
    return out


def _all_cases(wm_asset=Path("WM"), policy=Path("VLA"), demos=Path("DEMOS")) -> dict[str, tuple[dict, set]]:
    return _toy_cases() | _visgen_cases() | _llm_cases() | _robotics_cases(wm_asset, policy, demos)


def test_every_registered_part_is_covered():
    """What the registries name = what the cases cover + what is excluded with a reason (nothing else, no stale
    exclusion)."""
    reg = registered()
    covered = set().union(*(c for _, c in _all_cases().values()))
    missing = sorted(reg - covered - set(EXCLUDED))
    assert not missing, f"registered without a resume case (add one to CASES or a reason to EXCLUDED): {missing}"
    stale = sorted(set(EXCLUDED) - reg)
    assert not stale, f"EXCLUDED names what is not registered: {stale}"
    both = sorted(set(EXCLUDED) & covered)
    assert not both, f"covered and excluded at once: {both}"
    assert all(EXCLUDED.values()), "every exclusion says why"


# ------------------------------------------------------------------------------------------------- the fixtures
@pytest.fixture(scope="module")
def robotics_inputs(tmp_path_factory):
    from tests.robotics.test_world_model_fixtures import tiny_wm_asset

    from robotics.data import Episode, save_episodes
    from robotics.envs.metaworld_env import instruction_for

    import numpy as np

    root = tmp_path_factory.mktemp("resume-robotics")
    asset = tiny_wm_asset(root)
    rng = np.random.default_rng(0)
    eps = [Episode(task="point-reach", instruction=instruction_for("point-reach"),
                   images=rng.integers(0, 255, (8, 64, 64, 3), dtype=np.uint8),
                   proprio=rng.normal(size=(8, 4)).astype(np.float32),
                   actions=np.tile(np.array([0.5, -0.5, 0.25, 0.0], np.float32), (8, 1)),
                   success=np.zeros(8, bool)) for _ in range(4)]
    demos = save_episodes(eps, root / "demos.npz")
    return asset, root / "vla", demos


CASE_NAMES = sorted(_all_cases())


@pytest.mark.parametrize("case", CASE_NAMES)
def test_resume_equals_uninterrupted(case, tmp_path, request):
    torch.set_num_threads(1)
    if case.startswith("robotics-"):
        cases = _robotics_cases(*request.getfixturevalue("robotics_inputs"))
    else:
        cases = _all_cases()
    cfg, _ = cases[case]
    bad = resume_mismatches(copy.deepcopy(cfg), tmp_path)
    assert not bad, "\n".join(bad[:20])


@pytest.mark.slow
@pytest.mark.timeout(3600)  # minutes alone; a loaded 2-core machine stretches them
def test_a_sigkilled_explorer_run_resumes_to_the_uninterrupted_one(tmp_path, robotics_inputs):
    """The real thing for the part with the most state: ``grove train`` of the verified-ranker case in a child
    process, SIGKILLed once its second checkpoint is on disk (inside the third iteration), then ``--resume``: the
    records equal the uninterrupted in-process run's (``slow``: two Python start-ups)."""
    import json
    import subprocess
    import sys
    import time

    from tests.resume_harness import _config, _records

    cfg, _ = _robotics_cases(*robotics_inputs)["robotics-verified-ranker"]
    cfg = merge(cfg, {"iterations": 3, "checkpoint": {"every": 1, "keep_last": 4}, "logging": {"progress": False}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "killed"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "shared_rl", "train", str(path), "--out", str(run)], cwd=str(ROOT),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    t = time.monotonic()
    while not (run / "checkpoints" / "step_000002").is_dir() and p.poll() is None and time.monotonic() - t < 600:
        time.sleep(0.02)
    p.kill()
    p.communicate(timeout=60)
    again = subprocess.run([sys.executable, "-m", "shared_rl", "train", "--resume", str(run)], cwd=str(ROOT),
                           capture_output=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    from shared_rl.trainer import Trainer

    Trainer(_config(cfg, 3), tmp_path / "full", log=lambda *_: None).fit()
    assert _records(run) == _records(tmp_path / "full"), json.dumps(_records(run)[-1])[:2000]
