"""The embedded "shapes" text-to-image task: procedural prompts, ground-truth renders and an analytic checker.

A GenEval-like task small enough to pretrain and RL-finetune a text-to-image model on a laptop CPU. Prompts
name colours, shapes, counts and positions ("two blue squares", "a red circle on the left and a green
triangle on the right"); each prompt carries a :class:`PromptSpec` (its metadata). The checker scores an image
from its pixels alone, in the spirit of GenEval (Ghosh et al., "GenEval: An Object-Focused Framework for
Evaluating Text-to-Image Alignment", 2023) but with colour masks and connected components instead of a
detector: each requested attribute (colour present, count, shape, position, no stray objects) is checked, the
score is the fraction that hold and ``strict`` is 1 only when all do.

Everything is deterministic: :func:`all_prompts` enumerates the prompt space in a fixed order and
:func:`split_prompts` makes a seeded, disjoint train/eval split (eval prompts are held out of pretraining, so
they measure compositional generalisation).

Checker constants (frozen; see ``docs/tasks/shapes.md`` for how they were chosen on blurred/noisy renders):
pixels count as an object when HSV value >= ``FG_VALUE`` and saturation >= ``FG_SATURATION``; their hue picks
the nearest named colour within ``HUE_TOLERANCE`` degrees; components smaller than ``MIN_AREA`` pixels are
noise. Shape comes from rotation-invariant angular moments of the component's soft mask (see
:func:`angular_moments`): a triangle when the 3-fold moment is >= ``TRIANGLE_MIN_THREEFOLD``, else a square when
the 4-fold moment is >= ``SQUARE_MIN_FOURFOLD``, else a circle.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .base import ImageTask, register_task

IMAGE_SIZE = 32

# Colours: RGB used by the renderer and the hue (degrees) the checker expects. Far apart on the hue circle so a
# blurred, slightly off-colour generation is still classified unambiguously.
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "yellow": (1.0, 1.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
}
COLOR_HUES: dict[str, float] = {"red": 0.0, "yellow": 60.0, "green": 120.0, "blue": 240.0}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Pairs of positions a two-object prompt may use; the first is named first in the prompt.
POSITION_PAIRS: tuple[tuple[str, str], ...] = (("left", "right"), ("top", "bottom"))
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom")
NUMBER_WORDS = {1: "a", 2: "two"}

# Frozen checker thresholds (documented in docs/tasks/shapes.md).
FG_VALUE = 0.35
FG_SATURATION = 0.35
HUE_TOLERANCE = 30.0
MIN_AREA = 6
TRIANGLE_MIN_THREEFOLD = 0.22
SQUARE_MIN_FOURFOLD = 0.18


# ----------------------------------------------------------------------------------------------------------------
# Prompt specs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectSpec:
    """One requested group of identical objects: ``count`` x ``color`` ``shape`` at ``position`` (None = anywhere)."""

    color: str
    shape: str
    count: int = 1
    position: str | None = None

    def __post_init__(self) -> None:
        if self.color not in COLORS:
            raise ValueError(f"unknown colour {self.color!r}; expected one of {sorted(COLORS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; expected one of {list(SHAPES)}")
        if self.count not in NUMBER_WORDS:
            raise ValueError(f"count must be one of {sorted(NUMBER_WORDS)}, got {self.count}")
        if self.position is not None and self.position not in POSITIONS:
            raise ValueError(f"unknown position {self.position!r}; expected one of {list(POSITIONS)} or None")


@dataclass(frozen=True)
class PromptSpec:
    """The metadata of one prompt: its kind ("single", "count" or "pair") and the requested objects."""

    kind: str
    objects: tuple[ObjectSpec, ...]

    @property
    def prompt(self) -> str:
        return render_prompt_text(self)

    def attributes(self) -> list[str]:
        """Names of the attributes the checker scores for this prompt, in a fixed order."""
        names = []
        for i, obj in enumerate(self.objects):
            names += [f"obj{i}/color", f"obj{i}/count", f"obj{i}/shape"]
            if obj.position is not None:
                names.append(f"obj{i}/position")
        names.append("no_extra")
        return names

    def to_dict(self) -> dict:
        return {"kind": self.kind, "prompt": self.prompt, "objects": [asdict(o) for o in self.objects]}

    @classmethod
    def from_dict(cls, data: dict) -> "PromptSpec":
        try:
            return cls(kind=data["kind"], objects=tuple(ObjectSpec(**o) for o in data["objects"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a shapes PromptSpec dict (need 'kind' and 'objects'): {data!r}") from exc


def _object_phrase(obj: ObjectSpec) -> str:
    noun = obj.shape + ("s" if obj.count > 1 else "")
    phrase = f"{NUMBER_WORDS[obj.count]} {obj.color} {noun}"
    if obj.position in ("left", "right"):
        phrase += f" on the {obj.position}"
    elif obj.position in ("top", "bottom"):
        phrase += f" at the {obj.position}"
    return phrase


def render_prompt_text(spec: PromptSpec) -> str:
    return " and ".join(_object_phrase(o) for o in spec.objects)


_PHRASE = re.compile(
    r"^(a|two) (" + "|".join(COLORS) + r") (" + "|".join(SHAPES) + r")(s?)"
    r"(?: (?:on the (left|right)|at the (top|bottom)))?$"
)


def parse_prompt(prompt: str) -> PromptSpec:
    """Inverse of :func:`render_prompt_text` for this task's grammar; raises ValueError on anything else."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    objects = []
    for phrase in text.split(" and "):
        m = _PHRASE.match(phrase)
        if m is None:
            raise ValueError(f"not a shapes-task prompt: {prompt!r} (cannot parse {phrase!r})")
        number, color, shape, plural, lr, tb = m.groups()
        count = 2 if number == "two" else 1
        if (count > 1) != bool(plural):
            raise ValueError(f"number/plural mismatch in shapes-task prompt {prompt!r}")
        objects.append(ObjectSpec(color, shape, count, lr or tb))
    if len(objects) == 1:
        kind = "count" if objects[0].count > 1 else "single"
    elif len(objects) == 2:
        kind = "pair"
    else:
        raise ValueError(f"shapes-task prompts have one or two object phrases: {prompt!r}")
    return PromptSpec(kind, tuple(objects))


def all_prompts() -> list[PromptSpec]:
    """Every prompt of the task in a fixed order.

    single: a colour+shape, centred or at one of four positions (4 x 3 x 5 = 60);
    count: two identical objects, "two red circles" (4 x 3 = 12);
    pair: two objects of different colours at opposite positions (2 axes x 4 x 3 x 3 x 3 = 216).
    """
    specs: list[PromptSpec] = []
    for color, shape in itertools.product(COLORS, SHAPES):
        for position in (None,) + POSITIONS:
            specs.append(PromptSpec("single", (ObjectSpec(color, shape, 1, position),)))
    for color, shape in itertools.product(COLORS, SHAPES):
        specs.append(PromptSpec("count", (ObjectSpec(color, shape, 2, None),)))
    for (pos_a, pos_b), color_a, shape_a, color_b, shape_b in itertools.product(
        POSITION_PAIRS, COLORS, SHAPES, COLORS, SHAPES
    ):
        if color_a == color_b:
            continue
        specs.append(
            PromptSpec("pair", (ObjectSpec(color_a, shape_a, 1, pos_a), ObjectSpec(color_b, shape_b, 1, pos_b)))
        )
    return specs


def split_prompts(seed: int = 0, eval_fraction: float = 0.2) -> tuple[list[PromptSpec], list[PromptSpec]]:
    """Deterministic, disjoint (train, eval) split, stratified by prompt kind.

    Within each kind the prompts are shuffled by a ``numpy`` generator seeded with ``seed`` and the first
    ``round(eval_fraction * n)`` go to eval. Eval prompts are held out of pretraining, so every eval pair is an
    unseen combination of seen words.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    rng = np.random.default_rng(seed)
    train: list[PromptSpec] = []
    held_out: list[PromptSpec] = []
    specs = all_prompts()
    for kind in ("single", "count", "pair"):
        group = [s for s in specs if s.kind == kind]
        order = rng.permutation(len(group))
        n_eval = int(round(eval_fraction * len(group)))
        held_out += [group[i] for i in sorted(order[:n_eval])]
        train += [group[i] for i in sorted(order[n_eval:])]
    return train, held_out


def vocabulary() -> list[str]:
    """Every word a task prompt can contain (for the word-level tokenizer)."""
    words = set(NUMBER_WORDS.values()) | set(COLORS) | {"and", "on", "at", "the"} | set(POSITIONS)
    words |= set(SHAPES) | {s + "s" for s in SHAPES}
    return sorted(words)


# ----------------------------------------------------------------------------------------------------------------
# Ground-truth renderer
# ----------------------------------------------------------------------------------------------------------------

_SUPERSAMPLE = 4
# Object centres (x, y) in pixels of a 32 x 32 image, before jitter.
_ANCHORS = {None: (16.0, 16.0), "left": (8.0, 16.0), "right": (24.0, 16.0), "top": (16.0, 8.0), "bottom": (16.0, 24.0)}


def _shape_mask(shape: str, cx: float, cy: float, radius: float, size: int) -> np.ndarray:
    """Anti-aliased coverage in [0,1] of one shape on a ``size`` x ``size`` canvas (4x4 supersampling)."""
    n = size * _SUPERSAMPLE
    coords = (np.arange(n) + 0.5) / _SUPERSAMPLE
    x, y = np.meshgrid(coords, coords)
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= radius**2
    elif shape == "square":
        half = radius * 0.88  # about the circle's area, so size alone does not give the shape away
        inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    elif shape == "triangle":
        # Upright isosceles triangle in the box [cx-r, cx+r] x [cy-r, cy+r]: apex at the top, base at the bottom.
        top, bottom = cy - radius, cy + radius
        frac = (y - top) / (2 * radius)  # 0 at the apex, 1 at the base
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= frac * radius)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3))


def _layout(spec: PromptSpec, rng: np.random.Generator) -> list[tuple[str, str, float, float]]:
    """(color, shape, cx, cy) of every object to draw for ``spec``."""
    placed = []
    for obj in spec.objects:
        if obj.count == 1:
            anchors = [_ANCHORS[obj.position]]
        else:  # two identical objects side by side or stacked
            pair = POSITION_PAIRS[int(rng.integers(len(POSITION_PAIRS)))]
            anchors = [_ANCHORS[p] for p in pair]
        for ax, ay in anchors:
            placed.append((obj.color, obj.shape, ax, ay))
    return placed


def render(spec: PromptSpec, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """A ground-truth image for ``spec``: float32 ``[3, 32, 32]`` in [0,1], black background.

    Sizes (radius 4.5-6 px), centres (+-1.5 px) and brightness (0.8-1.0) are jittered by ``rng`` so the
    generator learns a distribution, not a single image per prompt.
    """
    rng = np.random.default_rng(rng)
    size = IMAGE_SIZE
    image = np.zeros((3, size, size), dtype=np.float32)
    for color, shape, ax, ay in _layout(spec, rng):
        radius = rng.uniform(4.5, 6.0)
        cx = ax + rng.uniform(-1.5, 1.5)
        cy = ay + rng.uniform(-1.5, 1.5)
        coverage = _shape_mask(shape, cx, cy, radius, size)
        rgb = np.asarray(COLORS[color], dtype=np.float32) * rng.uniform(0.8, 1.0)
        # Paint over (objects never overlap in these layouts; max keeps anti-aliased edges clean if they touch).
        image = np.maximum(image, coverage[None] * rgb[:, None, None])
    return image.astype(np.float32)


def render_batch(specs: Sequence[PromptSpec], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([render(s, rng) for s in specs])


# ----------------------------------------------------------------------------------------------------------------
# Analytic checker
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Component:
    color: str
    area: int  # pixels in the colour mask
    cx: float  # centroid, pixels from the left edge
    cy: float  # centroid, pixels from the top edge
    threefold: float  # |3rd angular moment|: high for triangles
    fourfold: float  # |4th angular moment|: high for squares
    shape: str = field(default="")


def classify_shape(threefold: float, fourfold: float) -> str:
    if threefold >= TRIANGLE_MIN_THREEFOLD:
        return "triangle"
    return "square" if fourfold >= SQUARE_MIN_FOURFOLD else "circle"


def angular_moments(weights: np.ndarray) -> tuple[float, float]:
    """Rotation-invariant angular Fourier moments of a soft mask: (|m3|, |m4|) with
    m_k = sum w r^k exp(i k theta) / sum w r^k about the weighted centroid.

    A disc has m_k ~ 0 for every k; a square has a strong 4-fold term (~0.4, from its corners); a triangle a
    strong 3-fold one (~0.6). Using every pixel's soft weight makes both robust to blur and to the +-0.5 px
    discretisation that breaks bounding-box fill ratios on 10-pixel objects.
    """
    ys, xs = np.nonzero(weights > 0)
    w = weights[ys, xs]
    if w.sum() <= 0:
        return 0.0, 0.0
    dx = xs - (w * xs).sum() / w.sum()
    dy = ys - (w * ys).sum() / w.sum()
    r = np.hypot(dx, dy)
    theta = np.arctan2(dy, dx)
    moments = []
    for k in (3, 4):
        norm = (w * r**k).sum()
        moments.append(float(abs((w * r**k * np.exp(1j * k * theta)).sum()) / norm) if norm > 0 else 0.0)
    return moments[0], moments[1]


def _hue_value_saturation(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r, g, b = image[0], image[1], image[2]
    value = image.max(axis=0)
    chroma = value - image.min(axis=0)
    saturation = np.where(value > 1e-6, chroma / np.maximum(value, 1e-6), 0.0)
    safe = np.maximum(chroma, 1e-6)
    hue = np.where(
        value == r, ((g - b) / safe) % 6.0, np.where(value == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0)
    )
    return hue * 60.0, value, saturation


def color_masks(image: np.ndarray) -> dict[str, np.ndarray]:
    """Boolean mask per named colour: bright, saturated pixels whose hue is within HUE_TOLERANCE of that colour."""
    hue, value, saturation = _hue_value_saturation(image)
    foreground = (value >= FG_VALUE) & (saturation >= FG_SATURATION)
    names = list(COLOR_HUES)
    centres = np.array([COLOR_HUES[n] for n in names])
    distance = np.abs(((hue[None] - centres[:, None, None]) + 180.0) % 360.0 - 180.0)
    nearest = distance.argmin(axis=0)
    close = distance.min(axis=0) <= HUE_TOLERANCE
    return {n: foreground & close & (nearest == i) for i, n in enumerate(names)}


def find_components(image: np.ndarray) -> list[Component]:
    """Connected components (8-connectivity) of every colour mask, with the shape features the checker uses.

    Shape features are computed on a soft mask: the pixel value relative to the component's bright level
    (90th percentile), ramped from 0 at 25% to 1 at 75% of it (a soft 50% level set), over the component
    grown by two pixels, so blurred edges count the way they would on the sharp shape.
    """
    from scipy import ndimage  # here, not at the top: the config check reads this task without the checker (issue 64)

    found = []
    structure = np.ones((3, 3), dtype=bool)
    value = image.max(axis=0)
    masks = color_masks(image)
    any_object = np.logical_or.reduce(list(masks.values()))
    for color, mask in masks.items():
        labels, n = ndimage.label(mask, structure=structure)
        for index in range(1, n + 1):
            comp = labels == index
            area = int(comp.sum())
            if area < MIN_AREA:
                continue
            ys, xs = np.nonzero(comp)
            region = ndimage.binary_dilation(comp, structure=structure, iterations=2) & ~(any_object & ~comp)
            peak = float(np.quantile(value[comp], 0.9))
            soft = np.clip((value * region / max(peak, 1e-6) - 0.25) / 0.5, 0.0, 1.0)
            threefold, fourfold = angular_moments(soft)
            comp_info = Component(color, area, xs.mean() + 0.5, ys.mean() + 0.5, threefold, fourfold)
            comp_info.shape = classify_shape(threefold, fourfold)
            found.append(comp_info)
    return found


def _in_position(comp: Component, position: str, size: int) -> bool:
    half = size / 2.0
    return {
        "left": comp.cx < half,
        "right": comp.cx > half,
        "top": comp.cy < half,
        "bottom": comp.cy > half,
    }[position]


def check_image(image: np.ndarray, spec: PromptSpec) -> dict[str, bool]:
    """Which attributes of ``spec`` hold in ``image`` (float ``[3,H,W]`` in [0,1]); keys = ``spec.attributes()``.

    Per requested object group (colour c, shape s, count n, position p):
    color: some component of colour c; count: exactly n components of colour c; shape: the n largest components
    of colour c are all of shape s (false when none); position: the largest component of colour c has its
    centroid in the named image half. Globally, no_extra: no component of a colour the prompt does not name.
    """
    comps = find_components(image)
    size = image.shape[-1]
    result: dict[str, bool] = {}
    for i, obj in enumerate(spec.objects):
        mine = sorted((c for c in comps if c.color == obj.color), key=lambda c: -c.area)
        result[f"obj{i}/color"] = len(mine) > 0
        result[f"obj{i}/count"] = len(mine) == obj.count
        result[f"obj{i}/shape"] = len(mine) > 0 and all(c.shape == obj.shape for c in mine[: obj.count])
        if obj.position is not None:
            result[f"obj{i}/position"] = len(mine) > 0 and _in_position(mine[0], obj.position, size)
    named = {o.color for o in spec.objects}
    result["no_extra"] = not any(c.color not in named for c in comps)
    return result


def score_image(image: np.ndarray, spec: PromptSpec) -> tuple[float, bool]:
    """(fraction of attributes correct in [0,1], all-correct flag)."""
    checks = check_image(image, spec)
    return sum(checks.values()) / len(checks), all(checks.values())


def score_batch(images: np.ndarray, specs: Iterable[PromptSpec]) -> tuple[np.ndarray, np.ndarray]:
    """Scores and strict flags for a batch ``[B,3,H,W]``; an image containing NaN scores NaN (never a silent 0)."""
    scores, stricts = [], []
    for image, spec in zip(images, specs):
        if not np.isfinite(image).all():
            scores.append(np.nan)
            stricts.append(np.nan)
            continue
        score, strict = score_image(image, spec)
        scores.append(score)
        stricts.append(float(strict))
    return np.asarray(scores, dtype=np.float32), np.asarray(stricts, dtype=np.float32)


# ----------------------------------------------------------------------------------------------------------------
# The registered task (visgen.tasks.base)
# ----------------------------------------------------------------------------------------------------------------

@register_task
class ShapesTask(ImageTask):
    """RL prompts from the seeded split, measured by the ``shapes`` reward; pretrains the tiny SD3 (32x32)."""

    name = "shapes"
    eval_reward = ("shapes", {})

    def split_prompts(self, seed: int, eval_fraction: float) -> tuple[list, list]:
        return split_prompts(seed, eval_fraction)

    def render(self, spec, rng, conf) -> np.ndarray:
        return render(spec, rng)

    def build_pipeline(self, conf):
        from visgen import tiny

        return tiny.build_pipeline(vocabulary(), seed=conf.seed)

    def score(self, samples, specs: list) -> dict[str, float]:
        """Mean attribute score, strict accuracy, and strict accuracy per prompt kind."""
        score, strict = score_batch(samples.numpy(), specs)
        out = {"score": float(np.nanmean(score)), "strict": float(np.nanmean(strict))}
        for kind in ("single", "count", "pair"):
            mask = np.array([s.kind == kind for s in specs])
            if mask.any():
                out[f"strict_{kind}"] = float(np.nanmean(strict[mask]))
        return out
