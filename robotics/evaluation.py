"""Evaluation of a VLA policy: deterministic (ODE / arg-max) episodes on reset states of a split, and the paired
comparison of two evaluations of the same episodes.

Shared by behaviour cloning (``robotics.bc``), the RL domain (held-out evaluation, and the validation states of
``robotics.adapters.keep_best``) and the scripts; it imports neither of them.

An evaluation is a fixed function of the weights: episode (state s, draw j) starts its flow chain from noise seeded
by (``seed`` + j, s's key). So two policies evaluated with the same settings meet the same states *and* the same
start noise, and their difference can be read episode by episode (``paired_delta``): the before -> after of an RL
run is a paired comparison whose standard error is that of the per-state differences, far tighter than two
independent scores' when most episodes keep their outcome.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import LIBERO_FPS, METAWORLD_FPS
from .envs.metaworld_env import make_key
from .envs.vector import EnvConfig, make_vector_env
from .episodes import SamplingSettings, concat_batches, run_episodes, write_gif
from .policies.vla import TinyVLA

PROGRESS_EVERY = 10.0  # seconds between progress lines of a long evaluation (none for one shorter than this)


def eval_keys(env_cfg: EnvConfig, per_task: int, split: str = "eval", first_index: int = 0) -> tuple[list[int], list[str]]:
    """``per_task`` reset-state keys per task of ``split``, indices ``first_index ..`` (the held-out set by default)."""
    keys, tasks = [], []
    for t, task in enumerate(env_cfg.tasks):
        for i in range(first_index, first_index + per_task):
            keys.append(make_key(t, split, i))
            tasks.append(task)
    return keys, tasks


@dataclass
class EvalOutcomes:
    """The episodes of one evaluation: episode i ran task ``tasks[i]`` from reset state ``keys[i]`` with start-noise
    draw ``draws[i]`` (seed ``settings["seed"]`` + draw) and succeeded or not. ``settings`` say what was evaluated;
    two outcomes pair when their settings and episode lists agree."""

    tasks: list[str]
    keys: list[int]
    draws: list[int]
    success: np.ndarray  # [N] bool
    length: np.ndarray  # [N] int, env steps
    settings: dict[str, Any]
    policy: str = ""  # the weights these episodes are of, when known (policy_digest)

    def to_json(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), "keys": [int(k) for k in self.keys], "draws": [int(d) for d in self.draws],
                "success": [bool(x) for x in self.success], "length": [int(x) for x in self.length],
                "settings": dict(self.settings), "policy": self.policy}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EvalOutcomes":
        return cls(list(d["tasks"]), [int(k) for k in d["keys"]], [int(x) for x in d["draws"]],
                   np.asarray(d["success"], bool), np.asarray(d["length"], np.int64), dict(d["settings"]),
                   str(d.get("policy", "")))

    def pairs_with(self, other: "EvalOutcomes") -> bool:
        return (self.settings == other.settings and self.keys == other.keys and self.draws == other.draws
                and self.tasks == other.tasks)


def _state_means(values: np.ndarray, keys: list[int], sel: np.ndarray) -> np.ndarray:
    """The mean of ``values`` over each reset state's draws, for the episodes ``sel`` (one value per state)."""
    by_state: dict[int, list[float]] = {}
    for v, k, s in zip(values, keys, sel):
        if s:
            by_state.setdefault(int(k), []).append(float(v))
    return np.array([np.mean(v) for v in by_state.values()], np.float64)


def outcome_metrics(out: EvalOutcomes, standard_errors: bool = False) -> dict[str, float]:
    """``eval/success`` (the mean over every episode; the tasks have equal state counts) and ``eval/success/<task>``,
    ``eval/episode_length``. With ``standard_errors``: ``eval/success_se`` (+ ``/<task>``) over reset states — a
    state's draws are one cluster, se_t = sqrt(var(state means)/S_t) (population variance: with one draw this is the
    binomial sqrt(p(1-p)/n)), the overall one stratified, sqrt(sum_t (n_t/N)^2 se_t^2). With several draws also
    ``eval/success_draw_sd`` (+ ``/<task>``): the standard deviation over draws of the score one draw gives — how far
    the start noise alone moves a single-draw evaluation of these weights."""
    tasks = np.array(out.tasks)
    succ = out.success.astype(np.float64)
    res = {"eval/success": float(succ.mean())}
    draws = sorted(set(out.draws))
    var = 0.0
    for task in sorted(set(out.tasks)):
        sel = tasks == task
        res[f"eval/success/{task}"] = float(succ[sel].mean())
        if standard_errors:
            m = _state_means(succ, out.keys, sel)
            se = float(np.sqrt(m.var() / len(m)))
            res[f"eval/success_se/{task}"] = se
            var += (sel.sum() / len(succ)) ** 2 * se ** 2
        if len(draws) > 1:
            per_draw = [succ[sel & (np.array(out.draws) == j)].mean() for j in draws]
            res[f"eval/success_draw_sd/{task}"] = float(np.std(per_draw, ddof=1))
    if standard_errors:
        res["eval/success_se"] = float(np.sqrt(var))
    if len(draws) > 1:
        res["eval/success_draw_sd"] = float(np.std([succ[np.array(out.draws) == j].mean() for j in draws], ddof=1))
    res["eval/episode_length"] = float(np.mean(out.length))
    return res


def paired_delta(before: EvalOutcomes, after: EvalOutcomes) -> dict[str, float]:
    """The paired change from ``before`` to ``after`` (the same states and start noise; {} when they do not pair).

    d_i = success_after_i − success_before_i per episode; a state's draws are averaged into d_s; per task
    ``eval/success_delta/<task>`` = mean_s d_s and ``eval/success_delta_se/<task>`` = sd(d_s, ddof 1) / sqrt(S_t)
    (the paired t-test's standard error); overall the stratified mean sum_t (n_t/N)·delta_t with
    se = sqrt(sum_t (n_t/N)^2 se_t^2). ``eval/paired_gained`` / ``eval/paired_lost``: episodes that turned from
    failure to success / success to failure (the delta is their difference over N). A delta within ~2 standard
    errors of 0 is what the evaluation cannot tell from no change."""
    if not before.pairs_with(after):
        return {}
    d = after.success.astype(np.float64) - before.success.astype(np.float64)
    tasks = np.array(after.tasks)
    res: dict[str, float] = {}
    mean, var = 0.0, 0.0
    for task in sorted(set(after.tasks)):
        sel = tasks == task
        ds = _state_means(d, after.keys, sel)
        w = sel.sum() / len(d)
        se = float(ds.std(ddof=1) / np.sqrt(len(ds))) if len(ds) > 1 else float("nan")
        res[f"eval/success_delta/{task}"] = float(ds.mean())
        res[f"eval/success_delta_se/{task}"] = se
        mean += w * float(ds.mean())
        var += w ** 2 * se ** 2
    res["eval/success_delta"] = mean
    res["eval/success_delta_se"] = float(np.sqrt(var))
    res["eval/paired_gained"] = float((d > 0).sum())
    res["eval/paired_lost"] = float((d < 0).sum())
    return res


def evaluate_episodes(policy: TinyVLA, env_cfg: EnvConfig, per_task: int, venv=None, gif_dir: Path | None = None,
                      tag: str = "", seed: int = 0, init_noise: float = 1.0, split: str = "eval",
                      first_index: int = 0, noise_draws: int = 1, log=None) -> EvalOutcomes:
    """Deterministic (ODE / arg-max) episodes on ``per_task`` reset states per task of ``split`` from
    ``first_index`` (the held-out evaluation states by default; the validation states of
    ``robotics.adapters.keep_best``), each state ``noise_draws`` times.

    The flow head's ODE starts from Gaussian noise; episode (state, draw j) draws it from its own generator, seeded by
    (``seed`` + j, the state's key), so an evaluation is a deterministic function of the weights and the seed, one
    task's score does not move when only another task's policy changes, and two policies evaluated alike meet the
    same start noise (``paired_delta``; ``run_episodes(episode_noise_seed=...)``). Draw 0 of seed s is draw 1 of
    seed s − 1.
    ``log``: where a long evaluation reports progress with an ETA (``shared_rl.metrics.Progress``: env steps of the
    horizon run so far by the lock-stepped episodes; the ETA is an upper bound, episodes may end sooner).
    """
    from shared_rl.metrics import Progress

    if noise_draws < 1:
        raise ValueError(f"noise_draws must be >= 1, got {noise_draws}")
    keys1, tasks1 = eval_keys(env_cfg, per_task, split, first_index)
    keys = [k for _ in range(noise_draws) for k in keys1]
    tasks = [t for _ in range(noise_draws) for t in tasks1]
    draws = [j for j in range(noise_draws) for _ in keys1]
    if env_cfg.eval_batch and env_cfg.eval_batch < len(keys):
        # slices mix the tasks (round robin), so the env pool holds ~eval_batch envs in all, not eval_batch per task
        # (each task keeps its own envs); the episodes are the same, only their order in the batch changes
        rank = {t: 0 for t in env_cfg.tasks}
        order = []
        for i, t in enumerate(tasks):
            order.append((rank[t], env_cfg.tasks.index(t), i))
            rank[t] += 1
        run_order = [i for _, _, i in sorted(order)]
    else:
        run_order = list(range(len(keys)))
    own = venv is None
    venv = venv or make_vector_env(env_cfg)
    mode = "ode" if policy.cfg.head == "flow" else "greedy"
    was_training = policy.training
    policy.eval()
    # each episode draws its own start noise (episode_noise_seed), so running the keys in slices of eval_batch gives
    # the same episodes as running them at once
    size = env_cfg.eval_batch or len(keys)
    slices = range(0, len(keys), size)
    progress = None
    if log is not None:  # env steps of the lock-stepped slices, one after the other
        what = f"evaluation ({len(keys)} episodes{f', {len(env_cfg.tasks)} tasks' if len(env_cfg.tasks) > 1 else ''})"
        progress = Progress(log, what, env_cfg.horizon * len(slices), "env steps", every=PROGRESS_EVERY)

    def on_chunk(j: int):
        return None if progress is None else (lambda steps: progress.update(j * env_cfg.horizon + steps))

    try:
        batches = []
        for j, a in enumerate(slices):
            idx = run_order[a: a + size]
            batches.append(run_episodes(
                policy, venv, [keys[i] for i in idx], [tasks[i] for i in idx],
                SamplingSettings(mode=mode, init_noise=init_noise), env_cfg.horizon,
                torch.Generator().manual_seed(seed), record_frames=gif_dir is not None,
                device=next(policy.parameters()).device,  # observations go where the policy is
                episode_noise_seed=[seed + draws[i] for i in idx], on_chunk=on_chunk(j)))
        batch = concat_batches(batches)
    finally:
        policy.train(was_training)
        if own:
            venv.close()
    if gif_dir is not None:
        gif_dir.mkdir(parents=True, exist_ok=True)
        for task in env_cfg.tasks:
            i = batch.tasks.index(task)
            ok = "ok" if batch.success_once[i] else "fail"
            # one frame per action chunk: chunk env steps of 1/fps s each, played in real time; a LIBERO task name
            # (suite/index) becomes suite-index in the file name
            fps = LIBERO_FPS if env_cfg.kind == "libero" else METAWORLD_FPS
            write_gif(batch.frames[i], gif_dir / f"{tag}{task.replace('/', '-')}-{ok}.gif", fps=fps / policy.cfg.chunk)
    succ = batch.success_once if env_cfg.success_mode == "once" else batch.success_end
    # back in the episodes' natural order (draw, task, state), whatever order the slices ran them in
    back = np.argsort(np.asarray(run_order))
    settings = eval_settings(env_cfg, per_task, split, first_index, seed, noise_draws, init_noise)
    return EvalOutcomes(tasks, keys, draws, np.asarray(succ, bool)[back], np.asarray(batch.length)[back], settings)


def eval_settings(env_cfg: EnvConfig, per_task: int, split: str = "eval", first_index: int = 0, seed: int = 0,
                  noise_draws: int = 1, init_noise: float = 1.0) -> dict[str, Any]:
    """What makes two evaluations the same episodes (``EvalOutcomes.settings``): the states, the start noise, the
    env's episode rules and observation."""
    return {"split": split, "first_index": first_index, "per_task": per_task, "seed": seed,
            "noise_draws": noise_draws, "init_noise": float(init_noise), "success_mode": env_cfg.success_mode,
            "tasks": list(env_cfg.tasks), "horizon": env_cfg.horizon, "env": env_cfg.kind,
            "cameras": list(env_cfg.cameras), "image_size": env_cfg.image_size, "render_tuned": env_cfg.render_tuned}


def policy_digest(policy: TinyVLA) -> str:
    """The sha256 of the weights that decide the policy's actions: every tensor of its state dict, except task
    adapters whose up-projections are all zero (freshly added, they change no output), so a clone and the same clone
    with an RL run's fresh adapters have one digest (``robotics.eval_baseline`` checks it)."""
    import hashlib

    state = policy.state_dict()
    if any(t.is_meta for t in state.values()):  # built on the meta device (an FSDP2 process other than 0: its
        return "meta"  # weights come from process 0, which digests them and alone evaluates)
    fresh = policy.adapters is not None and not bool(policy.adapters.up.detach().any())
    h = hashlib.sha256()
    for name in sorted(state):
        if fresh and name.startswith("adapters."):
            continue
        t = state[name].detach().cpu().contiguous()
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def evaluate_policy(policy: TinyVLA, env_cfg: EnvConfig, per_task: int, venv=None, gif_dir: Path | None = None,
                    tag: str = "", seed: int = 0, init_noise: float = 1.0, split: str = "eval",
                    first_index: int = 0, standard_errors: bool = False, log=None,
                    noise_draws: int = 1, outcomes: list | None = None) -> dict[str, float]:
    """The metrics of ``evaluate_episodes`` (``outcome_metrics``): ``eval/success``, ``eval/success/<task>``, and
    with ``standard_errors`` ``eval/success_se`` (+ ``/<task>``). ``outcomes``: a list the episodes
    (``EvalOutcomes``) are appended to, for a paired comparison."""
    out = evaluate_episodes(policy, env_cfg, per_task, venv, gif_dir, tag, seed, init_noise, split, first_index,
                            noise_draws, log)
    if outcomes is not None:
        outcomes.append(out)
    return outcome_metrics(out, standard_errors)
