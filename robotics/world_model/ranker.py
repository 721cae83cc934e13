"""A sibling ranker: scores a keyframe's imagined candidates in the order their real outcomes would take.

The success model judges one imagined frame at a time and was trained on real boundaries of *different* episodes;
among the siblings of one keyframe — the same start, different noise streams — its scores hardly differ and do not
follow the real outcomes (within-keyframe Spearman ~0, ``bench/robotics_wm_probe.py``). The selector of the verified
rollout needs exactly that within-keyframe order. ``SiblingRanker`` reads a candidate's whole imagined trajectory
(per chunk: the imagined latent through a learned projection, the imagined proprio and its displacement from the
keyframe's, the action chunk the policy chose, the success model's probability, the ensemble disagreement), pools
it over time (masked mean and max) beside the keyframe's own latent and proprio, and gives one score. It is trained
on **sibling sets** (``probe.SiblingSets``: every candidate re-executed in the simulator) with a pairwise logistic
loss (RankNet) over the pairs of siblings whose real outcomes differ — only the order inside a keyframe is learned,
so a keyframe's difficulty cannot stand in for it:

    L = mean over keyframes g, pairs (i, j) with y_gi > y_gj of  log(1 + exp(-(s_gi - s_gj)))

with ``y`` the real success (``target: success``) or the real return ``success + 0.5 x best shaped reward``
(``target: return``, the Meta-World recipe's reward weights: failures that came closer rank higher, so every
keyframe has pairs).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from shared_rl.errors import ConfigError

INPUTS = ("latent", "proprio", "actions", "prob", "uncertainty")


@dataclass
class RankerConfig:
    """Inputs and sizes of the sibling ranker (saved with its weights)."""

    latent_dim: int = field(default=1024, metadata={"help": "flattened world-model latent size"})
    proprio_dim: int = field(default=4, metadata={"help": "proprio size"})
    action_dim: int = field(default=16, metadata={"help": "action chunk size (chunk x env action size)"})
    horizon_chunks: int = field(default=20, metadata={"help": "chunks of an imagined candidate (the time feature's scale)"})
    inputs: list[str] = field(default_factory=lambda: list(INPUTS), metadata={
        "help": f"what the ranker reads per chunk, any of {list(INPUTS)}"})
    first_chunks: int = field(default=0, metadata={"help": "read only the first n chunks (0 = all)"})
    latent_proj: int = field(default=32, metadata={"help": "the latent's learned projection size"})
    hidden: int = field(default=128, metadata={"help": "MLP width"})
    step_features: int = field(default=16, metadata={"help": "per-chunk features (concatenated over time)"})
    trained_real_steps: int = field(default=0, metadata={
        "help": "real env steps of the re-executed sibling sets the ranker was trained on: part of any explorer's "
                "real-step budget that uses it, as the world model's own data is"})

    def check(self, where: str = "ranker") -> None:
        bad = sorted(set(self.inputs) - set(INPUTS))
        if bad or not self.inputs:
            raise ConfigError(f"{where}.inputs {self.inputs} must be a non-empty subset of {list(INPUTS)}")


@dataclass
class Trajectories:
    """Candidates' per-chunk features, ``[B, T, ...]`` (the ``SiblingSets`` fields flattened over keyframes)."""

    start_z: torch.Tensor  # [B, Dz]
    start_proprio: torch.Tensor  # [B, P]
    z: torch.Tensor  # [B, T, Dz]
    proprio: torch.Tensor  # [B, T, P]
    actions: torch.Tensor  # [B, T, Da]
    prob: torch.Tensor  # [B, T]
    uncertainty: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool

    def rows(self, idx) -> "Trajectories":
        return Trajectories(**{k: v[idx] for k, v in self.__dict__.items()})


def trajectories(sets, rows=None, real: bool = False) -> Trajectories:
    """``Trajectories`` of every candidate of ``sets`` (``rows``: a subset of its keyframes), flattened keyframe-major;
    ``real``: the re-executed real trajectories' features (the probe's ceiling; no success-model inputs there)."""
    s = sets if rows is None else sets.subset(rows)
    if real:
        zeros = np.zeros(s.real_valid.shape, np.float32)
        return trajectories_from({"start_z": s.start_z, "start_proprio": s.start_proprio, "z": s.real_z,
                                  "proprio": s.real_proprio, "actions": s.real_actions, "prob": zeros,
                                  "uncertainty": zeros, "valid": s.real_valid})
    return trajectories_from({name: getattr(s, name) for name in Trajectories.__dataclass_fields__})


def trajectories_from(arrays: dict) -> Trajectories:
    """``Trajectories`` from ``[G, ...]`` keyframe arrays (start_z, start_proprio) and ``[G, N, T, ...]`` candidate
    arrays (``probe.slot_features``' names), flattened keyframe-major."""
    n = arrays["valid"].shape[1]
    rep = lambda a: torch.from_numpy(np.repeat(np.asarray(a, np.float32), n, axis=0))  # noqa: E731
    flat = lambda a: torch.from_numpy(np.ascontiguousarray(a)).flatten(0, 1)  # noqa: E731
    return Trajectories(start_z=rep(arrays["start_z"]), start_proprio=rep(arrays["start_proprio"]),
                        **{k: flat(arrays[k]).float() for k in ("z", "proprio", "actions", "prob", "uncertainty")},
                        valid=flat(arrays["valid"]).bool())


class SiblingRanker(nn.Module):
    def __init__(self, cfg: RankerConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        use = set(cfg.inputs)
        p = cfg.proprio_dim
        step = 1 + (cfg.latent_proj if "latent" in use else 0) + (2 * p if "proprio" in use else 0) + \
            (cfg.action_dim if "actions" in use else 0) + ("prob" in use) + ("uncertainty" in use)
        ctx = cfg.latent_proj + p
        self.proj = nn.Linear(cfg.latent_dim, cfg.latent_proj)
        self.step_net = nn.Sequential(nn.Linear(step, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, cfg.step_features))
        self.head = nn.Sequential(nn.SiLU(), nn.Linear(cfg.horizon_chunks * cfg.step_features + ctx, cfg.hidden),
                                  nn.SiLU(), nn.Linear(cfg.hidden, 1))
        # input standardisation, set from the first training data (saved with the weights)
        self.register_buffer("z_mean", torch.zeros(cfg.latent_dim))
        self.register_buffer("z_std", torch.ones(cfg.latent_dim))
        self.register_buffer("p_mean", torch.zeros(p))
        self.register_buffer("p_std", torch.ones(p))

    def standardise_from(self, tr: Trajectories) -> None:
        zs = torch.cat([tr.z[tr.valid], tr.start_z])
        ps = torch.cat([tr.proprio[tr.valid], tr.start_proprio])
        self.z_mean.copy_(zs.mean(0)), self.z_std.copy_(zs.std(0) + 1e-3)
        self.p_mean.copy_(ps.mean(0)), self.p_std.copy_(ps.std(0) + 1e-3)

    def forward(self, tr: Trajectories) -> torch.Tensor:
        """One score per candidate ``[B]``; only the order among one keyframe's candidates is meaningful."""
        cfg, use = self.cfg, set(self.cfg.inputs)
        valid = tr.valid.clone()
        if cfg.first_chunks:
            valid[:, cfg.first_chunks:] = False
        b, t = valid.shape
        pz = lambda z: self.proj((z - self.z_mean) / self.z_std)  # noqa: E731
        pp = lambda x: (x - self.p_mean) / self.p_std  # noqa: E731
        ctx = torch.cat([pz(tr.start_z), pp(tr.start_proprio)], -1)
        time_feat = (torch.arange(t, dtype=torch.float32) / max(1, cfg.horizon_chunks))[None, :, None].expand(b, t, 1)
        parts = [time_feat]
        if "latent" in use:
            parts.append(pz(tr.z))
        if "proprio" in use:
            parts += [pp(tr.proprio), (tr.proprio - tr.start_proprio[:, None]) / self.p_std]
        if "actions" in use:
            parts.append(tr.actions)
        if "prob" in use:
            parts.append(tr.prob[..., None])
        if "uncertainty" in use:
            parts.append(tr.uncertainty[..., None].clamp(max=10.0))
        h = self.step_net(torch.cat(parts, -1)) * valid[..., None].float()  # [B, T, F]; chunks not run are 0
        if t < cfg.horizon_chunks:
            h = F.pad(h, (0, 0, 0, cfg.horizon_chunks - t))
        # the chunks side by side: where in the episode something happens is part of what is read
        return self.head(torch.cat([h[:, :cfg.horizon_chunks].flatten(1), ctx], -1)).squeeze(-1)

    # -- files
    def save(self, out_dir: str | Path) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(out / "ranker.safetensors"))
        (out / "ranker.json").write_text(json.dumps(asdict(self.cfg), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "SiblingRanker":
        from safetensors.torch import load_file

        p = Path(path)
        if not (p / "ranker.json").is_file():
            raise FileNotFoundError(f"no sibling ranker in {p} (ranker.json missing)")
        m = cls(RankerConfig(**json.loads((p / "ranker.json").read_text())))
        m.load_state_dict(load_file(str(p / "ranker.safetensors")))
        return m.eval()


def outcome(sets, target: str = "return") -> np.ndarray:
    """``[G, N]`` real outcomes the ranker orders: ``success`` (0/1) or ``return`` (success + 0.5 x best shaped
    reward / 10, the Meta-World recipe's reward weights)."""
    if target == "success":
        return sets.real_success.astype(np.float64)
    if target == "return":
        return sets.real_success.astype(np.float64) + 0.5 * sets.real_dense.astype(np.float64)
    raise ConfigError(f"ranker target {target!r} is unknown; choose success or return")


def pairwise_loss(scores: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """RankNet over each row's sibling pairs with ``y_i > y_j``: mean of ``softplus(-(s_i - s_j))``; ``[G, N]`` each.
    Rows without such a pair contribute nothing (0 when no row has one)."""
    diff = scores[:, :, None] - scores[:, None, :]
    better = (y[:, :, None] > y[:, None, :]).float()
    n = better.sum()
    return (F.softplus(-diff) * better).sum() / n if n > 0 else scores.sum() * 0.0


def fit_ranker(sets, cfg: RankerConfig | None = None, target: str = "return", steps: int = 600, lr: float = 1e-3,
               weight_decay: float = 1e-3, keys_per_step: int = 8, val_fraction: float = 0.2, val_every: int = 25,
               seed: int = 0, real: bool = False, model: SiblingRanker | None = None, log=None) -> SiblingRanker:
    """Train a ``SiblingRanker`` on ``sets`` (``probe.SiblingSets``) with ``pairwise_loss``; the last
    ``val_fraction`` of its keyframes (none when fewer than 5) choose the step kept (the best mean within-keyframe
    Spearman against ``target``). ``real``: train on the re-executed trajectories' features (the ceiling)."""
    from shared_rl.two_stage import spearman

    g, n = sets.score.shape
    y_all = torch.from_numpy(outcome(sets, target)).float()
    n_val = int(round(val_fraction * g)) if g >= 5 else 0
    tr_rows, val_rows = np.arange(g - n_val), np.arange(g - n_val, g)
    ordered = tr_rows[(y_all[tr_rows].max(1).values > y_all[tr_rows].min(1).values).numpy()]
    if len(ordered) == 0:
        raise ConfigError("the sibling ranker needs keyframes whose siblings' real outcomes differ; none here")
    tr_all = trajectories(sets, real=real)
    if cfg is None:
        cfg = RankerConfig(latent_dim=tr_all.z.shape[-1], proprio_dim=tr_all.proprio.shape[-1],
                           action_dim=tr_all.actions.shape[-1], horizon_chunks=tr_all.z.shape[1])
    if model is None:
        model = SiblingRanker(cfg)
        model.standardise_from(tr_all.rows(torch.from_numpy(np.concatenate([np.arange(r * n, (r + 1) * n) for r in tr_rows]))))
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    rows_of = lambda rs: torch.from_numpy(np.concatenate([np.arange(r * n, (r + 1) * n) for r in rs]))  # noqa: E731

    def val_score() -> float:
        if not n_val:
            return float("nan")
        with torch.no_grad():
            s = model(tr_all.rows(rows_of(val_rows))).view(n_val, n)
        vals = [spearman(s[i], y_all[r]) for i, r in enumerate(val_rows)]
        vals = [v for v in vals if np.isfinite(v)]
        return float(np.mean(vals)) if vals else float("nan")

    best, best_state = -np.inf, None
    model.train()
    for step in range(steps):
        pick = ordered[torch.randint(0, len(ordered), (min(keys_per_step, len(ordered)),), generator=gen).numpy()]
        scores = model(tr_all.rows(rows_of(pick))).view(len(pick), n)
        loss = pairwise_loss(scores, y_all[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if n_val and ((step + 1) % val_every == 0 or step + 1 == steps):
            model.eval()
            v = val_score()
            model.train()
            if np.isfinite(v) and v > best:
                best, best_state = v, {k: t.detach().clone() for k, t in model.state_dict().items()}
            if log is not None:
                log(f"sibling ranker: step {step + 1}/{steps} loss {float(loss.detach()):.4f} validation spearman {v:.3f}")
    if best_state is not None:
        model.load_state_dict(best_state)
    return model.eval()


@torch.no_grad()
def rank_scores(model: SiblingRanker, sets, real: bool = False) -> np.ndarray:
    """``[G, N]`` ranker scores of every candidate of ``sets``."""
    g, n = sets.score.shape
    return model(trajectories(sets, real=real)).view(g, n).numpy()
