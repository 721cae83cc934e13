"""``grove config show`` builds the typed config without torch where the classes allow it (issue 64: <= 3 s on a
loaded 2-core machine, measured by ``grove bench cold-start``, docs/bench/cold_start.md, not here).

The core's registries are read from their source while their torch modules are not imported
(``shared_rl.part_index``); a built-in domain's settings class comes from ``shared_rl.registry.DOMAIN_CONFIGS``
without its domain module. These tests check the index equals the live registries, that each table entry is the
domain's own ``config_class``, and, in fresh processes, which domains' ``config show`` imports no torch.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared_rl import part_index, registry

ROOT = Path(__file__).resolve().parents[2]


def test_the_index_of_the_core_registries_is_the_live_registries():
    from shared_rl.advantages import ESTIMATORS
    from shared_rl.losses import KL_ESTIMATORS, POLICY_LOSSES

    estimators = part_index._indexed("advantages.py", "register")  # every estimator's settings class is torch-free
    assert {n: (e.kind, e.settings_class) for n, e in estimators.items()} == {
        n: (e.kind, e.settings_class) for n, e in ESTIMATORS.items() if n in estimators}
    assert set(estimators) <= set(ESTIMATORS)
    losses = part_index._indexed("losses.py", "register_policy_loss")  # settings in shared_rl.loss_settings
    assert {n: e.settings_class for n, e in losses.items()} == {
        n: POLICY_LOSSES[n].settings_class for n in losses}
    assert set(losses) <= set(POLICY_LOSSES)
    assert part_index.kl_estimator_names() == sorted(KL_ESTIMATORS)


def test_the_torch_free_names_are_the_live_registries():
    """The two-stage selectors read from ``shared_rl.two_stage``'s source, and the kernel names and default noise
    levels of ``shared_rl.kernel_settings``, are the tensor modules' own."""
    import shared_rl.kernel_settings as ks
    from shared_rl import flow_kernels, two_stage

    assert part_index.selector_names() == sorted(two_stage.SELECTORS)
    assert set(ks.KERNEL_NAMES) == set(flow_kernels.KERNELS)
    assert flow_kernels.KERNEL_NOISE_LEVELS is ks.KERNEL_NOISE_LEVELS


def test_the_selector_index_reads_the_source_without_the_module(monkeypatch):
    import shared_rl.two_stage as live

    names = sorted(live.SELECTORS)
    monkeypatch.delitem(sys.modules, "shared_rl.two_stage")
    assert part_index.selector_names() == names
    assert "shared_rl.two_stage" not in sys.modules


def test_the_robotics_settings_classes_are_re_exported_where_they_were():
    """The sections moved into torch-free modules are the same class objects under their old names."""
    pytest.importorskip("mujoco")
    from robotics import adapters, branching, critic, part_settings, replay, rollouts
    from robotics.envs import metaworld_env, settings, vector
    from robotics.policies import vla, vla_config

    assert adapters.AdaptersConfig is part_settings.AdaptersConfig
    assert adapters.VAL_FIRST_INDEX == part_settings.VAL_FIRST_INDEX
    assert critic.CriticConfig is part_settings.CriticConfig
    assert replay.ReplayConfig is part_settings.ReplayConfig
    assert branching.BranchConfig is part_settings.BranchConfig
    assert rollouts.RolloutSettings is part_settings.RolloutSettings and rollouts.ROLLOUTS is part_settings.ROLLOUTS
    assert vector.EnvConfig is settings.EnvConfig and vector.DEFAULT_TASKS is settings.DEFAULT_TASKS
    assert metaworld_env.TASK_INSTRUCTIONS is settings.TASK_INSTRUCTIONS
    assert metaworld_env.RenderSettings is settings.RenderSettings
    assert vla.VLAConfig is vla_config.VLAConfig and vla.tokenize is vla_config.tokenize


def test_the_visgen_settings_classes_are_re_exported_where_they_were():
    """visgen's config sections moved into torch-free modules are the same objects under their old names."""
    from visgen import config, domain, lowprec, method_settings, objective_settings, objectives, offline_dpo, \
        part_settings, policy
    from visgen.methods import base, branch, egrpo, tree_grpo
    from visgen.pipelines import memory
    from visgen.rewards import gold

    assert domain.VisgenConfig is config.VisgenConfig and domain.RewardSpec is config.RewardSpec
    assert domain.EvalSettings is config.EvalSettings
    assert lowprec.TwoStageSettings is part_settings.TwoStageSettings and lowprec.PRECISIONS is part_settings.PRECISIONS
    assert memory.MemorySettings is part_settings.MemorySettings
    assert policy.LoraSettings is part_settings.LoraSettings and policy.EmaSettings is part_settings.EmaSettings
    assert gold.check_gold_rewards is part_settings.check_gold_rewards
    assert base.KernelSettings is method_settings.KernelSettings and base.require is method_settings.require
    assert branch.BranchSettings is method_settings.BranchSettings
    assert branch.BranchMixSettings is method_settings.BranchMixSettings
    assert tree_grpo.TreeGRPOSettings is method_settings.TreeGRPOSettings
    assert egrpo.EGRPOSettings is method_settings.EGRPOSettings
    assert objectives.NFTSettings is objective_settings.NFTSettings
    assert objectives.OldPolicySchedule is objective_settings.OldPolicySchedule
    assert policy.TeacherSource is objective_settings.TeacherSource and policy.Snapshots is objective_settings.Snapshots
    assert offline_dpo.check_offline is objective_settings.check_offline


def test_the_visgen_specs_are_the_live_registries():
    """The torch-free method and objective specs the config builds from are the live registries' own checks: every
    live entry subclasses its spec (so it inherits the config-time checks, never a copy), with the same structure and
    settings fields; the reward names and the questions the config asks of each reward (its output's name, whether
    it is differentiable) read from the reward modules' source equal the live registry's answers."""
    import dataclasses

    from visgen import config, method_settings, objective_settings, preflight
    from visgen.methods import METHODS
    from visgen.objectives import OBJECTIVES
    from visgen.rewards import available_rewards, reward_info

    assert set(METHODS) == set(method_settings.METHOD_SPECS)
    for name, live in METHODS.items():
        spec = method_settings.METHOD_SPECS[name]
        assert issubclass(live, spec) and live.structure == spec.structure, name
        assert issubclass(live.settings_class, spec.settings_class), name  # a plan adds only ``build``
        assert dataclasses.fields(live.settings_class) == dataclasses.fields(spec.settings_class), name
    assert set(OBJECTIVES) == set(objective_settings.OBJECTIVE_SPECS)
    for name, live in OBJECTIVES.items():
        spec = objective_settings.OBJECTIVE_SPECS[name]
        assert issubclass(live, spec) and live.settings_class is spec.settings_class, name
    config._import_optional_rewards()
    index = preflight.reward_source_index()
    assert sorted(index) == available_rewards()  # every built-in answered from its source
    names = available_rewards()
    assert config.reward_names_registered() == names
    for name in names:
        live = (preflight.reward_outputs(name, {}), preflight.reward_outputs(name, {"name": "x"}),
                reward_info(name).differentiable)
        entry = index[name]
        indexed = (preflight.FIXED_OUTPUTS[name] if name in preflight.FIXED_OUTPUTS else
                   None if entry["name"] is None else [entry["name"]],
                   preflight.FIXED_OUTPUTS[name] if name in preflight.FIXED_OUTPUTS else
                   None if entry["name"] is None else ["x"], entry["differentiable"])
        assert indexed == live, name


def test_the_visgen_reward_index_reads_the_source_without_the_modules(monkeypatch):
    from visgen import config

    config._import_optional_rewards()
    names = config.reward_names_registered()
    for mod in [m for m in sys.modules if m == "visgen.rewards" or m.startswith("visgen.rewards.")]:
        monkeypatch.delitem(sys.modules, mod)
    assert config.reward_names_registered() == names
    assert "visgen.rewards" not in sys.modules


def test_each_built_in_domain_config_is_its_domain_config_class():
    for name, target in registry.DOMAIN_CONFIGS.items():
        try:
            domain = registry.resolve_domain(name)
        except Exception as e:  # noqa: BLE001 — a domain whose optional packages are missing here
            pytest.skip(f"domain {name}: {e}")
        assert registry.resolve_domain_config(name) is domain.config_class, name


CODE = ("import contextlib, io, sys\nfrom shared_rl.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n    code = main(['config', 'show', *sys.argv[1:]])\n"
        "print(code, 'torch' in sys.modules, [m for m in ('mujoco', 'metaworld', 'lerobot') if m in sys.modules])\n")


def _config_show(*args: str) -> tuple[str, str, str, str]:
    """``grove config show ARGS`` in a fresh process: (exit code, torch imported, simulators imported, stderr)."""
    proc = subprocess.run([sys.executable, "-c", CODE, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    code, torch, simulators = proc.stdout.strip().splitlines()[-1].split(" ", 2)
    return code, torch, simulators, proc.stderr

# every domain's sections come from torch-free modules: robotics' (robotics.part_settings, robotics.envs.settings,
# robotics.policies.vla_config, ...) and visgen's (visgen.config with visgen.part_settings, visgen.method_settings,
# visgen.objective_settings; the reward names from the reward modules' source). The visgen rows cover a flat method,
# a tree method, a likelihood-free objective, a reward's gradient, a hub pipeline with reward models, a video task.
RECIPES = ["configs/toy.yaml", "configs/llm/arith_grpo.yaml", "configs/llm/arith_gspo.yaml",
           "configs/llm/arith_tree.yaml", "configs/visgen/shapes_grpo.yaml", "configs/visgen/shapes_branch_prune.yaml",
           "configs/visgen/shapes_egrpo.yaml", "configs/visgen/shapes_nft.yaml", "configs/visgen/shapes_diffusion_opsd.yaml",
           "configs/visgen/sd35_pickscore.yaml", "configs/visgen/video_shapes_grpo.yaml",
           "configs/robotics/metaworld_grpo.yaml", "configs/robotics/libero_grpo.yaml",
           "configs/robotics/metaworld_mt5_ppo.yaml", "configs/robotics/world_model_verified.yaml",
           "configs/robotics/pi05_libero_grpo_gpu.yaml"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_config_show_imports_no_torch(recipe):
    code, torch, simulators, stderr = _config_show(recipe)
    assert code == "0", stderr[-2000:]
    assert torch == "False", f"grove config show {recipe} imported torch"
    assert simulators == "[]", f"grove config show {recipe} imported {simulators}"  # robotics: no MuJoCo either


def test_config_show_of_visgen_two_stage_imports_no_torch():
    """The two-stage rollout's settings and checks (its selectors, its formats but fp8's GPU probe) need no torch."""
    code, torch, _, stderr = _config_show("configs/visgen/shapes_grpo.yaml",
                                          "visgen.two_stage={enabled: true, precision: nvfp4, candidates: 32}")
    assert code == "0", stderr[-2000:]
    assert torch == "False"


# a bad visgen setting of each part: the same one line (and exit 2) as when the checks imported torch, still without it
BAD_VISGEN = {
    "method that does not fit": ("visgen.method={name: mix_grpo, window_size: 20}",
                                 "grove: error: mix_grpo: window_size 20 does not fit in steps [0, 9) of 10"),
    "method typo": ("visgen.method={name: flow_grp}", "'flow_grp' is unknown (did you mean 'flow_grpo'?)"),
    "explicit plan trains the final step": ("visgen.method={name: explicit, train_steps: [9]}",
                                            "grove: error: visgen.method[explicit] trains the final denoising step 9"),
    "tree group size": ("visgen.method={name: tree_grpo, branch: [2, 2]}", "set rollout.group_size: 4"),
    "objective setting": ("visgen.objective={name: nft, beta: 0}", "grove: error: visgen.objective[nft].beta must be > 0"),
    "reward typo": ("visgen.rewards=[{name: shapes_sof}]", "unknown reward 'shapes_sof' (did you mean 'shapes_soft'?)"),
    "advantage weight typo": ("advantage.weights={shapes_sof: 1}", "(did you mean 'shapes_soft'?)"),
    "two-stage selector": ("visgen.two_stage={enabled: true, selector: bogus}",
                           "visgen.two_stage.selector 'bogus' is unknown; choose one of ['max_variance', 'top_bottom']"),
}


@pytest.mark.parametrize("case", sorted(BAD_VISGEN))
def test_a_bad_visgen_setting_is_one_line_without_torch(case):
    override, expected = BAD_VISGEN[case]
    code, torch, _, stderr = _config_show("configs/visgen/shapes_grpo.yaml", override)
    assert code == "2", stderr[-2000:]
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and expected in lines[0], stderr[-2000:]
    assert torch == "False", f"refusing {override} imported torch"
