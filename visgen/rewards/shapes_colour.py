"""A differentiable surrogate of the shapes task's reward: soft colour mass of each requested object in its region.

The analytic checker (``shapes``) and its soft variant (``shapes_soft``) find connected components and threshold
hues: piecewise constant in the pixels, so they have no gradient. DiffusionOPSD moves its targets along the
reward's gradient through the VAE decode, so its shapes demo trains on this smooth stand-in, which keeps the
checker's colour, count and position terms (not the shape term) as functions of the pixels:

- per pixel and requested colour c: ``g_c = exp(−‖rgb − c‖² / (2 τ²))`` (τ = ``width``, 0.3);
- per requested object: its region's soft mask (the whole image, or a half for left/right/top/bottom, with a
  sigmoid edge of ``edge`` pixels), the colour mass ``m = mean over the region of g_c`` and the object's term
  ``tanh(m / (count · area))`` (``area`` 0.12: about one drawn shape's share of a half image, radius 5 of 32 px);
- a stray term: the mean of ``max_c g_c`` over the colours the prompt does not name.

Score = mean of the object terms − the stray term, in [−1, 1]. Output name ``shapes_colour``; NaN images score NaN.
``differentiable(images, prompts, metadata)`` is the same value with the graph to ``images`` kept.
"""
from __future__ import annotations

from typing import Sequence

import torch

from visgen.tasks import shapes as task

from .base import RewardInfo, check_batch, finite_rows, register
from .shapes import specs_of


class ShapesColourReward:
    def __init__(self, width: float = 0.3, area: float = 0.12, edge: float = 1.5) -> None:
        if width <= 0 or area <= 0 or edge <= 0:
            raise ValueError(f"shapes_colour width, area and edge must be > 0, got {width}, {area}, {edge}")
        self.width, self.area, self.edge = float(width), float(area), float(edge)

    def _regions(self, h: int, w: int, device) -> dict:
        ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5 - h / 2)[:, None].expand(h, w)
        xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5 - w / 2)[None, :].expand(h, w)
        e = self.edge
        return {None: torch.ones(h, w, device=device), "left": torch.sigmoid(-xs / e), "right": torch.sigmoid(xs / e),
                "top": torch.sigmoid(-ys / e), "bottom": torch.sigmoid(ys / e)}

    def differentiable(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None
                       ) -> dict[str, torch.Tensor]:
        check_batch(images, prompts, metadata)
        specs = specs_of(prompts, metadata)
        x = images.float()
        names = list(task.COLORS)
        palette = torch.tensor([task.COLORS[c] for c in names], device=x.device, dtype=torch.float32)  # [C, 3]
        dist2 = ((x[:, None] - palette[None, :, :, None, None]) ** 2).sum(2)  # [B, C, H, W]
        g = torch.exp(-dist2 / (2 * self.width**2))
        regions = self._regions(x.shape[-2], x.shape[-1], x.device)
        out = []
        for i, spec in enumerate(specs):
            terms = []
            for obj in spec.objects:
                r = regions[obj.position]
                mass = (g[i, names.index(obj.color)] * r).sum() / r.sum()
                terms.append(torch.tanh(mass / (obj.count * self.area)))
            other = [k for k, c in enumerate(names) if c not in {o.color for o in spec.objects}]
            stray = g[i, other].amax(0).mean() if other else g.new_zeros(())
            out.append(torch.stack(terms).mean() - stray)
        return {"shapes_colour": torch.stack(out) if out else x.new_zeros(0)}

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        ok = finite_rows(images)
        score = torch.full((images.shape[0],), float("nan"))
        idx = torch.nonzero(ok).flatten()
        if idx.numel():
            with torch.no_grad():
                sub = self.differentiable(images[idx.to(images.device)], [prompts[i] for i in idx.tolist()],
                                          None if metadata is None else [metadata[i] for i in idx.tolist()])
            score[idx] = sub["shapes_colour"].float().cpu()
        return {"shapes_colour": score}


@register("shapes_colour", RewardInfo(range="[-1, 1]", differentiable=True,
                                      summary="a differentiable shapes surrogate: soft colour mass per requested "
                                              "object in its region minus stray colours (DiffusionOPSD's demo)"))
def build_shapes_colour(width: float = 0.3, area: float = 0.12, edge: float = 1.5) -> ShapesColourReward:
    return ShapesColourReward(width, area, edge)
