"""A dense training reward for the shapes task: the shapes score with each shape check replaced by a soft margin.

The analytic checker (``visgen.tasks.shapes``) classifies a component's shape by thresholding two rotation-invariant
moments (3-fold >= ``TRIANGLE_MIN_THREEFOLD`` -> triangle; else 4-fold >= ``SQUARE_MIN_FOURFOLD`` -> square; else
circle). As a reward that is a step function: a blob just on the wrong side of a threshold scores the same as a
hopeless one, so group-relative advantages carry little information about *how* to draw the shape. Measured on the
tiny SD3 asset: Flow-GRPO on the 0/1 shape checks did not move held-out strict accuracy in 120 updates, while a
continuous roundness reward moved the moments steadily within 30 (docs/methods/flow_grpo.md).

``shapes_soft`` keeps every other attribute exactly as the checker scores it (colour, count, position, no stray
objects) and scores each shape check by ``sigmoid(margin / temperature)``, where ``margin`` is the signed distance of
the moments into the requested class's region (positive = classified correctly):

- triangle: ``m3 - T3``
- square: ``min(T3 - m3, m4 - T4)``
- circle: ``min(T3 - m3, T4 - m4)``

averaged over the requested object's ``count`` largest components of its colour (0 when it has none). The reward is
the mean over attributes, like the checker's score; ``shapes_soft_strict`` is not emitted (train on this, evaluate
with ``shapes``). Output name: ``shapes_soft``. NaN images score NaN.

Computed by the batched checker (``visgen.rewards.shapes_batched``) on the images' device, sharing its components
with ``shapes`` on the same images; ``reference=True`` scores image by image with :func:`soft_score` below (numpy,
the test oracle: the same values).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from visgen.tasks import shapes as task

from . import shapes_batched
from .base import RewardInfo, check_batch, register
from .shapes import _spec, specs_of


def shape_margin(shape: str, threefold: float, fourfold: float) -> float:
    """Signed distance of (m3, m4) into ``shape``'s region of the checker's decision rule (> 0: correct)."""
    t3, t4 = task.TRIANGLE_MIN_THREEFOLD, task.SQUARE_MIN_FOURFOLD
    if shape == "triangle":
        return threefold - t3
    if shape == "square":
        return min(t3 - threefold, fourfold - t4)
    return min(t3 - threefold, t4 - fourfold)


def soft_score(image: np.ndarray, spec: task.PromptSpec, temperature: float) -> float:
    checks = task.check_image(image, spec)
    comps = task.find_components(image)
    values = []
    for i, obj in enumerate(spec.objects):
        mine = sorted((c for c in comps if c.color == obj.color), key=lambda c: -c.area)[: obj.count]
        soft = [1.0 / (1.0 + math.exp(-shape_margin(obj.shape, c.threefold, c.fourfold) / temperature)) for c in mine]
        checks[f"obj{i}/shape"] = float(np.mean(soft)) if soft else 0.0
    values = [float(v) for v in checks.values()]
    return sum(values) / len(values)


class ShapesSoftReward:
    def __init__(self, temperature: float = 0.05, reference: bool = False) -> None:
        if temperature <= 0:
            raise ValueError(f"shapes_soft temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.reference = bool(reference)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        if not self.reference:
            analysis = shapes_batched.analyse(images)
            return {"shapes_soft": shapes_batched.soft_score(analysis, specs_of(prompts, metadata),
                                                             self.temperature).cpu()}
        metas = metadata if metadata is not None else [None] * len(prompts)
        arrays = images.detach().float().cpu().numpy()
        out = []
        for image, prompt, meta in zip(arrays, prompts, metas):
            out.append(soft_score(image, _spec(prompt, meta), self.temperature) if np.isfinite(image).all() else np.nan)
        return {"shapes_soft": torch.tensor(out, dtype=torch.float32)}


@register("shapes_soft", RewardInfo(range="[0, 1]", summary="the shapes score with a smooth shape margin (a "
                                                                   "dense training reward)"))
def build_shapes_soft(temperature: float = 0.05, reference: bool = False) -> ShapesSoftReward:
    return ShapesSoftReward(temperature, reference)
