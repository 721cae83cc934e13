"""``grove list`` answers without torch: the names it prints from text equal the live registries they mirror.

The core's tensor registries (``shared_rl.advantages.ESTIMATORS``, ``shared_rl.losses.POLICY_LOSSES`` /
``KL_ESTIMATORS``) and visgen's rewards import torch, so ``grove list`` reads their built-in names from the
registering decorators in the source (``shared_rl.cli.registered_names``; issue 64: `grove list` <= 2 s on a loaded
2-core machine, measured by ``grove bench cold-start``, docs/bench/cold_start.md, not here). These tests check that
what is read equals the live registries and, in a fresh process, that the listing imports no torch.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shared_rl import cli

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "transformers", "diffusers", "scipy", "PIL", "mujoco", "metaworld")


def test_the_core_names_grove_list_prints_are_the_live_registries():
    from shared_rl.advantages import ESTIMATORS, estimator_names
    from shared_rl.losses import KL_ESTIMATORS, POLICY_LOSSES

    read = cli._core_names()
    assert {kind: read[kind] for kind in ("flat", "tree", "step")} == {
        kind: estimator_names(kind) for kind in ("flat", "tree", "step")}
    assert {e.kind for e in ESTIMATORS.values()} <= {"flat", "tree", "step"}  # every kind has its row
    assert read["policy_loss"] == sorted(POLICY_LOSSES)
    assert read["kl_estimator"] == sorted(KL_ESTIMATORS)
    rows = dict(cli.catalog())
    assert rows["advantage estimators, flat (advantage.estimator)"] == estimator_names("flat")
    assert rows["advantage estimators, tree rollouts (advantage.estimator)"] == estimator_names("tree")
    critic = "advantage estimators with a critic (advantage.estimator: {name: NAME, ...})"
    assert rows[critic] == estimator_names("step")
    assert rows["policy losses (loss.policy_loss)"] == sorted(POLICY_LOSSES)
    assert rows["KL estimators (loss.kl_estimator)"] == sorted(KL_ESTIMATORS)


def test_the_visgen_rewards_grove_list_prints_are_the_reward_registry():
    from visgen import catalog as visgen_catalog

    live = visgen_catalog.register_rewards()  # imports every reward module: the set a config is checked against
    assert visgen_catalog.reward_names() == live
    assert visgen_catalog.catalog()["rewards (visgen.rewards[].name; grove rewards describes each)"] == live


def test_registered_names_reads_only_literal_registrations(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text('"""@register("in_a_docstring")"""\n'
                      '@register("a", kind="tree", settings=S)\ndef a(): ...\n'
                      '@other("b")\ndef b(): ...\n'
                      '@register(NAME)\ndef c(): ...\n'
                      'class D:\n    @register("d")\n    def d(self): ...\n'
                      '@register\nclass E:\n    """doc"""\n    name = "e"\n'
                      '@register\nclass F:\n    name = NAME\n'
                      '@register\ndef g(): ...\n')
    assert cli.registered_names(source, "register") == {"a": {"kind": "tree"}, "d": {}, "e": {}}


def test_the_visgen_objectives_and_tasks_grove_list_prints_are_their_registries():
    from visgen import catalog as visgen_catalog
    from visgen.objectives import OBJECTIVES
    from visgen.tasks.base import TASKS

    rows = visgen_catalog.catalog()
    assert rows["training objectives (visgen.objective.name)"] == sorted(OBJECTIVES)
    assert rows["tasks (visgen.task)"] == sorted(TASKS)


def test_grove_list_imports_no_torch_in_a_fresh_process():
    """The whole command, as typed, in a fresh interpreter: it prints every row and leaves torch, numpy and the
    model libraries unimported (``sys.modules``)."""
    code = ("import sys, io, contextlib; from shared_rl.cli import main; out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    rc = main(['list'])\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "print(repr((rc, heavy, out.getvalue().count(':\\n  '))))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rc, heavy, rows = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 — our own repr of a tuple
    assert (rc, heavy) == (0, [])
    assert rows == len(cli.catalog())
