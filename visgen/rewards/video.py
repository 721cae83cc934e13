"""Video rewards: a clip ``[B, F, 3, H, W]`` in [0, 1] -> one named score per clip.

- ``video_shapes`` / ``video_shapes_strict``: the analytic reward of the embedded moving-shapes task
  (``visgen.tasks.video``): colour, no stray colours, direction and smoothness of the motion, read from the pixels.
- ``video_frames``: any registered *image* reward (PickScore, HPS, OCR, CLIP score, ...) applied to every
  ``frame_stride``-th frame and aggregated over frames (``mean`` / ``min`` / ``max``) — how DanceGRPO and Flow-GRPO
  score videos with image reward models.
- ``video_temporal_consistency``: mean cosine similarity of consecutive frames' features (pooled, per-frame
  centred pixels by default; or a vision backbone from a local path / hub id, e.g. CLIP or DINOv2): flicker and
  identity changes lower it. A still clip scores 1: pair it with a motion term.
- ``video_motion``: motion magnitude, the mean absolute difference of consecutive frames (x 255 grey levels), or
  ``-|m - target|`` with a ``target`` (a band: neither frozen nor chaotic).
- ``videoalign``: a VideoAlign-style hook (Liu et al., "Improving Video Generation with Human Feedback", 2025, the
  VideoReward model): a video reward *model* loaded from a local path by a ``"module:attr"`` factory, called with the
  clips (uint8 frame arrays, or temporary MP4 paths) and the prompts, one of its scores kept (``Overall``, ``VQ``,
  ``MQ``, ``TA`` for VideoReward).

Every reward here accepts ``offload: true`` where it holds a model: the model lives on the CPU and visits
``device`` only while scoring (frozen reward models need no accelerator memory between calls). A clip containing
NaN scores NaN; a malformed batch raises ``RewardInputError`` with one line.
"""
from __future__ import annotations

import contextlib
import inspect
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .base import RewardInfo, RewardInputError, get_reward, register

AGGREGATES = ("mean", "min", "max")


def check_video_batch(videos: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict] | None) -> None:
    """Raise RewardInputError unless ``videos`` is ``[B, F, 3, H, W]`` floating in [0, 1] (NaN allowed)."""
    if not isinstance(videos, torch.Tensor) or videos.ndim != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if isinstance(videos, torch.Tensor) else type(videos).__name__
        raise RewardInputError(f"videos must be a Tensor [B, F, 3, H, W], got {shape}; decode with a video "
                               "pipeline (an image reward takes [B, 3, H, W]: wrap it in video_frames)")
    if not videos.is_floating_point():
        raise RewardInputError(f"videos must be floating point in [0, 1], got {videos.dtype}")
    finite = videos[torch.isfinite(videos)]
    if finite.numel() and (finite.min() < -1e-3 or finite.max() > 1 + 1e-3):
        raise RewardInputError(f"videos must be in [0, 1] (got min {finite.min():.3f}, max {finite.max():.3f})")
    if len(prompts) != videos.shape[0]:
        raise RewardInputError(f"{len(prompts)} prompts for {videos.shape[0]} videos")
    if metadata is not None and len(metadata) != videos.shape[0]:
        raise RewardInputError(f"{len(metadata)} metadata entries for {videos.shape[0]} videos")


def _finite(videos: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(videos.detach()).flatten(1).all(1).cpu()


# ------------------------------------------------------------------------------------------------------ offload
def _modules(obj: Any, depth: int = 2) -> list[torch.nn.Module]:
    """The torch modules an object holds (itself, its attributes, one level into plain containers/objects)."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    found: list[torch.nn.Module] = []
    if depth <= 0:
        return found
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for value in values:
        if isinstance(value, torch.nn.Module):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [v for v in value if isinstance(v, torch.nn.Module)]
        elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.Tensor)) and depth > 1:
            found += _modules(value, depth - 1)
    unique, seen = [], set()
    for m in found:
        if id(m) not in seen:
            seen.add(id(m))
            unique.append(m)
    return unique


class Offload:
    """Keep ``obj``'s torch modules on ``home`` (CPU) and move them to ``device`` only inside ``with offload:``.

    An object with a ``device`` attribute (the reward models here read it to place inputs) gets it set to
    ``device`` while inside. A no-op when ``device`` is the CPU."""

    def __init__(self, obj: Any, device: str | torch.device | None, home: str = "cpu") -> None:
        self.obj = obj
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.home = torch.device(home)
        self.modules = _modules(obj)
        self.active = self.device != self.home
        if self.active:
            for m in self.modules:
                m.to(self.home)
            self._set_device(self.home)

    def _set_device(self, device: torch.device) -> None:
        if hasattr(self.obj, "device") and not isinstance(self.obj, torch.nn.Module):
            try:
                setattr(self.obj, "device", device)
            except AttributeError:
                pass

    def __enter__(self):
        if self.active:
            for m in self.modules:
                m.to(self.device)
            self._set_device(self.device)
        return self.obj

    def __exit__(self, *exc) -> None:
        if self.active:
            for m in self.modules:
                m.to(self.home)
            self._set_device(self.home)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


class OffloadedReward:
    """A reward whose models stay on the CPU between calls (see :class:`Offload`); ``visgen.memory`` wraps every
    configured reward in one when ``offload_rewards`` is on."""

    def __init__(self, reward: Any, device: str | torch.device | None = None) -> None:
        self.reward = reward
        target = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.offload = Offload(reward, target)

    def __call__(self, images, prompts, metadata=None):
        with self.offload:
            return self.reward(images, prompts, metadata)


# ----------------------------------------------------------------------------------------------- task reward
TERMS = ("color", "no_extra", "direction", "smooth")


class VideoShapesReward:
    """The analytic moving-shapes reward (``visgen.tasks.video``): the ``score``, the ``strict`` flag or one term."""

    def __init__(self, output: str = "score", name: str | None = None) -> None:
        if output not in ("score", "strict") + TERMS:
            raise RewardInputError(f"video_shapes output must be score, strict or one of {TERMS}, got {output!r}")
        self.output = output
        self.name = name or {"score": "video_shapes", "strict": "video_shapes_strict"}.get(output,
                                                                                            f"video_shapes_{output}")

    def __call__(self, videos, prompts, metadata=None):
        from visgen.tasks import video as task

        check_video_batch(videos, prompts, metadata)
        metas = metadata if metadata is not None else [None] * len(prompts)
        try:
            specs = [task.spec_of(p, m) for p, m in zip(prompts, metas)]
        except ValueError as exc:
            raise RewardInputError(f"video_shapes reward: {exc}") from None
        clips = videos.detach().float().cpu().numpy()
        if self.output in TERMS:
            values = [float("nan") if not np.isfinite(c).all() else getattr(task.analyze_clip(c, s), self.output)
                      for c, s in zip(clips, specs)]
            return {self.name: torch.tensor(values, dtype=torch.float32)}
        score, strict = task.score_batch(clips, specs)
        return {self.name: torch.from_numpy(score if self.output == "score" else strict)}


@register("video_shapes", RewardInfo(range="[0, 1]", summary="moving-shapes task score (colour, no extra, "
                                                              "direction, smoothness)"))
def build_video_shapes(name: str = "video_shapes") -> VideoShapesReward:
    """The moving-shapes task's analytic score in [0, 1]."""
    return VideoShapesReward("score", name)


@register("video_shapes_strict", RewardInfo(range="{0, 1}", summary="moving-shapes task: every check passes"))
def build_video_shapes_strict(name: str = "video_shapes_strict") -> VideoShapesReward:
    """1 when every check of the moving-shapes task passes."""
    return VideoShapesReward("strict", name)


@register("video_shapes_direction", RewardInfo(range="[0, 1]", summary="moving-shapes task: the direction term"))
def build_video_shapes_direction(name: str = "video_shapes_direction") -> VideoShapesReward:
    """The direction term of the moving-shapes task alone (displacement along the prompted direction / D_MIN)."""
    return VideoShapesReward("direction", name)


# --------------------------------------------------------------------------------------------- frame rewards
class FrameReward:
    """An image reward on every ``frame_stride``-th frame (from ``first_frame``), aggregated over frames."""

    def __init__(self, reward: dict | str, aggregate: str = "mean", frame_stride: int = 1, first_frame: int = 0,
                 output: str | None = None, name: str = "video_frames", batch_frames: int = 0,
                 offload: bool = False, device: str | None = None) -> None:
        spec = {"name": reward} if isinstance(reward, str) else dict(reward or {})
        if "name" not in spec:
            raise RewardInputError("video_frames needs reward: {name: <image reward>, kwargs: {...}}")
        if aggregate not in AGGREGATES:
            raise RewardInputError(f"video_frames aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        if frame_stride < 1 or first_frame < 0 or batch_frames < 0:
            raise RewardInputError("video_frames: frame_stride must be >= 1, first_frame and batch_frames >= 0")
        self.inner = get_reward(spec["name"], **dict(spec.get("kwargs") or {}))
        self.inner_name = spec["name"]
        self.aggregate, self.stride, self.first = aggregate, int(frame_stride), int(first_frame)
        self.output, self.name, self.batch_frames = output, name, int(batch_frames)
        self.offload = Offload(self.inner, device or ("cuda" if torch.cuda.is_available() else "cpu")) if offload \
            else contextlib.nullcontext()

    def frame_indices(self, num_frames: int) -> list[int]:
        idx = list(range(self.first, num_frames, self.stride))
        if not idx:
            raise RewardInputError(f"video_frames: first_frame {self.first} is past the clip's {num_frames} frames")
        return idx

    def __call__(self, videos, prompts, metadata=None):
        check_video_batch(videos, prompts, metadata)
        B, F = videos.shape[:2]
        idx = self.frame_indices(F)
        frames = videos[:, idx].reshape(B * len(idx), *videos.shape[2:])
        rep_prompts = [p for p in prompts for _ in idx]
        rep_meta = None if metadata is None else [m for m in metadata for _ in idx]
        size = self.batch_frames or frames.shape[0]
        outs: list[torch.Tensor] = []
        with self.offload:
            for s in range(0, frames.shape[0], size):
                got = self.inner(frames[s:s + size], rep_prompts[s:s + size],
                                 None if rep_meta is None else rep_meta[s:s + size])
                key = self.output or (self.inner_name if self.inner_name in got else next(iter(got)))
                if key not in got:
                    raise RewardInputError(f"video_frames: {self.inner_name} has no output {key!r}; it emits "
                                           f"{sorted(got)}")
                outs.append(torch.as_tensor(got[key], dtype=torch.float32).reshape(-1))
        per_frame = torch.cat(outs).reshape(B, len(idx))
        if self.aggregate == "mean":
            value = per_frame.mean(1)
        elif self.aggregate == "min":
            value = per_frame.min(1).values
        else:
            value = per_frame.max(1).values
        return {self.name: value}


@register("video_frames", RewardInfo(weights="those of the wrapped image reward", range="the image reward's",
                                     summary="an image reward per frame, aggregated over frames"))
def build_video_frames(reward: dict | str = "shapes", aggregate: str = "mean", frame_stride: int = 1,
                       first_frame: int = 0, output: str | None = None, name: str = "video_frames",
                       batch_frames: int = 0, offload: bool = False, device: str | None = None) -> FrameReward:
    """Any image reward applied to every frame_stride-th frame, aggregated by mean / min / max."""
    return FrameReward(reward, aggregate, frame_stride, first_frame, output, name, batch_frames, offload, device)


# ------------------------------------------------------------------------------------- temporal consistency
class PixelFeatures:
    """Per-frame features without weights: average-pooled to ``size`` x ``size``, centred per frame and channel."""

    def __init__(self, size: int = 8) -> None:
        self.size = int(size)

    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool2d(frames.float(), self.size)
        pooled = pooled - pooled.mean(dim=(2, 3), keepdim=True)
        return pooled.flatten(1)


class BackboneFeatures:
    """Per-frame features from a vision backbone (transformers ``AutoModel`` + ``AutoImageProcessor``: CLIP vision,
    DINOv2, SigLIP ...) from a local path or hub id: the image embedding when the model has one, else the pooled
    output, else the mean of the last hidden state."""

    def __init__(self, model: str, device: str | None = None, dtype: str = "float32") -> None:
        from transformers import AutoImageProcessor, AutoModel

        try:
            self.processor = AutoImageProcessor.from_pretrained(model)
            self.model = AutoModel.from_pretrained(model)
        except OSError as exc:
            raise RewardInputError(f"video_temporal_consistency: cannot load {model!r} ({str(exc).splitlines()[0]}); "
                                   "give a local directory or download it first") from None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        self.model.to(self.device, self.dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        pixels = self.processor(images=list(frames.float().clamp(0, 1).cpu()), do_rescale=False,
                                return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        if hasattr(self.model, "get_image_features"):
            out = self.model.get_image_features(pixel_values=pixels)
            out = out if isinstance(out, torch.Tensor) else out.pooler_output
        else:
            result = self.model(pixel_values=pixels)
            out = getattr(result, "pooler_output", None)
            if out is None:
                out = result.last_hidden_state.mean(1)
        return out.float().flatten(1)


class TemporalConsistency:
    def __init__(self, features: str = "pixels", model: str | None = None, pool: int = 8, device: str | None = None,
                 dtype: str = "float32", name: str = "video_temporal_consistency", offload: bool = False) -> None:
        if features == "pixels":
            self.features = PixelFeatures(pool)
        elif features == "model":
            if not model:
                raise RewardInputError("video_temporal_consistency features: model needs model: <local path or hub id>")
            self.features = BackboneFeatures(model, device, dtype)
        else:
            raise RewardInputError(f"video_temporal_consistency features must be 'pixels' or 'model', got {features!r}")
        self.name = name
        self.offload = Offload(self.features, self.features.device) if offload and features == "model" else \
            contextlib.nullcontext()

    def __call__(self, videos, prompts, metadata=None):
        check_video_batch(videos, prompts, metadata)
        B, F = videos.shape[:2]
        if F < 2:
            raise RewardInputError("video_temporal_consistency needs clips of at least 2 frames")
        with self.offload:
            feats = self.features(torch.nan_to_num(videos.detach().float()).reshape(B * F, *videos.shape[2:]))
        feats = feats.reshape(B, F, -1)
        sims = torch.nn.functional.cosine_similarity(feats[:, 1:], feats[:, :-1], dim=-1, eps=1e-8)
        value = sims.mean(1).cpu()
        value[~_finite(videos)] = float("nan")
        return {self.name: value}


@register("video_temporal_consistency", RewardInfo(weights="none (pixels) or the given backbone's", range="[-1, 1]",
                                                   summary="mean cosine similarity of consecutive frames' features"))
def build_temporal_consistency(features: str = "pixels", model: str | None = None, pool: int = 8,
                               device: str | None = None, dtype: str = "float32",
                               name: str = "video_temporal_consistency", offload: bool = False) -> TemporalConsistency:
    """Mean cosine similarity of consecutive frames' features (pooled pixels, or a vision backbone)."""
    return TemporalConsistency(features, model, pool, device, dtype, name, offload)


# ------------------------------------------------------------------------------------------------------ motion
class MotionMagnitude:
    def __init__(self, target: float | None = None, name: str = "video_motion") -> None:
        if target is not None and target < 0:
            raise RewardInputError(f"video_motion target must be >= 0 grey levels, got {target}")
        self.target, self.name = target, name

    def __call__(self, videos, prompts, metadata=None):
        check_video_batch(videos, prompts, metadata)
        if videos.shape[1] < 2:
            raise RewardInputError("video_motion needs clips of at least 2 frames")
        v = videos.detach().float()
        magnitude = (v[:, 1:] - v[:, :-1]).abs().flatten(1).mean(1).cpu() * 255.0
        value = magnitude if self.target is None else -(magnitude - self.target).abs()
        value[~_finite(videos)] = float("nan")
        return {self.name: value}


@register("video_motion", RewardInfo(range="[0, 255] grey levels (or <= 0 with a target)",
                                     summary="mean absolute difference of consecutive frames"))
def build_video_motion(target: float | None = None, name: str = "video_motion") -> MotionMagnitude:
    """Motion magnitude: mean |frame[t+1] - frame[t]| in grey levels (or -|m - target|)."""
    return MotionMagnitude(target, name)


# --------------------------------------------------------------------------------------------- VideoAlign hook
VIDEOALIGN_ENTRY = "inference:VideoVLMRewardInference"  # KwaiVGI/VideoAlign's inference.py, on the PYTHONPATH


def _load_entry(entry: str):
    from shared_rl.errors import ConfigError
    from shared_rl.registry import import_object

    try:
        return import_object(entry, "videoalign entry")
    except ConfigError as exc:
        raise RewardInputError(f"{exc}; put the reward model's code on PYTHONPATH (VideoAlign: its inference.py)") \
            from None


class VideoAlignReward:
    """A video reward model behind a factory ``entry(path, device=..., dtype=...)`` whose ``method`` scores
    ``(videos, prompts, **call_kwargs)`` and returns one dict (or one number) per clip."""

    def __init__(self, path: str, entry: str = VIDEOALIGN_ENTRY, method: str = "reward", input: str = "paths",
                 output_key: str = "Overall", scale: float = 1.0, fps: int = 8, device: str | None = None,
                 dtype: str = "bfloat16", call_kwargs: dict | None = None, name: str = "videoalign",
                 offload: bool = False) -> None:
        location = Path(path).expanduser()
        if not location.exists():
            raise RewardInputError(f"videoalign path {path!r} does not exist; give the local checkpoint directory")
        if input not in ("paths", "frames"):
            raise RewardInputError(f"videoalign input must be 'paths' (temporary MP4 files) or 'frames', got {input!r}")
        factory = _load_entry(entry)
        target = device or ("cuda" if torch.cuda.is_available() else "cpu")
        kwargs = {}
        params = inspect.signature(factory).parameters
        for key, value in (("device", target), ("dtype", dtype)):
            if key in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
                kwargs[key] = value
        self.model = factory(str(location), **kwargs)
        if not hasattr(self.model, method):
            raise RewardInputError(f"videoalign: {entry} objects have no method {method!r}")
        self.method, self.input, self.output_key = method, input, output_key
        self.scale, self.fps, self.call_kwargs, self.name = float(scale), int(fps), dict(call_kwargs or {}), name
        self.offload = Offload(self.model, target) if offload else contextlib.nullcontext()

    def _value(self, item: Any) -> float:
        if isinstance(item, dict):
            if self.output_key not in item:
                raise RewardInputError(f"videoalign: the model returned keys {sorted(item)}, not {self.output_key!r}")
            item = item[self.output_key]
        return float(item) * self.scale

    def __call__(self, videos, prompts, metadata=None):
        from visgen.tasks.video import to_uint8_frames, write_video

        check_video_batch(videos, prompts, metadata)
        ok = _finite(videos)
        values = torch.full((videos.shape[0],), float("nan"))
        keep = torch.nonzero(ok).flatten().tolist()
        if not keep:
            return {self.name: values}
        frames = [to_uint8_frames(videos[i]) for i in keep]
        texts = [prompts[i] for i in keep]
        with self.offload, tempfile.TemporaryDirectory() as tmp:
            if self.input == "paths":
                inputs: list[Any] = [str(write_video(f, Path(tmp) / f"clip_{k}.mp4", self.fps))
                                     for k, f in enumerate(frames)]
            else:
                inputs = frames
            with torch.no_grad():
                scores = getattr(self.model, self.method)(inputs, texts, **self.call_kwargs)
        if len(scores) != len(keep):
            raise RewardInputError(f"videoalign: the model returned {len(scores)} scores for {len(keep)} clips")
        for i, item in zip(keep, scores):
            values[i] = self._value(item)
        return {self.name: values}


@register("videoalign", RewardInfo(weights="a local VideoAlign / VideoReward checkpoint (KwaiVGI/VideoAlign)",
                                   licence="the checkpoint's", range="the model's (VideoReward: unbounded logits)",
                                   summary="a video reward model loaded from a local path through a factory"))
def build_videoalign(path: str, entry: str = VIDEOALIGN_ENTRY, method: str = "reward", input: str = "paths",
                     output_key: str = "Overall", scale: float = 1.0, fps: int = 8, device: str | None = None,
                     dtype: str = "bfloat16", call_kwargs: dict | None = None, name: str = "videoalign",
                     offload: bool = False) -> VideoAlignReward:
    """A VideoAlign-style video reward model from a local path (entry: 'module:attr' factory)."""
    return VideoAlignReward(path, entry, method, input, output_key, scale, fps, device, dtype, call_kwargs, name,
                            offload)
