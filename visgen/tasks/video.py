"""The embedded "moving shapes" text-to-video task: procedural clips, an analytic reward from pixels, a tiny Wan.

A text-to-video task small enough to pretrain and RL-finetune a video flow model on a laptop CPU. A prompt names a
colour, a shape and a direction ("a red circle moving to the right"); the ground-truth clip is a black 32x32 canvas
on which one object of that colour glides in a straight line at constant speed. The reward reads only the pixels
of a generated clip (like GenEval for images, Ghosh et al. 2023, but for motion), per frame:

- **colour**: the object of the prompted colour is visible (a soft area term: ``min(1, area / FULL_AREA)``);
- **no extra**: no stray object of another named colour (fewer than ``EXTRA_AREA`` pixels, or a quarter of the
  object's area, within ``EXTRA_HUE_TOLERANCE`` of another colour's hue: blurred rims between two hues do not count);
- **direction**: the centroid of the prompted colour travels along the prompted direction, ``clip(d / D_min, 0,
  1)`` with ``d`` the displacement from the first to the last frame where the object is visible, projected on the
  direction, and ``D_min`` half the renderer's slowest travel (a clip moving the wrong way scores 0);
- **smoothness**: constant velocity, ``exp(-jerk / JERK_SCALE)`` with ``jerk`` the mean norm of the second
  differences of the centroid track (frame-to-frame flicker, jumps and stops raise it), 0 with under 3 visible
  frames.

``score`` is the mean of the four terms, ``strict`` is 1 when the object is visible in every frame, nothing else is,
it moved at least ``D_min`` the right way and ``jerk < JERK_SCALE``. The shape word is part of the prompt (the model
must still render a blob of the right colour and motion) but is not scored: at 32x32 with a 4x4x3 latent, circle vs
square is below what the analytic checker can tell apart on blurred generations.

The model: :func:`build_tiny_wan` — a stock ``WanPipeline`` (Wan 2.1 architecture, Wan Team, "Wan: Open and Advanced
Large-Scale Video Generative Models", 2025) built offline from ``WanTransformer3DModel``, ``AutoencoderKLWan`` and a
tiny ``UMT5EncoderModel`` with a locally built word-level tokenizer. 9 frames at 32x32 are latents ``[16, 3, 4, 4]``
(the causal VAE compresses time 4x after the first frame and space 8x). ``visgen.pretrain`` trains it (``task: video_shapes``);
``assets/video-wan-tiny`` is the result.

Everything is deterministic: :func:`all_prompts` enumerates the prompts in a fixed order, :func:`split_prompts`
holds out a seeded, stratified eval set (every held-out prompt is an unseen combination of seen words).
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from shared_rl.config import ConfigError

from .base import EmbeddedTask, PretrainConfig, register_task

FRAMES = 9
SIZE = 32
FPS = 8
# named colours: RGB of the renderer and the hue (degrees) the checker expects
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "yellow": (1.0, 1.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
}
COLOR_HUES: dict[str, float] = {"red": 0.0, "yellow": 60.0, "green": 120.0, "blue": 240.0}
SHAPES: tuple[str, ...] = ("circle", "square")
# direction word -> unit vector (x right, y down, in pixels)
DIRECTIONS: dict[str, tuple[float, float]] = {"right": (1.0, 0.0), "left": (-1.0, 0.0), "up": (0.0, -1.0),
                                              "down": (0.0, 1.0)}
DIRECTION_PHRASES = {"right": "to the right", "left": "to the left", "up": "up", "down": "down"}

# renderer ranges (pixels, pixels per frame)
RADIUS = (5.0, 6.0)
SPEED = (1.2, 1.6)
MARGIN = 6.5
# frozen checker constants
FG_VALUE = 0.35
FG_SATURATION = 0.4
HUE_TOLERANCE = 30.0
MIN_AREA = 6  # pixels of the prompted colour for the object to count as visible in a frame
FULL_AREA = 30.0  # the colour term saturates here (a rendered object covers ~80-110 pixels)
EXTRA_AREA = 6  # pixels of another named colour that make a frame "not clean" (or a quarter of the object's area)
EXTRA_HUE_TOLERANCE = 15.0  # a stray pixel must be this close to another colour's hue (blurred edges between two
# named hues, e.g. the orange rim of a yellow blob, are not a second object)
D_MIN = 0.5 * SPEED[0] * (FRAMES - 1)  # 4.8 px: half the slowest travel
JERK_SCALE = 3.0  # px/frame^2


# ------------------------------------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class ClipSpec:
    """What a prompt asks for: one ``color`` ``shape`` moving in ``direction``."""

    color: str
    shape: str
    direction: str

    def __post_init__(self) -> None:
        if self.color not in COLORS:
            raise ValueError(f"unknown colour {self.color!r}; expected one of {sorted(COLORS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; expected one of {list(SHAPES)}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {self.direction!r}; expected one of {list(DIRECTIONS)}")

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} moving {DIRECTION_PHRASES[self.direction]}"

    def to_dict(self) -> dict:
        return {"task": "video_shapes", "prompt": self.prompt, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "ClipSpec":
        try:
            return cls(data["color"], data["shape"], data["direction"])
        except KeyError as exc:
            raise ValueError(f"not a video_shapes ClipSpec dict (need color, shape, direction): {data!r}") from exc


_PROMPT = re.compile(r"^a (" + "|".join(COLORS) + r") (" + "|".join(SHAPES) + r") "
                     r"moving (to the right|to the left|up|down)$")


def parse_prompt(prompt: str) -> ClipSpec:
    """Inverse of :attr:`ClipSpec.prompt`; raises ValueError for anything outside the grammar."""
    text = " ".join(prompt.lower().strip().rstrip(".").split())
    m = _PROMPT.match(text)
    if m is None:
        raise ValueError(f"not a video_shapes prompt: {prompt!r} (expected 'a <colour> <shape> moving <direction>')")
    direction = {v: k for k, v in DIRECTION_PHRASES.items()}[m.group(3)]
    return ClipSpec(m.group(1), m.group(2), direction)


def all_prompts() -> list[ClipSpec]:
    """Every prompt (4 colours x 2 shapes x 4 directions = 32) in a fixed order."""
    return [ClipSpec(c, s, d) for c, s, d in itertools.product(COLORS, SHAPES, DIRECTIONS)]


def split_prompts(seed: int = 0, eval_per_direction: int = 2) -> tuple[list[ClipSpec], list[ClipSpec]]:
    """Deterministic disjoint (train, eval) split: per direction, ``eval_per_direction`` (colour, shape) pairs are
    held out (seeded), so every eval prompt combines words the model saw, never that combination."""
    rng = np.random.default_rng(seed)
    train, held_out = [], []
    for direction in DIRECTIONS:
        group = [s for s in all_prompts() if s.direction == direction]
        chosen = set(rng.permutation(len(group))[:eval_per_direction].tolist())
        held_out += [s for i, s in enumerate(group) if i in chosen]
        train += [s for i, s in enumerate(group) if i not in chosen]
    return train, held_out


def vocabulary() -> list[str]:
    words = {"a", "moving", "to", "the"} | set(COLORS) | set(SHAPES) | {"right", "left", "up", "down"}
    return sorted(words)


def write_prompt_files(directory: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """``video_shapes_train.jsonl`` / ``video_shapes_eval.jsonl`` (prompt + ClipSpec metadata) for ``task: file``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    train, held_out = split_prompts(seed)
    paths = []
    for name, specs in (("train", train), ("eval", held_out)):
        path = directory / f"video_shapes_{name}.jsonl"
        path.write_text("".join(json.dumps(s.to_dict(), sort_keys=True) + "\n" for s in specs))
        paths.append(path)
    return paths[0], paths[1]


# ------------------------------------------------------------------------------------------------------ renderer
_SUPERSAMPLE = 4


def _coverage(shape: str, cx: float, cy: float, radius: float, size: int) -> np.ndarray:
    n = size * _SUPERSAMPLE
    coords = (np.arange(n) + 0.5) / _SUPERSAMPLE
    x, y = np.meshgrid(coords, coords)
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= radius ** 2
    else:
        half = radius * 0.88  # about the circle's area
        inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
    return inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3))


def trajectory(spec: ClipSpec, rng: np.random.Generator, frames: int = FRAMES, size: int = SIZE
               ) -> tuple[np.ndarray, float]:
    """Object centres ``[frames, 2]`` (x, y) of a clip for ``spec`` and the radius: constant speed along the
    direction, start and perpendicular offset jittered so the object stays inside the canvas."""
    radius = float(rng.uniform(*RADIUS))
    speed = float(rng.uniform(*SPEED)) * size / SIZE
    travel = speed * (frames - 1)
    margin = MARGIN * size / SIZE
    ux, uy = DIRECTIONS[spec.direction]
    low, high = margin, size - margin
    start_along = float(rng.uniform(low, max(low, high - travel)))
    across = float(rng.uniform(size * 0.25, size * 0.75))
    t = np.arange(frames, dtype=np.float64)
    along = start_along + speed * t
    if ux + uy < 0:  # left / up: run the same track backwards
        along = size - along
    xs = along if ux != 0 else np.full(frames, across)
    ys = along if uy != 0 else np.full(frames, across)
    return np.stack([xs, ys], 1), radius


def render_clip(spec: ClipSpec, rng: np.random.Generator | int | None = None, frames: int = FRAMES,
                size: int = SIZE) -> np.ndarray:
    """A ground-truth clip for ``spec``: float32 ``[frames, 3, size, size]`` in [0, 1], black background."""
    rng = np.random.default_rng(rng)
    centres, radius = trajectory(spec, rng, frames, size)
    rgb = np.asarray(COLORS[spec.color], dtype=np.float32) * float(rng.uniform(0.8, 1.0))
    clip = np.zeros((frames, 3, size, size), dtype=np.float32)
    for f, (cx, cy) in enumerate(centres):
        clip[f] = _coverage(spec.shape, cx, cy, radius * size / SIZE, size)[None] * rgb[:, None, None]
    return clip


# ------------------------------------------------------------------------------------------------------- checker
def _hsv(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hue (degrees), value, saturation of ``[F, 3, H, W]`` RGB in [0, 1]."""
    r, g, b = frames[:, 0], frames[:, 1], frames[:, 2]
    value = frames.max(axis=1)
    chroma = value - frames.min(axis=1)
    saturation = np.where(value > 1e-6, chroma / np.maximum(value, 1e-6), 0.0)
    safe = np.maximum(chroma, 1e-6)
    hue = np.where(value == r, ((g - b) / safe) % 6.0, np.where(value == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    return hue * 60.0, value, saturation


def color_masks(frames: np.ndarray, tolerance: float = HUE_TOLERANCE) -> dict[str, np.ndarray]:
    """Per named colour, ``[F, H, W]`` bool: bright, saturated pixels whose hue is nearest that colour (within
    ``tolerance`` degrees)."""
    hue, value, saturation = _hsv(frames)
    fg = (value >= FG_VALUE) & (saturation >= FG_SATURATION)
    names = list(COLOR_HUES)
    centres = np.array([COLOR_HUES[n] for n in names])
    dist = np.abs(((hue[None] - centres[:, None, None, None]) + 180.0) % 360.0 - 180.0)
    nearest = dist.argmin(axis=0)
    close = dist.min(axis=0) <= tolerance
    return {n: fg & close & (nearest == i) for i, n in enumerate(names)}


@dataclass
class ClipAnalysis:
    area: np.ndarray  # [F] pixels of the prompted colour
    extra: np.ndarray  # [F] pixels of the other named colours
    centroid: np.ndarray  # [F, 2] value-weighted centroid of the prompted colour (NaN where not visible)
    color: float
    no_extra: float
    displacement: float  # along the prompted direction, first to last visible frame (px)
    jerk: float  # mean |second difference| of the visible track (px/frame^2); inf with < 3 visible frames
    direction: float
    smooth: float

    @property
    def score(self) -> float:
        return float(np.mean([self.color, self.no_extra, self.direction, self.smooth]))

    @property
    def strict(self) -> bool:
        return bool((self.area >= MIN_AREA).all() and (self.extra < np.maximum(EXTRA_AREA, 0.25 * self.area)).all()
                    and self.displacement >= D_MIN and self.jerk < JERK_SCALE)


def analyze_clip(clip: np.ndarray, spec: ClipSpec) -> ClipAnalysis:
    """Score one clip ``[F, 3, H, W]`` in [0, 1] against ``spec`` (see the module docstring)."""
    clip = np.asarray(clip, dtype=np.float32)
    masks = color_masks(clip)
    mine = masks[spec.color]
    others = np.zeros_like(mine)
    for name, m in color_masks(clip, EXTRA_HUE_TOLERANCE).items():
        if name != spec.color:
            others |= m
    value = clip.max(axis=1)
    frames, height, width = mine.shape
    ys, xs = np.mgrid[0:height, 0:width]
    area = mine.reshape(frames, -1).sum(1).astype(np.float64)
    extra = others.reshape(frames, -1).sum(1).astype(np.float64)
    weight = value * mine
    total = weight.reshape(frames, -1).sum(1)
    visible = area >= MIN_AREA
    centroid = np.full((frames, 2), np.nan)
    ok = visible & (total > 0)
    centroid[ok, 0] = (weight * (xs + 0.5)).reshape(frames, -1).sum(1)[ok] / total[ok]
    centroid[ok, 1] = (weight * (ys + 0.5)).reshape(frames, -1).sum(1)[ok] / total[ok]
    color = float(np.mean(np.minimum(1.0, area / FULL_AREA)))
    clean = extra < np.maximum(EXTRA_AREA, 0.25 * area)
    no_extra = float(np.mean(clean))
    track = centroid[ok]
    u = np.asarray(DIRECTIONS[spec.direction])
    scale = SIZE / width
    if len(track) >= 2:
        displacement = float((track[-1] - track[0]) @ u) * scale
    else:
        displacement = 0.0
    if len(track) >= 3:
        jerk = float(np.linalg.norm(np.diff(track, n=2, axis=0), axis=1).mean()) * scale
    else:
        jerk = math.inf
    direction = float(np.clip(displacement / D_MIN, 0.0, 1.0))
    smooth = 0.0 if not math.isfinite(jerk) else float(math.exp(-jerk / JERK_SCALE))
    return ClipAnalysis(area, extra, centroid, color, no_extra, displacement, jerk, direction, smooth)


def score_batch(clips: np.ndarray, specs: Iterable[ClipSpec]) -> tuple[np.ndarray, np.ndarray]:
    """(score, strict) per clip of ``[B, F, 3, H, W]``; a clip with NaN scores NaN (never a silent 0)."""
    scores, stricts = [], []
    for clip, spec in zip(clips, specs):
        if not np.isfinite(clip).all():
            scores.append(np.nan)
            stricts.append(np.nan)
            continue
        a = analyze_clip(clip, spec)
        scores.append(a.score)
        stricts.append(float(a.strict))
    return np.asarray(scores, dtype=np.float32), np.asarray(stricts, dtype=np.float32)


def term_means(clips: np.ndarray, specs: Iterable[ClipSpec]) -> dict[str, float]:
    """Mean of each checker term (and the score, the strict flag, the fraction moving the prompted way by at least
    ``D_MIN``) over clips ``[B, F, 3, H, W]``: which part of the reward a run changed."""
    analyses = [analyze_clip(c, s) for c, s in zip(clips, specs)]
    out = {k: float(np.mean([getattr(a, k) for a in analyses])) for k in ("color", "no_extra", "direction", "smooth")}
    out.update(score=float(np.mean([a.score for a in analyses])), strict=float(np.mean([a.strict for a in analyses])),
               moves_prompted_way=float(np.mean([a.displacement >= D_MIN for a in analyses])))
    return out


def spec_of(prompt: str, meta: dict | None = None) -> ClipSpec:
    """The spec of a prompt: from its metadata (``ClipSpec.to_dict()``) when present, else parsed."""
    if meta and all(k in meta for k in ("color", "shape", "direction")):
        return ClipSpec.from_dict(meta)
    return parse_prompt(prompt)


# ------------------------------------------------------------------------------------------------- tiny Wan model
def build_tiny_wan(words: Sequence[str] | None = None, seed: int = 0, base_dim: int = 8, z_dim: int = 16,
                   dim_mult: Sequence[int] = (1, 2, 2), residual: bool = True, num_layers: int = 3,
                   num_heads: int = 2, head_dim: int = 16, text_dim: int = 32, text_layers: int = 2,
                   patch: Sequence[int] = (1, 1, 1), shift: float = 1.0, tokenizer_max_length: int = 12):
    """A randomly initialised tiny ``WanPipeline`` (CPU, float32), deterministic given ``seed``.

    ``AutoencoderKLWan`` (``base_dim`` channels, ``z_dim`` latent channels, 4x time): with ``residual`` the Wan 2.2
    layout (2x2 pixel patchify in, residual average-down / duplicate-up shortcuts, ``len(dim_mult) - 1``
    downsamples after the patchify: 8x space for three ``dim_mult`` entries) — measured to learn the coloured blobs
    several times faster than the Wan 2.1 layout at this size; without it the Wan 2.1 layout (``2 ** (len(dim_mult)
    - 1)``x space). A ``WanTransformer3DModel`` with ``num_layers`` blocks of ``num_heads`` x ``head_dim`` and patch
    ``patch``, a ``UMT5EncoderModel`` (``text_dim``, ``text_layers``) over a word-level tokenizer of ``words``
    (default: this task's vocabulary), and ``FlowMatchEulerDiscreteScheduler(shift=shift)``.
    """
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from visgen.tiny import build_tokenizer

    tokenizer = build_tokenizer(words if words is not None else vocabulary(), model_max_length=tokenizer_max_length)
    torch.manual_seed(seed)
    downs = len(dim_mult) - 1
    if downs < 2:
        raise ValueError("dim_mult needs at least 3 entries (the two 2x temporal downsamples of the Wan VAE)")
    layout = dict(is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                  scale_factor_spatial=2 * 2 ** downs) if residual else dict(scale_factor_spatial=2 ** downs)
    vae = AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=list(dim_mult), num_res_blocks=1,
                           temperal_downsample=[False] * (downs - 2) + [True, True], latents_mean=[0.0] * z_dim,
                           latents_std=[1.0] * z_dim, scale_factor_temporal=4, **layout)
    torch.manual_seed(seed + 1)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=text_dim, d_kv=text_dim // 2, d_ff=2 * text_dim, num_layers=text_layers,
        num_heads=2, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))
    torch.manual_seed(seed + 2)
    transformer = WanTransformer3DModel(
        patch_size=tuple(patch), num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=z_dim,
        out_channels=z_dim, text_dim=text_dim, freq_dim=32, ffn_dim=2 * num_heads * head_dim, num_layers=num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=shift), transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# --------------------------------------------------------------------------------------------------- writing clips
def to_uint8_frames(clip) -> np.ndarray:
    """``[F, 3, H, W]`` float in [0, 1] (tensor or array) -> ``[F, H, W, 3]`` uint8."""
    array = clip.detach().float().cpu().numpy() if hasattr(clip, "detach") else np.asarray(clip, dtype=np.float32)
    array = np.nan_to_num(array, nan=0.0)
    return (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8).transpose(0, 2, 3, 1)


def clip_grid(clips: Sequence, columns: int, scale: int = 4, pad: int = 2) -> np.ndarray:
    """Tile clips ``[F, 3, H, W]`` into one ``[F, rows*H', columns*W', 3]`` uint8 video (upscaled ``scale``x,
    nearest, grey gaps)."""
    frames = [to_uint8_frames(c) for c in clips]
    f, h, w, _ = frames[0].shape
    h, w = h * scale, w * scale
    rows = math.ceil(len(frames) / columns)
    grid = np.full((f, rows * (h + pad) + pad, columns * (w + pad) + pad, 3), 128, dtype=np.uint8)
    for i, clip in enumerate(frames):
        r, c = divmod(i, columns)
        big = clip.repeat(scale, axis=1).repeat(scale, axis=2)
        grid[:, pad + r * (h + pad):pad + r * (h + pad) + h, pad + c * (w + pad):pad + c * (w + pad) + w] = big
    return grid


def write_video(frames: np.ndarray, path: str | Path, fps: int = FPS) -> Path:
    """``[F, H, W, 3]`` uint8 -> ``path`` (.gif via imageio's pillow plugin, looping; .mp4 via imageio-ffmpeg when
    installed: a missing encoder raises RuntimeError naming the package)."""
    import imageio.v3 as iio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gif":
        iio.imwrite(path, frames, duration=1000 / fps, loop=0)
    elif path.suffix == ".mp4":
        h, w = frames.shape[1:3]
        if h % 2 or w % 2:  # yuv420p needs even sizes
            frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))
        try:
            iio.imwrite(path, frames, fps=fps, codec="libx264", plugin="pyav")
        except Exception as exc:  # pragma: no cover - depends on the installed plugins
            try:
                iio.imwrite(path, frames, fps=fps, plugin="FFMPEG")
            except Exception:
                raise RuntimeError(f"cannot write {path.name}: no MP4 encoder ({exc}); install av or imageio-ffmpeg, "
                                   "or use .gif") from None
    else:
        raise ValueError(f"video path must end in .gif or .mp4, got {path.name!r}")
    return path


def save_before_after_clips(before, after, prompts: Sequence[str], per_prompt: int, run_dir: str | Path,
                            fps: int = FPS, stem: str = "samples_before_after") -> list[Path]:
    """One row per prompt: ``per_prompt`` "before" clips, then the same seeds "after"; written as ``stem.gif`` and
    ``stem.mp4`` (when an MP4 encoder is installed) plus ``stem.txt`` naming the rows."""
    clips = []
    for i in range(len(prompts)):
        clips += list(before[i * per_prompt:(i + 1) * per_prompt]) + list(after[i * per_prompt:(i + 1) * per_prompt])
    grid = clip_grid(clips, 2 * per_prompt)
    run_dir = Path(run_dir)
    written = [write_video(grid, run_dir / f"{stem}.gif", fps)]
    try:
        written.append(write_video(grid, run_dir / f"{stem}.mp4", fps))
    except RuntimeError:
        pass
    (run_dir / f"{stem}.txt").write_text(
        f"each row: {per_prompt} clips before training, then the same seeds after\n"
        + "\n".join(f"row {i}: {p}" for i, p in enumerate(prompts)) + "\n")
    return written


# ------------------------------------------------------------------------------------------------ the registered task
@dataclass
class VideoPretrainConfig(PretrainConfig):
    """Pretraining settings of the moving-shapes task: the shared ones plus the clips' and the tiny Wan's shape."""

    caption_noise: float = field(default=0.0, metadata={
        "help": "fraction of clips moving another direction than their prompt says (weakly aligned captions)"})
    frames: int = field(default=FRAMES, metadata={"help": "frames per clip (4k+1 for the Wan VAE)"})
    size: int = field(default=SIZE, metadata={"help": "clip side in pixels (multiple of 8)"})
    max_sequence_length: int = field(default=10, metadata={"help": "text tokens (the longest prompt is 9)"})
    model: dict = field(default_factory=dict, metadata={"help": "keyword arguments of build_tiny_wan"})

    def check(self, where: str) -> None:
        if (self.frames - 1) % 4 or self.size % 8:
            raise ConfigError(f"{where}.frames must be 4k+1 and size a multiple of 8 (the Wan VAE), got "
                              f"{self.frames} frames at {self.size} px")
        if not 0.0 <= self.caption_noise < 1.0:
            raise ConfigError(f"{where}.caption_noise must be in [0, 1), got {self.caption_noise}")


@register_task
class VideoShapesTask(EmbeddedTask):
    """RL prompts from the seeded split (2 held-out (colour, shape) pairs per direction), measured by the
    ``video_shapes`` reward; pretrains the tiny Wan (``build_tiny_wan``)."""

    name = "video_shapes"
    eval_reward = ("video_shapes", {})
    pretrain_config = VideoPretrainConfig
    # fewer, larger samples than the image tasks; the periodic evaluation is the final one, held-out prompts only
    pretrain_defaults = {"dataset_size": 4096, "vae": {"steps": 600, "batch_size": 16},
                         "transformer": {"steps": 3000, "warmup_steps": 100},
                         "eval": {"every": 500, "samples_per_prompt": 4, "final_samples_per_prompt": None,
                                  "train_prompts": 0}}
    model = "tiny_wan"

    def check(self, cfg, where: str) -> None:
        super().check(cfg, where)
        if cfg.eval_fraction is not None:
            raise ConfigError(f"{where}.eval_fraction is not a setting of the video_shapes task (it holds out 2 "
                              "(colour, shape) pairs per direction); remove it")

    def split_prompts(self, seed: int, eval_fraction: float) -> tuple[list, list]:
        return split_prompts(seed)

    def split(self, conf) -> tuple[list, list]:
        return split_prompts(conf.split_seed)

    def render(self, spec, rng, conf) -> np.ndarray:
        """A clip of ``spec``; with ``caption_noise`` its object moves another way than the prompt says (drawn from
        ``rng`` before the clip, so the draws interleave with the rendering's)."""
        if conf.caption_noise > 0 and rng.random() < conf.caption_noise:
            other = [d for d in DIRECTIONS if d != spec.direction]
            spec = ClipSpec(spec.color, spec.shape, other[int(rng.integers(len(other)))])
        return render_clip(spec, rng, conf.frames, conf.size)

    def build_pipeline(self, conf):
        return build_tiny_wan(seed=conf.seed, **conf.model)

    def score(self, samples, specs: list) -> dict[str, float]:
        score, strict = score_batch(samples.numpy(), specs)
        return {"score": float(np.nanmean(score)), "strict": float(np.nanmean(strict))}
