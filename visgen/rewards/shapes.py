"""The analytic GenEval-like reward of the embedded shapes task (see ``visgen.tasks.shapes``).

Outputs ``shapes`` (fraction of the prompt's attributes that hold, in [0,1]) and ``shapes_strict`` (1.0 when all
hold, else 0.0). The prompt's spec comes from ``metadata[i]`` (``PromptSpec.to_dict()``, or a dict holding it
under ``"spec"``) when given, else it is parsed from the prompt text; a prompt outside the task grammar is an
error. An image containing NaN scores NaN in both outputs.

Computed by the batched checker (``visgen.rewards.shapes_batched``) on the images' device, whose components are
found once per images tensor and shared with ``shapes_soft`` on the same images; ``reference=True`` scores with
the per-image numpy checker instead (``visgen.tasks.shapes.score_batch``, the test oracle: the same values).
"""
from __future__ import annotations

from typing import Sequence

import torch

from visgen.tasks import shapes as task

from . import shapes_batched
from .base import RewardInfo, RewardInputError, check_batch, register


_SPECS: dict = {}  # spec dict, as a hashable key -> PromptSpec (the grammar is finite; bounded anyway)


def _from_dict(data: dict) -> task.PromptSpec:
    """``PromptSpec.from_dict`` memoised on the dict's contents (its validation costs ~10 us per prompt, 5 ms per
    512-image reward call, more than a batched analysis step)."""
    try:
        key = (data["kind"], tuple(tuple(o.items()) for o in data["objects"]))
        spec = _SPECS.get(key)
    except (KeyError, TypeError, AttributeError):  # malformed or unhashable: from_dict raises its own error
        return task.PromptSpec.from_dict(data)
    if spec is None:
        spec = task.PromptSpec.from_dict(data)
        if len(_SPECS) >= 4096:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


def _spec(prompt: str, meta: dict | None) -> task.PromptSpec:
    if meta:
        data = meta.get("spec", meta)
        if "objects" in data:
            return _from_dict(data)
    try:
        return task.parse_prompt(prompt)
    except ValueError as exc:
        raise RewardInputError(f"shapes reward: {exc}; pass PromptSpec.to_dict() as metadata") from exc


def specs_of(prompts: Sequence[str], metadata: Sequence[dict] | None) -> list[task.PromptSpec]:
    metas = metadata if metadata is not None else [None] * len(prompts)
    return [_spec(p, m) for p, m in zip(prompts, metas)]


class ShapesReward:
    def __init__(self, reference: bool = False) -> None:
        self.reference = bool(reference)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        check_batch(images, prompts, metadata)
        specs = specs_of(prompts, metadata)
        if self.reference:
            score, strict = task.score_batch(images.detach().float().cpu().numpy(), specs)
            return {"shapes": torch.from_numpy(score), "shapes_strict": torch.from_numpy(strict)}
        score, strict = shapes_batched.score(shapes_batched.analyse(images), specs)
        return {"shapes": score.cpu(), "shapes_strict": strict.cpu()}


@register("shapes", RewardInfo(range="[0, 1] score (fraction of attributes right); strict 0/1",
                              summary="the shapes task's analytic checker: attribute fraction + all-correct flag"))
def build_shapes(reference: bool = False) -> ShapesReward:
    return ShapesReward(reference)
