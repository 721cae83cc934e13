"""Held-out measurements of a trained world model + success model on whole real episodes it never trained on.

``keyframe_rollouts``: from every ``stride``-th chunk boundary of each held-out episode (a real keyframe: its
frame, the frame before it as history, its proprio), the model runs ``depth`` chunks open loop with the episode's
real actions. Per model step k it reports

- ``image_mse`` (float pixels in [0, 1]) overall and per camera (the frame's channels in groups of 3, the order of
  ``env.cameras``: LIBERO's ``image`` then ``image2``), beside ``copy_mse``: predicting "nothing moves" (the
  keyframe's own frame) — a model that does not beat it has learned no dynamics;
- ``proprio_rmse`` (native units: LIBERO's metres / radians / finger qpos) beside its copy baseline;
- the success model on the *imagined* boundary against the real flag of that chunk: what an imagined RL episode
  is scored by, so its precision is the share of imagined successes that were real.

``success_report``: the success model on the held-out episodes' real (encoded) boundaries, per boundary and per
episode (an episode predicted successful when any of its boundaries is; LIBERO's success is sparse, one boundary
per successful episode, so the episode view is the one a reader compares to success rates; it covers the recorded
policy episodes only, see ``success_report``).

Counts travel with every rate (a precision over three predicted positives is not a number to trust), and rates
without a denominator are NaN.
"""
from __future__ import annotations

import numpy as np
import torch

from .data import ChunkEpisode
from .model import WorldModel
from .reward import SuccessModel, precision_recall


def _full(ep: ChunkEpisode, c: int) -> bool:
    """Chunk ``c``'s end frame is the observation after the whole chunk (or the episode's final frame)."""
    return bool(ep.executed[c] == ep.actions.shape[1] or c == ep.num_chunks - 1)


@torch.no_grad()
def keyframe_rollouts(wm: WorldModel, episodes: list[ChunkEpisode], success: SuccessModel | None = None,
                      depth: int = 8, stride: int = 4) -> dict:
    cams = max(1, wm.cfg.image_channels // 3)
    sums = {k: np.zeros(depth) for k in ("image_mse", "copy_mse", "proprio_rmse", "copy_proprio_rmse", "n")}
    cam_sums = np.zeros((depth, cams))
    probs: list[float] = []
    true_flags: list[bool] = []
    keyframes = 0
    for ep in episodes:
        starts = list(range(0, ep.num_chunks, stride))
        if not starts:
            continue
        keyframes += len(starts)
        s = torch.tensor(starts)
        frames = torch.from_numpy(ep.frames)
        proprio = torch.from_numpy(ep.proprio)
        z_all = wm.encode(frames)
        z, z_prev, p = z_all[s], z_all[(s - 1).clamp(min=0)], proprio[s]
        real0 = wm.to_float(frames[s])
        alive = torch.ones(len(starts), dtype=torch.bool)
        for k in range(depth):
            c = s + k  # the chunk executed in this model step
            alive = alive & (c < ep.num_chunks)
            if not alive.any():
                break
            cc = c.clamp(max=ep.num_chunks - 1)
            pred = wm.step(z, z_prev, p, torch.from_numpy(ep.actions)[cc])
            rows = alive.nonzero().squeeze(1)
            img = wm.decode_float(pred.z[rows])
            real = wm.to_float(frames[cc[rows] + 1])
            sq = (img - real).pow(2)  # [n, C, H, W]
            sums["image_mse"][k] += float(sq.mean((1, 2, 3)).sum())
            sums["copy_mse"][k] += float((real0[rows] - real).pow(2).mean((1, 2, 3)).sum())
            cam_sums[k] += sq.view(len(rows), cams, -1).mean(2).sum(0).numpy()
            p_real = proprio[cc[rows] + 1]
            sums["proprio_rmse"][k] += float((pred.proprio[rows] - p_real).pow(2).mean(1).sqrt().sum())
            sums["copy_proprio_rmse"][k] += float((proprio[s[rows]] - p_real).pow(2).mean(1).sqrt().sum())
            sums["n"][k] += len(rows)
            if success is not None:
                probs += success.prob(pred.z[rows], pred.proprio[rows]).tolist()
                true_flags += ep.success[cc[rows].numpy()].tolist()
            # a partial chunk (the episode ended inside it) ends the rollout: nothing real follows it
            alive = alive & torch.tensor([_full(ep, int(x)) for x in cc])
            z_prev, z, p = z, pred.z, pred.proprio
    n = np.maximum(sums["n"], 1)
    out = {k: [float(x) for x in (sums[k] / n)] for k in ("image_mse", "copy_mse", "proprio_rmse", "copy_proprio_rmse")}
    out["image_mse_by_camera"] = [[float(x) for x in row] for row in (cam_sums / n[:, None])]
    out["transitions_by_step"] = [int(x) for x in sums["n"]]
    out["keyframes"] = keyframes
    for k in ("image_mse", "copy_mse", "proprio_rmse", "copy_proprio_rmse"):
        out[k] = [v if sums["n"][i] else float("nan") for i, v in enumerate(out[k])]
    if success is not None:
        prob, truth = np.array(probs, float), np.array(true_flags, bool)
        out["imagined_success"] = precision_recall(prob > success.cfg.threshold, truth)
        out["imagined_success_at_0.5"] = precision_recall(prob > 0.5, truth)  # a cut not tuned on held-out data
    return out


@torch.no_grad()
def success_report(wm: WorldModel, success: SuccessModel, episodes: list[ChunkEpisode],
                   threshold: float | None = None, episode_sources: tuple[str, ...] = ("policy",)) -> dict:
    """The success model on the real held-out boundaries: per boundary and per episode (see the module docstring).
    ``threshold``: the P(success) cut (default the model's own, which the training job chooses on the held-out
    episodes themselves, so pass a fixed one, e.g. 0.5, for numbers nothing was tuned on).

    Every boundary's label is the simulator's, so the boundary view uses all episodes; the episode view only those
    of ``episode_sources`` whose outcome frame is recorded: a demonstration cut from a per-step file ends before its
    success frame (the observation after the last action is not stored), so it would count as a failed episode and
    a correct "nearly there" call on its last frame as a false positive."""
    thr = success.cfg.threshold if threshold is None else float(threshold)
    per_boundary_pred, per_boundary_true, ep_pred, ep_true = [], [], [], []
    for ep in episodes:
        if ep.num_chunks < 1:
            continue
        z = wm.encode(torch.from_numpy(ep.frames[1:]))
        flags = (success.prob(z, torch.from_numpy(ep.proprio[1:])) > thr).numpy()
        per_boundary_pred += flags.tolist()
        per_boundary_true += ep.success.tolist()
        if ep.source in episode_sources:
            ep_pred.append(bool(flags.any()))
            ep_true.append(ep.succeeded)
    return {"boundary": precision_recall(np.array(per_boundary_pred, bool), np.array(per_boundary_true, bool)),
            "episode": precision_recall(np.array(ep_pred, bool), np.array(ep_true, bool)),
            "episodes": len(ep_true), "successful_episodes": int(sum(ep_true)), "threshold": thr}
