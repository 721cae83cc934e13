"""Does the world model rank a keyframe's candidates as the simulator would? Sibling sets and the ranking probe.

A **sibling set** is one keyframe (a real chunk boundary with its restored simulator state), ``N`` candidate
episodes imagined from it in the world model — each with its own noise stream (``episodes.chunk_noise``), as the
verified rollout explores — and *every* candidate re-executed in the simulator from the restored state with the
same stream, closed loop on the real frames. The imagined side keeps what a ranker may read (per chunk: the
imagined latent, proprio, the action chunk the policy chose on the imagined frame, the success model's
probability, the ensemble disagreement); the real side keeps the outcomes (success, the best shaped reward) and,
for the ceiling row of the probe only, the same features of the real trajectory.

``ranking_metrics`` is the probe: the two-stage selector compares candidates **within** one keyframe, so the number
that matters is the rank agreement of the imagined score with the real outcome among one keyframe's siblings
(``spearman_within``, mean over keyframes where both vary), and what selection does for GRPO: ``top_k_precision``
(the real success of the k best-scored, against the keyframe's base rate), ``mixed_selected`` vs ``mixed_random``
(kept groups whose real outcomes differ: the ones GRPO learns from). ``spearman_across`` (all candidates of all
keyframes) is mostly keyframe difficulty and is reported apart.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from shared_rl.two_stage import select_candidates, spearman


@dataclass
class SiblingSets:
    """``G`` keyframes x ``N`` candidates x at most ``T`` chunks (padded; ``valid`` marks the executed chunks)."""

    keys: np.ndarray  # [G] keyframe keys
    seeds: np.ndarray  # [G, N] each candidate's noise stream (imagination can be redone with a changed model)
    episode_keys: np.ndarray  # [G] the real reset state each keyframe's trajectory came from
    chunk: np.ndarray  # [G] the keyframe's boundary index on that trajectory
    start_z: np.ndarray  # [G, Dz] the keyframe frame's latent
    start_proprio: np.ndarray  # [G, P]
    z: np.ndarray  # [G, N, T, Dz] imagined latent after each chunk (float16 on disk)
    proprio: np.ndarray  # [G, N, T, P] imagined proprio after each chunk
    actions: np.ndarray  # [G, N, T, K*A] the chunk the policy chose (on the imagined frame)
    prob: np.ndarray  # [G, N, T] success-model probability of the imagined boundary
    uncertainty: np.ndarray  # [G, N, T] ensemble disagreement / its calibrated reference
    valid: np.ndarray  # [G, N, T] bool
    score: np.ndarray  # [G, N] the verified rollout's score (best imagined P(success))
    imagined_success: np.ndarray  # [G, N] bool
    real_success: np.ndarray  # [G, N] bool
    real_dense: np.ndarray  # [G, N] best shaped reward / 10 of the re-executed episode
    real_steps: np.ndarray  # [G, N] env steps of the re-executed episode
    real_z: np.ndarray | None = None  # [G, N, T, Dz] the same features of the real re-executed trajectory
    real_proprio: np.ndarray | None = None
    real_actions: np.ndarray | None = None
    real_valid: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.score.shape

    def subset(self, rows) -> "SiblingSets":
        rows = np.asarray(rows)
        return SiblingSets(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[rows])
                              for f in fields(self)})

    def first_candidates(self, n: int) -> "SiblingSets":
        """The first ``n`` candidates of every keyframe (their noise streams are independent, so the first ``n`` are a
        random ``n``): what a sibling set of ``n`` re-executions costs and teaches."""
        g, total = self.shape
        if not 1 <= n <= total:
            raise ValueError(f"first_candidates({n}): the sets hold {total} candidates per keyframe")
        per_keyframe = {"keys", "episode_keys", "chunk", "start_z", "start_proprio"}
        return SiblingSets(**{f.name: (getattr(self, f.name) if f.name in per_keyframe or getattr(self, f.name) is None
                                       else getattr(self, f.name)[:, :n]) for f in fields(self)})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        for name in ("z", "real_z", "start_z"):
            if name in arrays:
                arrays[name] = arrays[name].astype(np.float16)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)  # nothing half-written under the final name
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SiblingSets":
        z = np.load(Path(path), allow_pickle=False)
        vals = {f.name: (z[f.name] if f.name in z.files else None) for f in fields(cls)}
        for name in ("z", "real_z", "start_z"):
            if vals[name] is not None:
                vals[name] = vals[name].astype(np.float32)
        return cls(**vals)

    @classmethod
    def concat(cls, parts: list["SiblingSets"]) -> "SiblingSets":
        def cat(name):
            xs = [getattr(p, name) for p in parts]
            return None if any(x is None for x in xs) else np.concatenate(xs)
        return cls(**{f.name: cat(f.name) for f in fields(cls)})


def imagined_scores(slots, score: str) -> tuple[np.ndarray, np.ndarray]:
    """Per imagined slot (``WorldModelEnv.slots``): the selector's score and the 0/1 imagined success. ``prob`` =
    the best success probability over the trusted steps (a rollout truncated for uncertainty: all but its last)."""
    probs = [s.trace["prob"][:-1] if s.truncated else s.trace["prob"] for s in slots]
    best = np.array([max(p) if p else 0.0 for p in probs], np.float64)
    success = np.array([float(s.success_once) for s in slots])
    return (best if score == "prob" else success), success


def _pad(seqs: list[list], t: int, shape: tuple, dtype) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(seqs), t, *shape), dtype)
    valid = np.zeros((len(seqs), t), bool)
    for i, s in enumerate(seqs):
        n = min(len(s), t)
        if n:
            out[i, :n] = np.stack([np.asarray(x, dtype).reshape(shape) for x in s[:n]])
            valid[i, :n] = True
    return out, valid


@torch.no_grad()
def imagine_candidates(policy, imagine, keys: list[int], seeds: torch.Tensor, horizon: int, sampling,
                       generator: torch.Generator, task_of) -> dict[str, np.ndarray]:
    """The imagined side of sibling sets: one episode per (keyframe, stream) in ``imagine`` (a ``WorldModelEnv``),
    as ``[G, N, ...]`` arrays (the ``SiblingSets`` fields of the same names)."""
    from ..episodes import run_episodes

    g, n = seeds.shape
    cand = [kk for kk in keys for _ in range(n)]
    policy.eval()
    run_episodes(policy, imagine, cand, [task_of(kk) for kk in cand], sampling, horizon, generator,
                 noise_seeds=seeds.flatten().tolist())
    return slot_features(imagine, keys, n, policy.cfg.chunk, -(-horizon // policy.cfg.chunk))


@torch.no_grad()
def slot_features(imagine, keys: list[int], n: int, chunk: int, t_max: int) -> dict[str, np.ndarray]:
    """What the rankers read of the imagined episodes now in ``imagine``'s slots (``n`` per key of ``keys``, in
    order): ``[G, N, ...]`` arrays named as the ``SiblingSets`` fields."""
    wm, slots, g = imagine.wm, imagine.slots, len(keys)
    score, imag = imagined_scores(slots, "prob")
    dz = int(np.prod(wm.cfg.latent_shape))
    z, valid = _pad([[x.flatten().numpy() for x in s.trace["z"]] for s in slots], t_max, (dz,), np.float32)
    pro, _ = _pad([s.trace["proprio"] for s in slots], t_max, (wm.cfg.proprio_dim,), np.float32)
    act, _ = _pad([s.trace["actions"] for s in slots], t_max, (chunk * wm.cfg.action_dim,), np.float32)
    prob, _ = _pad([[[p] for p in s.trace["prob"]] for s in slots], t_max, (1,), np.float32)
    unc, _ = _pad([[[u] for u in s.trace["uncertainty"]] for s in slots], t_max, (1,), np.float32)
    kfs = [imagine.keyframes[kk] for kk in keys]
    start_z = wm.encode(torch.from_numpy(np.stack([kf.frame for kf in kfs]))).flatten(1).numpy()
    sh = lambda a: a.reshape(g, n, *a.shape[1:])  # noqa: E731
    return {"start_z": start_z, "start_proprio": np.stack([kf.proprio for kf in kfs]).astype(np.float32),
            "z": sh(z), "proprio": sh(pro), "actions": sh(act), "prob": sh(prob[..., 0]),
            "uncertainty": sh(unc[..., 0]), "valid": sh(valid), "score": sh(score),
            "imagined_success": sh(imag.astype(bool))}


@torch.no_grad()
def collect_sibling_sets(policy, imagine, restored, keys: list[int], candidates: int, horizon: int, sampling,
                         generator: torch.Generator, task_of, real_features: bool = True,
                         keys_per_batch: int = 4, log=None) -> SiblingSets:
    """Imagine ``candidates`` episodes per keyframe in ``imagine`` (a ``WorldModelEnv``) and re-execute every one in
    ``restored`` (a ``verified.RestoredEnv``) with the same noise stream (see the module docstring). Batches of
    ``keys_per_batch`` keyframes keep the simulator's env count bounded."""
    from ..episodes import run_episodes
    from .data import RecordingEnv

    wm = imagine.wm
    k_chunk = policy.cfg.chunk
    t_max = -(-horizon // k_chunk)
    dz = int(np.prod(wm.cfg.latent_shape))
    parts = []
    for b0 in range(0, len(keys), keys_per_batch):
        ks = list(keys[b0:b0 + keys_per_batch])
        g, n = len(ks), candidates
        seeds = torch.randint(0, 2**62, (g, n), generator=generator)
        imagined = imagine_candidates(policy, imagine, ks, seeds, horizon, sampling, generator, task_of)
        cand = [kk for kk in ks for _ in range(n)]
        rec = RecordingEnv(restored) if real_features else restored
        real = run_episodes(policy, rec, cand, [task_of(kk) for kk in cand], sampling, horizon, generator,
                            noise_seeds=seeds.flatten().tolist())
        extra = {}
        if real_features:
            eps = rec.episodes()
            rz = [[x.flatten().numpy() for x in wm.encode(torch.from_numpy(e.frames[1:]))] if e.num_chunks else []
                  for e in eps]
            extra["real_z"], extra["real_valid"] = _pad(rz, t_max, (dz,), np.float32)
            extra["real_proprio"], _ = _pad([list(e.proprio[1:]) for e in eps], t_max, (wm.cfg.proprio_dim,), np.float32)
            extra["real_actions"], _ = _pad([list(e.actions) for e in eps], t_max, (k_chunk * wm.cfg.action_dim,),
                                            np.float32)
            extra = {name: v.reshape(g, n, *v.shape[1:]) for name, v in extra.items()}
        kfs = [imagine.keyframes[kk] for kk in ks]
        sh = lambda a: a.reshape(g, n, *a.shape[1:])  # noqa: E731
        parts.append(SiblingSets(
            keys=np.array(ks, np.int64), seeds=seeds.numpy().astype(np.int64),
            episode_keys=np.array([kf.episode_key for kf in kfs], np.int64),
            chunk=np.array([kf.chunk for kf in kfs], np.int64), **imagined,
            real_success=sh(real.success_once.astype(bool)), real_dense=sh(real.dense.astype(np.float32)),
            real_steps=sh(real.length.astype(np.int64)), **extra))
        if log is not None:
            done = min(b0 + keys_per_batch, len(keys))
            log(f"sibling sets: {done}/{len(keys)} keyframes ({int(real.length.sum())} real env steps in this batch)")
    return SiblingSets.concat(parts)


SPREAD = (0.25, 0.75)  # the real success rates of the keyframes ``spearman_within_spread`` averages over


def ranking_metrics(score, real, k: int = 4) -> dict[str, float]:
    """The probe: ``score`` and ``real`` outcomes ``[G, N]`` (see the module docstring). ``top_k_precision`` and
    ``base_rate`` are over the keyframes whose real outcomes vary (elsewhere every selection scores the same)."""
    S = torch.as_tensor(np.asarray(score, np.float64))
    R = torch.as_tensor(np.asarray(real, np.float64))
    G, N = S.shape
    within = np.array([spearman(S[g], R[g]) for g in range(G)])
    # the best any scorer can reach on a keyframe: a strict order consistent with its (tied) outcomes; with binary
    # outcomes it is ~sqrt(3 p (1 - p)) for a success rate p (0.87 at p = 0.5, 0.42 at 1 in 16)
    ceiling = np.array([spearman(R[g] + 1e-6 * torch.arange(N, dtype=R.dtype), R[g]) for g in range(G)])
    ceiling = np.where(np.isfinite(within), ceiling, np.nan)
    mixed_rows = (R.max(1).values > R.min(1).values)
    top = torch.argsort(S, dim=1, descending=True, stable=True)[:, :k]
    keep = select_candidates(S, k, "max_variance")
    mixed = lambda r: float(((r.max(1).values > r.min(1).values).double()).mean())  # noqa: E731
    m = mixed_rows.numpy()
    out = {
        "keyframes": float(G), "candidates": float(N),
        "spearman_within": float(np.nanmean(within)) if np.isfinite(within).any() else float("nan"),
        "spearman_within_defined": float(np.isfinite(within).sum()),
        "spearman_within_max": float(np.nanmean(ceiling)) if np.isfinite(ceiling).any() else float("nan"),
        "spearman_across": spearman(S, R),
        "top_k_precision": float(R.gather(1, top)[mixed_rows].mean()) if m.any() else float("nan"),
        "base_rate": float(R[mixed_rows].mean()) if m.any() else float("nan"),
        "mixed_selected": mixed(R.gather(1, keep)), "mixed_random": mixed(R[:, :k]), "real_mixed_all": mixed(R),
    }
    out["top_k_lift"] = out["top_k_precision"] - out["base_rate"]
    # the share of the reachable order a scorer gets (1 = as good as any scorer can be on these keyframes)
    out["spearman_within_of_max"] = out["spearman_within"] / out["spearman_within_max"]
    # binary outcomes: the keyframes with a spread of SPREAD (4-12 successes of 16), where a group's advantages carry
    # most signal and the reachable maximum is >= ~0.75 (near-all-or-nothing keyframes cap any scorer at ~0.4)
    binary = bool(((R == 0) | (R == 1)).all())
    p = R.mean(1).numpy()
    spread = np.isfinite(within) & (p >= SPREAD[0]) & (p <= SPREAD[1])
    out["spearman_within_spread"] = float(within[spread].mean()) if binary and spread.any() else float("nan")
    out["keyframes_spread"] = float(spread.sum()) if binary else float("nan")
    return out
