"""Success models for imagined episodes: a learned classifier, and VLA-RFT's reference-frame similarity.

- ``SuccessModel`` (the default): a small MLP on the world model's latent of a boundary frame plus the proprio,
  giving P(the chunk that led here succeeded). Trained on real episodes only (``fit_success_model``): every
  boundary after a chunk is labelled by the simulator's success flag of that chunk; positives are rare (with
  "success once" an episode ends at its first success), so the loss weighs them by the class ratio. Each real
  transition is also fed as the world model's *one-step prediction* of that frame, with the same label, so the
  classifier sees the kind of latent imagination produces (not only encoder outputs).
- ``ReferenceSimilarity`` — VLA-RFT (Li et al. 2025, "VLA-RFT: Vision-Language-Action Reinforcement Fine-tuning
  with Verified Rewards in World Simulators") rewards imagined trajectories by their similarity to a
  demonstration's frames from the same start. Here: ``exp(-||z - z_ref||² / (tau · dim))`` between the imagined
  latent and the latent of a scripted-expert demonstration's final (successful) frame from the same restored
  simulator state (``keyframes.reference_latents``); "success" = similarity above ``threshold``.

``precision_recall`` is the audit's yardstick: predictions against the simulator's flags.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .data import ChunkEpisode
from .model import WorldModel


@dataclass
class SuccessModelConfig:
    """Sizes of the success classifier (saved with its weights)."""

    latent_dim: int = field(default=1024, metadata={"help": "flattened world-model latent size"})
    proprio_dim: int = field(default=4, metadata={"help": "proprio size"})
    hidden: int = field(default=128, metadata={"help": "MLP width"})
    threshold: float = field(default=0.5, metadata={"help": "P(success) above which an imagined chunk succeeds"})


class SuccessModel(nn.Module):
    def __init__(self, cfg: SuccessModelConfig):
        super().__init__()
        self.cfg = cfg
        self.net = nn.Sequential(nn.Linear(cfg.latent_dim + cfg.proprio_dim, cfg.hidden), nn.SiLU(),
                                 nn.Linear(cfg.hidden, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, 1))
        # input standardisation, set from the first training data (saved with the weights)
        self.register_buffer("x_mean", torch.zeros(cfg.latent_dim + cfg.proprio_dim))
        self.register_buffer("x_std", torch.ones(cfg.latent_dim + cfg.proprio_dim))

    def logits(self, z: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        x = torch.cat([z.flatten(1), proprio], -1)
        return self.net((x - self.x_mean) / self.x_std).squeeze(-1)

    def prob(self, z: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(z, proprio))

    def save(self, out_dir: str | Path) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(out / "success_model.safetensors"))
        (out / "success_model.json").write_text(json.dumps(asdict(self.cfg), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "SuccessModel":
        from safetensors.torch import load_file

        p = Path(path)
        if not (p / "success_model.json").is_file():
            raise FileNotFoundError(f"no success model in {p} (success_model.json missing)")
        m = cls(SuccessModelConfig(**json.loads((p / "success_model.json").read_text())))
        m.load_state_dict(load_file(str(p / "success_model.safetensors")))
        return m.eval()


def labelled_boundaries(episodes: list[ChunkEpisode]):
    """(frames after chunk c, frames before it, the one before that, proprio after/before, actions, label) arrays."""
    after, before, before2, p_after, p_before, acts, labels = [], [], [], [], [], [], []
    for ep in episodes:
        for c in range(ep.num_chunks):
            after.append(ep.frames[c + 1]), before.append(ep.frames[c]), before2.append(ep.frames[max(c - 1, 0)])
            p_after.append(ep.proprio[c + 1]), p_before.append(ep.proprio[c])
            acts.append(ep.actions[c]), labels.append(bool(ep.success[c]))
    if not labels:
        return None
    st = lambda xs: torch.from_numpy(np.stack(xs))  # noqa: E731
    return st(after), st(before), st(before2), st(p_after), st(p_before), st(acts), torch.tensor(labels)


@torch.no_grad()
def _latents(wm: WorldModel, frames: torch.Tensor, batch: int = 256) -> torch.Tensor:
    return torch.cat([wm.encode(frames[i:i + batch]) for i in range(0, len(frames), batch)])


@torch.no_grad()
def boundary_features(wm: WorldModel, episodes: list[ChunkEpisode], with_predicted: bool = True):
    """Latents (encoded, and one-step predicted) of every boundary after a chunk, with proprio and labels."""
    lab = labelled_boundaries(episodes)
    if lab is None:
        return None
    after, before, before2, p_after, p_before, acts, y = lab
    z = _latents(wm, after)
    feats, pros, ys = [z], [p_after], [y]
    if with_predicted:
        zb, zb2 = _latents(wm, before), _latents(wm, before2)
        preds = [wm.step(zb[i:i + 256], zb2[i:i + 256], p_before[i:i + 256], acts[i:i + 256]) for i in range(0, len(zb), 256)]
        feats.append(torch.cat([p.z for p in preds]))
        pros.append(torch.cat([p.proprio for p in preds]))
        ys.append(y)
    return torch.cat(feats), torch.cat(pros), torch.cat(ys)


def fit_success_model(wm: WorldModel, episodes: list[ChunkEpisode], steps: int = 300, lr: float = 1e-3,
                      batch: int = 128, seed: int = 0, model: SuccessModel | None = None,
                      log=None, with_predicted: bool = True) -> SuccessModel:
    """Train (or keep training) the success classifier on real episodes (see the module docstring);
    ``with_predicted`` adds the world model's one-step predictions of the same boundaries."""
    data = boundary_features(wm, episodes, with_predicted)
    if data is None:
        from shared_rl.errors import ConfigError

        raise ConfigError("the success model needs at least one real chunk to train on")
    z, p, y = data
    if model is None:
        model = SuccessModel(SuccessModelConfig(latent_dim=z[0].numel(), proprio_dim=p.shape[1]))
        x = torch.cat([z.flatten(1), p], -1)
        model.x_mean.copy_(x.mean(0))
        model.x_std.copy_(x.std(0) + 1e-3)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    pos = float(y.float().mean())
    pos_weight = torch.tensor((1 - pos) / max(pos, 1e-3)).clamp(1.0, 50.0)
    model.train()
    with torch.enable_grad():  # refits run inside the trainer's no-grad rollout
        _fit_loop(model, z, p, y, steps, batch, g, opt, pos, pos_weight, log)
    return model.eval()


def _fit_loop(model, z, p, y, steps, batch, g, opt, pos, pos_weight, log) -> None:
    for s in range(steps):
        idx = torch.randint(0, len(y), (min(batch, len(y)),), generator=g)
        loss = F.binary_cross_entropy_with_logits(model.logits(z[idx], p[idx]), y[idx].float(), pos_weight=pos_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None and (s + 1) % max(1, steps // 4) == 0:
            log(f"success model: step {s + 1}/{steps} loss {float(loss.detach()):.4f} (positives {pos:.3f})")


@torch.no_grad()
def calibrate_threshold(wm: WorldModel, model: SuccessModel, episodes: list[ChunkEpisode], beta: float = 0.5) -> float:
    """Set ``model.cfg.threshold`` to the P(success) cut with the best F-beta on held-out real boundaries (encoded
    and one-step predicted latents); beta < 1 weighs precision more: a false imagined success is what RL exploits."""
    data = boundary_features(wm, episodes, with_predicted=True)
    if data is None or not bool(data[2].any()):
        return model.cfg.threshold
    z, p, y = data
    prob = model.prob(z, p).numpy()
    truth = y.numpy().astype(bool)
    best, best_t = -1.0, model.cfg.threshold
    for t in np.linspace(0.05, 0.95, 19):
        pred = prob > t
        tp = float((pred & truth).sum())
        prec = tp / max(1.0, float(pred.sum()))
        rec = tp / max(1.0, float(truth.sum()))
        f = (1 + beta ** 2) * prec * rec / max(1e-9, beta ** 2 * prec + rec)
        if f > best:
            best, best_t = f, float(t)
    model.cfg.threshold = best_t
    return best_t


def precision_recall(pred: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """Precision / recall / accuracy of boolean predictions against the simulator's flags (NaN when undefined)."""
    pred, truth = np.asarray(pred, bool), np.asarray(truth, bool)
    tp = float((pred & truth).sum())
    prec = tp / pred.sum() if pred.sum() else float("nan")
    rec = tp / truth.sum() if truth.sum() else float("nan")
    return {"precision": prec, "recall": rec, "accuracy": float((pred == truth).mean()) if len(pred) else float("nan"),
            "predicted_positive": float(pred.sum()), "true_positive_count": float(truth.sum())}


@torch.no_grad()
def evaluate_success_model(wm: WorldModel, model: SuccessModel, episodes: list[ChunkEpisode]) -> dict[str, float]:
    """Precision/recall on real held-out boundaries (encoded latents only)."""
    data = boundary_features(wm, episodes, with_predicted=False)
    if data is None:
        return {}
    z, p, y = data
    pred = (model.prob(z, p) > model.cfg.threshold).numpy()
    return precision_recall(pred, y.numpy())


class ReferenceSimilarity:
    """VLA-RFT's alternative reward: similarity of an imagined latent to a reference demonstration's final latent."""

    def __init__(self, references: dict[int, torch.Tensor], tau: float = 0.05, threshold: float = 0.5):
        self.references, self.tau, self.threshold = references, tau, threshold

    def prob(self, z: torch.Tensor, keys: list[int]) -> torch.Tensor:
        ref = torch.stack([self.references[k] for k in keys]).to(z)
        d = (z - ref).pow(2).flatten(1).mean(1)
        return torch.exp(-d / self.tau)
