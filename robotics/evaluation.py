"""Evaluation of a VLA policy: deterministic (ODE / arg-max) episodes on reset states of a split.

Shared by behaviour cloning (``robotics.bc``), the RL domain (held-out evaluation, and the validation states of
``robotics.adapters.keep_best``) and the scripts; it imports neither of them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .data import LIBERO_FPS, METAWORLD_FPS
from .envs.metaworld_env import make_key
from .envs.vector import EnvConfig, make_vector_env
from .episodes import SamplingSettings, concat_batches, run_episodes, success_by_task, write_gif
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


def evaluate_policy(policy: TinyVLA, env_cfg: EnvConfig, per_task: int, venv=None, gif_dir: Path | None = None,
                    tag: str = "", seed: int = 0, init_noise: float = 1.0, split: str = "eval",
                    first_index: int = 0, standard_errors: bool = False, log=None) -> dict[str, float]:
    """Deterministic (ODE / arg-max) success on the held-out evaluation reset states (or on ``per_task`` states of
    another ``split`` from ``first_index`` on: the validation states of ``robotics.adapters.keep_best``).

    The flow head's ODE starts from Gaussian noise; each episode draws it from its own generator, seeded by
    (``seed``, its reset-state key), so an evaluation is a deterministic function of the weights, and one task's
    score does not move when only another task's policy changes (``run_episodes(episode_noise_seed=...)``).
    ``standard_errors``: also ``eval/success_se`` and ``eval/success_se/<task>`` (``episodes.success_by_task``).
    ``log``: where a long evaluation reports progress with an ETA (``shared_rl.metrics.Progress``: env steps of the
    horizon run so far by the lock-stepped episodes; the ETA is an upper bound, episodes may end sooner).
    """
    from shared_rl.metrics import Progress

    keys, tasks = eval_keys(env_cfg, per_task, split, first_index)
    if env_cfg.eval_batch and env_cfg.eval_batch < len(keys):
        # slices mix the tasks (round robin), so the env pool holds ~eval_batch envs in all, not eval_batch per task
        # (each task keeps its own envs); the episodes are the same, only their order in the batch changes
        rank = {t: 0 for t in env_cfg.tasks}
        order = []
        for i, t in enumerate(tasks):
            order.append((rank[t], env_cfg.tasks.index(t), i))
            rank[t] += 1
        idx = [i for _, _, i in sorted(order)]
        keys, tasks = [keys[i] for i in idx], [tasks[i] for i in idx]
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
        batch = concat_batches([
            run_episodes(policy, venv, keys[a: a + size], tasks[a: a + size],
                         SamplingSettings(mode=mode, init_noise=init_noise), env_cfg.horizon,
                         torch.Generator().manual_seed(seed), record_frames=gif_dir is not None,
                         device=next(policy.parameters()).device,  # observations go where the policy is
                         episode_noise_seed=seed, on_chunk=on_chunk(j))
            for j, a in enumerate(slices)])
    finally:
        policy.train(was_training)
        if own:
            venv.close()
    if gif_dir is not None:
        gif_dir.mkdir(parents=True, exist_ok=True)
        for task in env_cfg.tasks:
            i = tasks.index(task)
            ok = "ok" if batch.success_once[i] else "fail"
            # one frame per action chunk: chunk env steps of 1/fps s each, played in real time; a LIBERO task name
            # (suite/index) becomes suite-index in the file name
            fps = LIBERO_FPS if env_cfg.kind == "libero" else METAWORLD_FPS
            write_gif(batch.frames[i], gif_dir / f"{tag}{task.replace('/', '-')}-{ok}.gif", fps=fps / policy.cfg.chunk)
    return success_by_task(batch, env_cfg.success_mode, standard_errors)
