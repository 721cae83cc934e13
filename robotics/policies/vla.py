"""A tiny vision-language-action policy: 64x64 image(s) + instruction + proprio -> action chunk.

Encoder: a 4-layer stride-2 CNN over the image (channels stacked per camera), a bag-of-words embedding of the
instruction (a fixed vocabulary saved with the model), and an MLP over normalised proprioception, fused into one
feature vector. Heads:

- ``flow``: a flow-matching action head over the flattened chunk (K actions x 4 dims), as pi0 / SmolVLA
  (Black et al. 2024, "π0: A Vision-Language-Action Flow Model"); see ``flow_head.py`` for its log-probs.
- ``discrete``: 256 bins per action dimension (OpenVLA, Kim et al. 2024), all chunk dims predicted in parallel
  from the feature (as OpenVLA-OFT's parallel decoding); the chunk's log-prob is the sum over dims.

The model is saved as ``model.safetensors`` + ``config.json`` (``save_pretrained`` / ``load_pretrained``).
"""
from __future__ import annotations

import copy

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from .flow_head import FlowActionHead
# the architecture settings and vocabulary helpers import no torch (grove config show); re-exported here
from .vla_config import VLAConfig, default_vocab, libero_vocab, tokenize, vocab_with  # noqa: F401


class BagOfWords(nn.Module):
    def __init__(self, vocab: list[str], dim: int):
        super().__init__()
        self.index = {w: i for i, w in enumerate(vocab)}
        self.embed = nn.EmbeddingBag(len(vocab), dim, mode="mean")

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        return [[self.index.get(w, 0) for w in tokenize(t)] or [0] for t in texts]

    def encode_ids(self, ids: list[list[int]], device) -> torch.Tensor:
        flat = torch.tensor([i for row in ids for i in row], dtype=torch.long, device=device)
        offsets = torch.tensor([0] + [len(r) for r in ids[:-1]], dtype=torch.long, device=device).cumsum(0)
        return self.embed(flat, offsets)


class TaskAdapters(nn.Module):
    """One low-rank residual per task on the fused features: h' = h + (h·A_t)·B_t for a row of task t (LoRA, Hu et
    al. 2022, applied per task as the multi-head baselines of Meta-World, Yu et al. 2019). B starts at 0, so adding
    adapters leaves the policy bitwise unchanged; a row whose task has no adapter (t = −1) passes through. With the
    shared weights frozen, an update from one task's episodes cannot move another task's actions."""

    def __init__(self, num_tasks: int, dim: int, rank: int, generator: torch.Generator | None = None):
        super().__init__()
        self.down = nn.Parameter(torch.randn(num_tasks, dim, rank, generator=generator) / math.sqrt(dim))
        self.up = nn.Parameter(torch.zeros(num_tasks, rank, dim))

    def forward(self, h: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        has = task >= 0
        if not bool(has.any()):
            return h
        t = task.clamp(min=0)
        delta = torch.bmm(torch.bmm(h[:, None, :], self.down[t]), self.up[t])[:, 0]
        return h + torch.where(has[:, None], delta, torch.zeros_like(delta))


class TinyVLA(nn.Module):
    def __init__(self, cfg: VLAConfig):
        super().__init__()
        self.cfg = cfg
        chans = [cfg.image_channels] + list(cfg.cnn_channels)
        layers: list[nn.Module] = []
        for cin, cout in zip(chans[:-1], chans[1:]):
            layers += [nn.Conv2d(cin, cout, 4, stride=2, padding=1), nn.GELU()]
        self.cnn = nn.Sequential(*layers)
        spatial = cfg.image_size // 16
        self.image_proj = nn.Linear(chans[-1] * spatial * spatial, cfg.feature_dim)
        self.text = BagOfWords(cfg.vocab, cfg.text_dim)
        self.proprio = nn.Sequential(nn.Linear(cfg.proprio_dim, 64), nn.GELU())
        self.fuse = nn.Sequential(
            nn.Linear(cfg.feature_dim + cfg.text_dim + 64, cfg.hidden), nn.GELU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.GELU(),
        )
        d = cfg.chunk * cfg.action_dim
        if cfg.head == "flow":
            self.flow = FlowActionHead(cfg.hidden, d, cfg.hidden, cfg.num_denoise_steps, std_min=cfg.std_min,
                                       std_max=cfg.std_max, std_init=cfg.std_init)
        else:
            self.bins = nn.Linear(cfg.hidden, d * cfg.num_bins)
        mean = torch.tensor(cfg.proprio_mean or [0.0] * cfg.proprio_dim, dtype=torch.float32)
        std = torch.tensor(cfg.proprio_std or [1.0] * cfg.proprio_dim, dtype=torch.float32)
        self.register_buffer("proprio_mean", mean, persistent=False)
        self.register_buffer("proprio_std", std, persistent=False)
        self.adapters: TaskAdapters | None = None
        if cfg.task_adapters:
            self.adapters = TaskAdapters(len(cfg.task_adapters), cfg.hidden, cfg.adapter_rank)
        self._index_adapters()

    def _index_adapters(self) -> None:
        # instruction token ids -> adapter row: encode() receives token ids, so the task is looked up by them
        self._adapter_of = {tuple(ids): i for i, ids in enumerate(self.text.token_ids(self.cfg.task_adapters))}

    def add_task_adapters(self, instructions: list[str], rank: int, generator: torch.Generator | None = None) -> None:
        """Give each instruction its own zero-initialised adapter (the policy's outputs do not change)."""
        if self.adapters is not None:
            if list(instructions) != self.cfg.task_adapters or rank != self.cfg.adapter_rank:
                raise ValueError(f"the policy already has task adapters for {self.cfg.task_adapters} "
                                 f"(rank {self.cfg.adapter_rank}); asked for {list(instructions)} (rank {rank})")
            return
        self.cfg.task_adapters, self.cfg.adapter_rank = list(instructions), rank
        self.cfg.check()
        device = self.proprio_mean.device
        self.adapters = TaskAdapters(len(instructions), self.cfg.hidden, rank, generator).to(device)
        self._index_adapters()

    # ------------------------------------------------------------------------------------------------------
    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """The image encoder's vector ``[B, feature_dim]`` (uint8 ``[B, H, W, C]`` or float [B, C, H, W] in [-0.5, 0.5])."""
        if images.dtype == torch.uint8:
            images = images.permute(0, 3, 1, 2).float() / 255.0 - 0.5
        return F.gelu(self.image_proj(self.cnn(images).flatten(1)))

    def kl_reference(self) -> "TinyVLA":
        """The starting policy a KL term compares with: a frozen deep copy (the tiny VLA is a few MB)."""
        return copy.deepcopy(self).eval().requires_grad_(False)

    def encode(self, images: torch.Tensor, proprio: torch.Tensor, text_ids: list[list[int]]) -> torch.Tensor:
        """images uint8 ``[B, H, W, C]`` (or float [B, C, H, W] already in [-0.5, 0.5]); returns ``[B, hidden]``."""
        return self.fuse_features(self.image_features(images), proprio, text_ids)

    def fuse_features(self, img: torch.Tensor, proprio: torch.Tensor, text_ids: list[list[int]]) -> torch.Tensor:
        """The fused features ``[B, hidden]`` from the image features (``image_features``), proprio and instruction."""
        txt = self.text.encode_ids(text_ids, img.device)
        pro = self.proprio((proprio.float() - self.proprio_mean) / self.proprio_std)
        h = self.fuse(torch.cat([img, txt, pro], dim=-1))
        if self.adapters is not None:
            task = torch.tensor([self._adapter_of.get(tuple(ids), -1) for ids in text_ids], device=h.device)
            h = self.adapters(h, task)
        return h

    # -- discrete head (OpenVLA-style bins)
    def bin_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.bins(h).view(h.shape[0], -1, self.cfg.num_bins).float()

    def bin_centers(self, device=None) -> torch.Tensor:
        n = self.cfg.num_bins
        return -1.0 + (torch.arange(n, dtype=torch.float32, device=device) + 0.5) * (2.0 / n)

    def actions_to_bins(self, actions: torch.Tensor) -> torch.Tensor:
        n = self.cfg.num_bins
        return ((actions.clamp(-1, 1) + 1.0) * (n / 2.0)).floor().clamp(0, n - 1).long()

    # -- training losses
    def bc_loss(self, h: torch.Tensor, chunk: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """chunk: ``[B, K, A]`` expert actions in [-1, 1]."""
        x0 = chunk.reshape(chunk.shape[0], -1).clamp(-1, 1)
        if self.cfg.head == "flow":
            return self.flow.bc_loss(h, x0, generator)
        logits = self.bin_logits(h)
        return F.cross_entropy(logits.reshape(-1, self.cfg.num_bins), self.actions_to_bins(x0).reshape(-1))

    @torch.no_grad()
    def act(self, h: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Evaluation action chunk ``[B, K, A]``: ODE from noise drawn with ``generator`` (flow), arg-max bins."""
        if self.cfg.head == "flow":
            x = self.flow.sample(h, "ode", generator).actions
        else:
            x = self.bin_centers(h.device)[self.bin_logits(h).argmax(-1)]
        return x.view(h.shape[0], self.cfg.chunk, self.cfg.action_dim).clamp(-1, 1)

    # -- persistence
    def save_pretrained(self, out_dir: str | Path) -> None:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(asdict(self.cfg), indent=1))

    @classmethod
    def load_pretrained(cls, path: str | Path, map_location: str | torch.device = "cpu") -> "TinyVLA":
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"{path} is not a tiny-VLA checkpoint (needs config.json and model.safetensors)")
        cfg = VLAConfig(**json.loads((path / "config.json").read_text()))
        model = cls(cfg)
        model.load_state_dict(load_file(str(path / "model.safetensors"), device=str(map_location)))
        return model
