"""A tiny stand-in for a VideoAlign-style video reward model, loaded from a local directory (tests only).

It has the shape of KwaiVGI/VideoAlign's ``VideoVLMRewardInference``: built from a checkpoint path, ``reward(videos,
prompts, **kwargs)`` returns one dict per clip with ``VQ`` (visual quality), ``MQ`` (motion quality), ``TA`` (text
alignment) and ``Overall``. Here the "model" is one linear layer saved as safetensors: VQ = mean brightness,
MQ = mean absolute frame difference, TA = the layer applied to the prompt's length, Overall their weighted sum.
Inputs are uint8 frame arrays ``[F, H, W, 3]`` or MP4 paths.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def save_checkpoint(directory: str | Path) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"weight": torch.tensor([[0.5, 2.0, 0.01]])}, str(directory / "head.safetensors"))
    return directory


class TinyVideoReward:
    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32") -> None:
        from safetensors.torch import load_file

        self.head = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(load_file(str(Path(path) / "head.safetensors"))["weight"])
        self.head.to(device)
        self.device = torch.device(device)
        self.calls = 0

    def _frames(self, video) -> np.ndarray:
        if isinstance(video, str):
            import imageio.v3 as iio

            return iio.imread(video, plugin="pyav")
        return np.asarray(video)

    def reward(self, videos, prompts, use_norm: bool = True):
        self.calls += 1
        out = []
        for video, prompt in zip(videos, prompts):
            frames = self._frames(video).astype(np.float32) / 255.0
            vq = float(frames.mean())
            mq = float(np.abs(np.diff(frames, axis=0)).mean()) if len(frames) > 1 else 0.0
            ta = float(len(prompt.split()))
            feats = torch.tensor([[vq, mq, ta]], device=self.device)
            overall = float(self.head(feats))
            out.append({"VQ": vq, "MQ": mq, "TA": ta, "Overall": overall if use_norm else overall * 10})
        return out
