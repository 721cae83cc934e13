"""The audit no world-model RL paper reports: replay imagined episodes in the physics simulator.

MuJoCo state restores exactly (``envs.metaworld_env.MetaWorldTaskEnv.set_state``), and every imagined rollout
starts at a real keyframe whose simulator state was recorded. ``replay`` restores those states and executes the
*same* action chunks the policy chose in imagination; ``audit`` compares:

- ``hallucinated_success_rate``: imagined successes (world model + success model) the simulator does not confirm;
- ``imagined_recall``: simulator successes that imagination also found;
- ``rank_spearman``: rank agreement of the best imagined success probability with the replay's success
  (``shared_rl.two_stage.spearman``, as the verified and short-horizon rollouts report theirs);
- ``reward_model_precision`` / ``reward_model_recall``: the success model applied to the *real* replayed frames
  against the simulator's per-chunk flags (the reward model alone, without the world model's errors);
- ``image_mse_by_step``: per chunk depth, the mean squared error (pixels in [0, 1]) between the imagined frame
  and the simulator's frame after the same actions (the error-vs-horizon curve).
"""
from __future__ import annotations

import numpy as np
import torch

from shared_rl.two_stage import spearman

from .data import ChunkEpisode, RecordingEnv
from .reward import precision_recall


def replay(venv, reset_keys: list[int], states: list, action_chunks: list[np.ndarray],
           start_frames: list[np.ndarray] | None = None, start_proprio: list[np.ndarray] | None = None) -> list[ChunkEpisode]:
    """Restore ``states`` (``get_states`` entries) in ``venv`` and execute each episode's ``action_chunks[i]``
    ``[C_i, K, A]`` in lock-step; returns the replayed chunk episodes (frames, success per chunk).

    ``reset_keys[i]`` only has to be a reset state of the right task (slots are built by ``reset``)."""
    n = len(states)
    rec = RecordingEnv(venv, record_states=False)
    rec.reset(list(reset_keys))
    venv.set_states(list(range(n)), list(states))
    frames0 = venv.render(list(range(n)))
    for i in range(n):
        rec._rec[i]["frames"][0] = frames0[i] if start_frames is None else start_frames[i]
        if start_proprio is not None:
            rec._rec[i]["proprio"][0] = start_proprio[i]
    # a restored slot that was finished stays finished: RecordingEnv tracks "done" from the step results
    rec._done = np.array([bool(s[2]) if isinstance(s, tuple) else bool(getattr(s, "done", False)) for s in states])
    longest = max((len(a) for a in action_chunks), default=0)
    k, a_dim = (action_chunks[0].shape[1], action_chunks[0].shape[2]) if longest else (1, 4)
    for c in range(longest):
        acts = np.zeros((n, k, a_dim), np.float32)
        active = np.zeros(n, bool)
        for i, a in enumerate(action_chunks):
            if c < len(a):
                acts[i], active[i] = a[c], True
        if not active.any():
            break
        rec.step_chunk(acts, active)
    return rec.episodes(source="replay")


def _mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a.astype(np.float32) / 255.0 - b.astype(np.float32) / 255.0) ** 2))


def audit(imagined: list[dict], replayed: list[ChunkEpisode], wm=None, success_model=None,
          max_depth: int = 16) -> dict[str, float | list]:
    """Compare imagined episodes (``{"success": bool, "frames": [C, H, W, Ch], "prob": [C]}``) with their
    replays; see the module docstring for the metrics."""
    imag = np.array([bool(e["success"]) for e in imagined])
    sim = np.array([r.succeeded for r in replayed])
    out: dict[str, float | list] = {"episodes": float(len(imag)), "imagined_success_rate": float(imag.mean()) if len(imag) else float("nan"),
                                    "replay_success_rate": float(sim.mean()) if len(sim) else float("nan")}
    out["hallucinated_success_rate"] = float((imag & ~sim).sum() / imag.sum()) if imag.sum() else float("nan")
    # does imagination rank the episodes as the simulator does (the best imagined P(success) vs the replay's outcome)
    best = torch.tensor([max(e["prob"]) if len(e["prob"]) else float("nan") for e in imagined], dtype=torch.float64)
    out["rank_spearman"] = spearman(best, torch.from_numpy(sim.astype(np.float64))) if len(sim) else float("nan")
    out["imagined_recall"] = float((imag & sim).sum() / sim.sum()) if sim.sum() else float("nan")
    err = [[] for _ in range(max_depth)]
    for e, r in zip(imagined, replayed):
        for c, f in enumerate(e["frames"][:max_depth]):
            if c + 1 < len(r.frames) and c < r.num_chunks:
                err[c].append(_mse(f, r.frames[c + 1]))
    out["image_mse_by_step"] = [float(np.mean(x)) if x else float("nan") for x in err]
    if wm is not None and success_model is not None and replayed:
        frames = np.concatenate([r.frames[1:] for r in replayed if r.num_chunks])
        pro = np.concatenate([r.proprio[1:] for r in replayed if r.num_chunks])
        truth = np.concatenate([r.success for r in replayed if r.num_chunks])
        with torch.no_grad():
            z = torch.cat([wm.encode(torch.from_numpy(frames[i:i + 256])) for i in range(0, len(frames), 256)])
            pred = (success_model.prob(z, torch.from_numpy(pro)) > success_model.cfg.threshold).numpy()
        pr = precision_recall(pred, truth)
        out["reward_model_precision"], out["reward_model_recall"] = pr["precision"], pr["recall"]
    return out
