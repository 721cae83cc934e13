"""An action-conditioned latent world model: (short frame history, proprio, action chunk) -> next frame + proprio.

Architecture (small enough to train on one CPU core in minutes, the interfaces scale up):

- **encoder**: 64x64 RGB -> a spatial latent ``z`` of ``latent_channels`` x 8 x 8 (three stride-2 convolutions);
- **decoder**: ``z`` -> 64x64 RGB (three transposed convolutions), so the unchanged VLA acts on imagined frames;
- **dynamics**: a convolutional trunk over ``[z_t, z_{t-1}]`` (the history), FiLM-conditioned on the action
  chunk (K x 4, flattened) and the proprio, with an **ensemble** of ``ensemble`` output heads predicting the latent
  change ``Δz`` and the proprio change. The heads share the trunk (the cheap equivalent of a full ensemble) and are
  trained on different bootstrap weights of each batch, so their disagreement grows where data is thin; the mean
  head is the prediction and the disagreement is the per-step uncertainty that truncates hallucinated rollouts
  (the ensemble-disagreement idea of MBPO/Plan2Explore, as the world-model RL papers WMPO and WoVR use uncertainty
  to keep imagined rollouts short).

One model step = one action chunk (K env steps): frames are observed only at chunk boundaries, exactly where the
simulator renders (``envs.vector.step_chunk``). Everything is deterministic (no dropout, no sampling), so a latent
copied out and back in (``WorldModelEnv.get_states``/``set_states``) continues identically.

Training loss (``WorldModel.loss``): pixel reconstruction of every frame, plus for ``rollout_steps`` open-loop
model steps from a real start: per-head latent error against the (stop-gradient) encoding of the real next frame,
weighted by per-head bootstrap weights; pixel error of the decoded mean prediction; proprio error.
Saved as ``world_model.safetensors`` + ``world_model.json`` (``save`` / ``load``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from shared_rl.errors import ConfigError


@dataclass
class WorldModelConfig:
    """Shapes and sizes of the world model (saved with its weights)."""

    image_size: int = field(default=64, metadata={"help": "frame side in pixels (must be 64: three stride-2 stages to 8x8)"})
    image_channels: int = field(default=3, metadata={"help": "frame channels (3 per camera)"})
    proprio_dim: int = field(default=4, metadata={"help": "proprio size (hand xyz + gripper)"})
    action_dim: int = field(default=4, metadata={"help": "env action size"})
    chunk: int = field(default=4, metadata={"help": "actions per model step (= the VLA's chunk)"})
    latent_channels: int = field(default=16, metadata={"help": "channels of the 8x8 latent"})
    width: int = field(default=48, metadata={"help": "channels of the encoder/decoder/dynamics convolutions"})
    ensemble: int = field(default=3, metadata={"help": "dynamics heads (disagreement = uncertainty); >= 2"})
    uncertainty_ref: float = field(default=1.0, metadata={
        "help": "the 95th percentile of the disagreement on held-out real transitions (set by training)"})
    proprio_scale: float = field(default=0.1, metadata={"help": "proprio changes are predicted in units of this"})

    def check(self, where: str = "world_model.model") -> None:
        if self.image_size != 64:
            raise ConfigError(f"{where}.image_size must be 64 (the encoder has three stride-2 stages to 8x8)")
        if self.ensemble < 2:
            raise ConfigError(f"{where}.ensemble must be >= 2 (the disagreement of the heads is the uncertainty)")
        if min(self.latent_channels, self.width, self.chunk, self.action_dim, self.proprio_dim) < 1:
            raise ConfigError(f"{where}: latent_channels, width, chunk, action_dim and proprio_dim must be >= 1")

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.latent_channels, self.image_size // 8, self.image_size // 8)


class _FiLMBlock(nn.Module):
    def __init__(self, width: int, cond: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.film = nn.Linear(cond, 2 * width)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        scale, shift = self.film(c)[:, :, None, None].chunk(2, dim=1)
        h = F.silu(self.conv1(x)) * (1 + scale) + shift
        return x + self.conv2(F.silu(h))


@dataclass
class Prediction:
    """One model step for a batch: mean latent/proprio, every head's latent, the per-row disagreement."""

    z: torch.Tensor  # [B, C, 8, 8] mean over heads
    proprio: torch.Tensor  # [B, P]
    z_heads: torch.Tensor  # [E, B, C, 8, 8]
    proprio_heads: torch.Tensor  # [E, B, P]
    uncertainty: torch.Tensor  # [B] mean over latent dims of the across-head variance


class WorldModel(nn.Module):
    def __init__(self, cfg: WorldModelConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        w, lc, ch = cfg.width, cfg.latent_channels, cfg.image_channels
        self.enc = nn.Sequential(
            nn.Conv2d(ch, w // 2, 4, 2, 1), nn.SiLU(), nn.Conv2d(w // 2, w, 4, 2, 1), nn.SiLU(),
            nn.Conv2d(w, w, 4, 2, 1), nn.SiLU(), nn.Conv2d(w, lc, 3, padding=1),
        )
        self.dec = nn.Sequential(
            nn.Conv2d(lc, w, 3, padding=1), nn.SiLU(), nn.ConvTranspose2d(w, w, 4, 2, 1), nn.SiLU(),
            nn.ConvTranspose2d(w, w // 2, 4, 2, 1), nn.SiLU(), nn.ConvTranspose2d(w // 2, ch, 4, 2, 1),
        )
        cond = cfg.chunk * cfg.action_dim + cfg.proprio_dim
        self.cond = nn.Sequential(nn.Linear(cond, 64), nn.SiLU(), nn.Linear(64, 64))
        self.inp = nn.Conv2d(2 * lc, w, 3, padding=1)
        self.blocks = nn.ModuleList([_FiLMBlock(w, 64) for _ in range(2)])
        self.z_heads = nn.Conv2d(w, cfg.ensemble * lc, 3, padding=1)
        self.p_heads = nn.Linear(w + 64, cfg.ensemble * cfg.proprio_dim)

    # -- frames <-> latents
    @staticmethod
    def to_float(images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, C] -> float [B, C, H, W] in [0, 1]."""
        return images.permute(0, 3, 1, 2).float() / 255.0

    @staticmethod
    def to_uint8(x: torch.Tensor) -> torch.Tensor:
        return (x.clamp(0, 1) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 frames [B, H, W, C] -> latents [B, C_z, 8, 8]."""
        return self.enc(self.to_float(images))

    def decode_float(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.dec(z))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """latents -> uint8 frames [B, H, W, C]."""
        return self.to_uint8(self.decode_float(z))

    # -- dynamics
    def step(self, z: torch.Tensor, z_prev: torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor) -> Prediction:
        """One action chunk ``actions [B, K, A]`` from latent ``z`` (history ``z_prev``) and ``proprio``."""
        cfg = self.cfg
        b = z.shape[0]
        c = self.cond(torch.cat([actions.reshape(b, -1), proprio], -1))
        h = F.silu(self.inp(torch.cat([z, z - z_prev], 1)))
        for blk in self.blocks:
            h = blk(h, c)
        dz = self.z_heads(F.silu(h)).view(b, cfg.ensemble, cfg.latent_channels, *z.shape[2:]).transpose(0, 1)
        z_heads = z[None] + dz
        pooled = torch.cat([h.mean((2, 3)), c], -1)
        dp = self.p_heads(pooled).view(b, cfg.ensemble, cfg.proprio_dim).transpose(0, 1) * cfg.proprio_scale
        p_heads = proprio[None] + dp
        unc = z_heads.var(0, unbiased=False).flatten(1).mean(1)
        return Prediction(z=z_heads.mean(0), proprio=p_heads.mean(0), z_heads=z_heads, proprio_heads=p_heads,
                          uncertainty=unc)

    # -- training
    def loss(self, frames: torch.Tensor, proprio: torch.Tensor, actions: torch.Tensor, valid: torch.Tensor,
             generator: torch.Generator | None = None, bootstrap: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
        """Windows of ``L+1`` chunk-boundary frames ``[B, L+1, H, W, C]`` (uint8), proprio ``[B, L+1, P]``, the
        ``L`` chunks between them ``[B, L, K, A]`` and ``valid [B, L]`` (the chunk was executed in full). Frame 0
        is the history frame; model steps run open loop from frame 1."""
        b, l1 = frames.shape[:2]
        x = self.to_float(frames.flatten(0, 1))
        z_all = self.enc(x)
        recon = F.mse_loss(self.decode_float(z_all), x)
        z_all = z_all.view(b, l1, *z_all.shape[1:])
        target = z_all.detach()
        e = self.cfg.ensemble
        w = (torch.rand(e, b, generator=generator) < bootstrap).float().to(frames.device)
        z, z_prev, p = z_all[:, 1], z_all[:, 0], proprio[:, 1]
        lat = pix = pro = torch.zeros((), device=frames.device)
        steps = l1 - 2
        live = torch.ones(b, dtype=torch.bool, device=frames.device)
        for j in range(steps):
            live = live & valid[:, j + 1]
            if not live.any():
                break
            m = live.float()
            pred = self.step(z, z_prev, p, actions[:, j + 1])
            err = (pred.z_heads - target[None, :, j + 2]).pow(2).flatten(2).mean(2)  # [E, B]
            lat = lat + (err * w * m).sum() / (w * m).sum().clamp(min=1)
            perr = (pred.proprio_heads - proprio[None, :, j + 2]).pow(2).mean(2) / self.cfg.proprio_scale ** 2
            pro = pro + (perr * m).sum() / (m.sum() * e)
            img = self.decode_float(pred.z)
            pix = pix + ((img - x.view(b, l1, *x.shape[1:])[:, j + 2]).pow(2).flatten(1).mean(1) * m).sum() / m.sum()
            z_prev, z, p = z, pred.z, pred.proprio
        steps = max(1, steps)
        total = recon + (lat + pix + 0.1 * pro) / steps
        d = lambda t: float(t.detach())  # noqa: E731
        return total, {"loss": d(total), "recon": d(recon), "latent": d(lat) / steps, "pixel": d(pix) / steps,
                       "proprio": d(pro) / steps}

    # -- files
    def save(self, out_dir: str | Path) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(out / "world_model.safetensors"))
        (out / "world_model.json").write_text(json.dumps(asdict(self.cfg), indent=1))

    @classmethod
    def load(cls, path: str | Path, map_location: str | torch.device = "cpu") -> "WorldModel":
        from safetensors.torch import load_file

        p = Path(path)
        if not (p / "world_model.json").is_file():
            raise FileNotFoundError(f"no world model in {p} (world_model.json missing)")
        model = cls(WorldModelConfig(**json.loads((p / "world_model.json").read_text())))
        model.load_state_dict(load_file(str(p / "world_model.safetensors"), device=str(map_location)))
        return model.eval()
