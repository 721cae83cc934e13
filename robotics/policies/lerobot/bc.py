"""Behaviour cloning of a LeRobot policy on grove's demonstrations (the same episodes the tiny VLA clones), with
LeRobot's own training loss (``policy.forward``: flow matching on the normalised, padded chunk) and the same
observation mapping RL uses (:meth:`LeRobotVLA.observation` -> LeRobot's preprocessor)."""
from __future__ import annotations

import numpy as np
import torch

from .adapter import ACTION, LeRobotVLA


class DemoChunks:
    """Every step of every episode: its observation and the next ``chunk_size`` actions (zero "stay" actions after
    the episode's end, as grove's tiny-VLA BC pads)."""

    def __init__(self, episodes, chunk_size: int):
        self.images = np.concatenate([e.images for e in episodes])
        self.proprio = np.concatenate([e.proprio for e in episodes]).astype(np.float32)
        chunks, texts = [], []
        for e in episodes:
            padded = np.concatenate([e.actions, np.zeros((chunk_size - 1, e.actions.shape[1]), e.actions.dtype)])
            chunks.append(np.stack([padded[t: t + chunk_size] for t in range(len(e))]))
            texts += [e.instruction] * len(e)
        self.chunks = np.concatenate(chunks).astype(np.float32)
        self.texts = texts

    def __len__(self) -> int:
        return len(self.chunks)

    def batch(self, vla: LeRobotVLA, idx: np.ndarray) -> dict:
        """A preprocessed LeRobot training batch (observation, task, normalised action chunk) of rows ``idx``."""
        raw = vla.observation(torch.from_numpy(self.images[idx]), torch.from_numpy(self.proprio[idx]),
                              [self.texts[i] for i in idx])
        raw[ACTION] = torch.from_numpy(self.chunks[idx])
        return vla.preprocess(raw)


def behaviour_clone(vla: LeRobotVLA, episodes, steps: int, batch_size: int = 32, lr: float = 3e-4, seed: int = 0,
                    log=print, log_every: int = 100) -> list[float]:
    """``steps`` AdamW steps of LeRobot's loss on the demos; trains what requires grad. Returns the losses."""
    data = DemoChunks(episodes, vla.cfg.chunk_size)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)  # LeRobot draws the flow-matching noise and time from torch's global generator
    params = [p for p in vla.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    vla.train()
    losses = []
    for step in range(steps):
        loss, _ = vla.policy.forward(data.batch(vla, rng.integers(0, len(data), batch_size)))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            log(f"lerobot bc: step {step + 1}/{steps} loss {np.mean(losses[-log_every:]):.4f}")
    vla.eval()
    return losses
