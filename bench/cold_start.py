"""`grove bench cold-start`: how long a new user waits for the answers that need no model — a typo'd path refused
(exit 2), ``grove config show`` of each domain's recipe, ``grove list`` — each a fresh ``grove`` process, as typed.

Every row runs its command ``REPEATS`` times (``--quick``: once) as a subprocess from the checkout and reports the
median wall time (and the fastest), after checking the exit code and, for a refusal, that its one line names the
typo. A cold start is mostly imports (torch, diffusers, the domain's package), so the numbers move with the machine's
load and its page cache: the 1-minute load average before the rows is reported beside them, and ``grove --version``
(the interpreter and grove's own CLI module, nothing else) is the floor every other row pays. The typo'd-path rows are
answered by ``shared_rl.prechecks`` on the raw config before torch or a domain package is imported (the same check
functions the domains' validation runs later; tests/core/test_prechecks.py), so they sit near that floor.

Each row also says whether the command imported torch (one more run, in-process through ``shared_rl.cli.main``, that
reads ``sys.modules`` at the end) and the time issue 64 asks of it on a loaded 2-core machine: typo'd paths ~2 s,
``grove config show`` 3 s, ``grove list`` 2 s. ``grove list`` reads the torch-backed registries' names from their
source (``shared_rl.cli.registered_names``); ``grove config show`` builds the typed config from torch-free modules
where the classes allow (the core's registries read by ``shared_rl.part_index``, the built-in domains' settings
classes found by ``shared_rl.registry.DOMAIN_CONFIGS``): no domain's section imports torch (robotics' from
``robotics.part_settings``, ``robotics.envs.settings``, ``robotics.policies.vla_config``, ...; visgen's from
``visgen.config`` with the methods' and objectives' torch-free specs, ``visgen.method_settings`` and
``visgen.objective_settings``, and the reward names read from the reward modules' source).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from shared_rl.bench import write_results
from shared_rl.cli import REPO_ROOT

DOC = REPO_ROOT / "docs" / "bench" / "cold_start.md"
REPEATS = 3

# (variant, argv after `grove`, exit code, text the last stderr line must hold, extra environment)
ROWS = [
    ("grove --version (the floor)", ["--version"], 0, "", {}),
    ("grove list", ["list"], 0, "", {}),
    ("config show toy", ["config", "show", "configs/toy.yaml"], 0, "", {}),
    ("config show llm", ["config", "show", "configs/llm/arith_grpo.yaml"], 0, "", {}),
    ("config show visgen", ["config", "show", "configs/visgen/shapes_grpo.yaml"], 0, "", {}),
    ("config show visgen SD3.5 + PickScore", ["config", "show", "configs/visgen/sd35_pickscore.yaml"], 0, "", {}),
    ("config show robotics", ["config", "show", "configs/robotics/metaworld_grpo.yaml"], 0, "", {}),
    ("config show robotics LIBERO", ["config", "show", "configs/robotics/libero_grpo.yaml"], 0, "", {}),
    ("typo'd llm model path (exit 2)",
     ["train", "configs/llm/arith_grpo.yaml", "llm.model=assets/llm-arith-tiy", "--dry-run"], 2,
     "did you mean 'assets/llm-arith-tiny'?", {}),
    ("typo'd visgen model path (exit 2)",
     ["train", "configs/visgen/shapes_grpo.yaml", "visgen.model=assets/shapes-sd3-tny", "--dry-run"], 2,
     "did you mean 'assets/shapes-sd3-tiny'?", {}),
    ("typo'd visgen hub id, offline (exit 2)",
     ["train", "configs/visgen/sd35_pickscore.yaml", "device=cpu",
      "visgen.model=stabilityai/stable-diffusion-3.5-mediun", "--dry-run"], 2,
     "did you mean 'stabilityai/stable-diffusion-3.5-medium'?", {"HF_HUB_OFFLINE": "1"}),
    ("typo'd visgen reward name (exit 2)",
     ["config", "show", "configs/visgen/shapes_grpo.yaml", "visgen.rewards=[{name: shapes_sof}]"], 2,
     "(did you mean 'shapes_soft'?)", {}),
    ("typo'd llm hub id, offline (exit 2)",
     ["train", "configs/llm/arith_grpo.yaml", "llm.model=Qwen/Qwen2.5-0.5B-Instrct", "--dry-run"], 2,
     "did you mean 'Qwen/Qwen2.5-0.5B-Instruct'?", {"HF_HUB_OFFLINE": "1"}),
    ("typo'd llm dataset path (exit 2)",
     ["train", "configs/llm/arith_grpo.yaml", "llm.dataset.source=jsonl",
      "llm.dataset.path=configs/visgen/prompts/video_shapes_trian.jsonl", "--dry-run"], 2,
     "did you mean 'configs/visgen/prompts/video_shapes_train.jsonl'?", {}),
    ("typo'd robotics checkpoint (exit 2)",
     ["train", "configs/robotics/metaworld_grpo.yaml", "robotics.checkpoint=assets/metaworld-vla-tiy", "--dry-run"],
     2, "did you mean 'metaworld-vla-tiny'?", {}),
    ("uncached LeRobot policy, offline (exit 2)",
     ["train", "configs/robotics/pi05_libero_grpo_gpu.yaml", "device=cpu", "--dry-run"], 2,
     "download it once with `hf download lerobot/pi05_libero`", {"HF_HUB_OFFLINE": "1"}),
]


def target_s(variant: str) -> float | None:
    """The answer time issue 64 asks for on a loaded 2-core machine (None: no target, the floor)."""
    if variant.startswith("grove list"):
        return 2.0
    if variant.startswith("config show"):
        return 3.0
    return 2.0 if "(exit 2)" in variant else None


def _time_once(argv: list[str], code: int, expect: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "shared_rl.cli", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=600)
    wall = time.perf_counter() - start
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    if proc.returncode != code or expect not in last:
        raise RuntimeError(f"grove {' '.join(argv)}: exit {proc.returncode} (expected {code}); last line: {last!r}")
    return wall


def _imports_torch(argv: list[str], env: dict[str, str]) -> bool:
    """Whether ``grove argv`` imports torch: the command in-process in a fresh interpreter, ``sys.modules`` after."""
    code = ("import contextlib, io, sys\nfrom shared_rl.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            f"    main({argv!r})\n"
            "print('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)
    return proc.stdout.strip().splitlines()[-1:] == ["True"]


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def run(out_dir: Path, quick: bool = False, log=print) -> dict:
    repeats = 1 if quick else REPEATS
    load_before = _load()
    rows = []
    for variant, argv, code, expect, env in ROWS:
        load = _load()  # the machine is shared: the load each row ran under, beside its time
        times = [_time_once(argv, code, expect, env) for _ in range(repeats)]
        rows.append({"variant": variant, "median_s": statistics.median(times), "min_s": min(times),
                     "target_s": target_s(variant), "load_1min": load, "imports_torch": _imports_torch(argv, env),
                     "runs": repeats, "command": "grove " + " ".join(argv)})
        log(f"{variant}: median {rows[-1]['median_s']:.2f} s over {repeats} (load {load:.2f})")
    notes = (f"Each row: a fresh `python -m shared_rl.cli ...` subprocess from the checkout, {repeats} times; the "
             f"median and the fastest wall time, the 1-minute load average when the row started (before the rows: "
             f"{load_before:.2f}, after: {_load():.2f}, on {os.cpu_count()} cores), whether the command imports "
             f"torch, and the time issue 64 asks for (target_s). The typo'd-path rows are answered by "
             f"`shared_rl.prechecks` and `grove list` by text read from the registries' source, both before torch "
             f"is imported; `grove config show` builds the typed config from torch-free modules for every domain "
             f"(shared_rl.part_index, registry.DOMAIN_CONFIGS, robotics.part_settings, visgen.config with "
             f"visgen.method_settings / visgen.objective_settings). Reproduce: `grove bench cold-start` (this page), `--quick` for 1 run "
             f"a row (no page).")
    return write_results(out_dir, "cold-start", rows, notes, doc_path=None if quick else DOC)
