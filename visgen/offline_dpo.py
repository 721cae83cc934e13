"""Offline Diffusion-DPO from stored preference pairs (Wallace et al., "Diffusion Model Alignment Using Direct
Preference Optimization", CVPR 2024, trained on Pick-a-Pic pairs): the ``dpo`` objective and loss of the online
method (``docs/methods/online_dpo.md``), fed from a pair file instead of the policy's own samples.

``visgen.objective: {name: dpo, pairs: FILE}``: every group is one stored pair, its chosen and its rejected image,
encoded by the pipeline's VAE into the clean latents x0 the DPO slots noise (chosen and rejected share each slot's
noise and logit-normal timestep, as online); the rollout's reward output ``preference`` is 1 for the chosen row and 0
for the rejected one, so the group's advantages rank the pair and the ``dpo`` loss trains it. Nothing is sampled or
scored (``nfe/rollout`` 0); ``rollout.group_size`` must be 2 and the keys are the pair indices.

The file: JSONL (one object a line), CSV or parquet (pandas), either with ``prompt``, ``chosen``, ``rejected`` (image
paths, relative to the file's folder, or raw image bytes) or Pick-a-Pic's columns ``caption``, ``jpg_0``, ``jpg_1``,
``label_0`` (1: image 0 preferred, 0: image 1; ties 0.5 are dropped, as the Diffusion-DPO training script does).
Images are resized (bicubic, shorter side) and centre-cropped to the run's resolution.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared_rl.config import ConfigError
from shared_rl.readers import read_jsonl
from shared_rl.rollout import Rollout

# torch-free: the config checks with it (offline_dpo.check_offline as before)
from .objective_settings import check_offline  # noqa: F401
from .rollout import VisgenRollouts

__all__ = ["StoredPair", "read_pairs", "load_image", "StoredPairRollouts", "PREFERENCE", "check_offline",
           "write_shapes_pairs"]

PREFERENCE = "preference"  # the rollout's reward output: 1 chosen, 0 rejected


@dataclass(frozen=True)
class StoredPair:
    prompt: str
    chosen: Any  # a path (str) or image bytes
    rejected: Any


def _records(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_jsonl(path, "visgen.objective.pairs")
    if suffix in (".csv", ".parquet"):
        import pandas as pd

        frame = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        return frame.to_dict("records")
    raise ConfigError(f"visgen.objective.pairs {path}: expected a .jsonl, .csv or .parquet file")


def read_pairs(path: str | Path) -> list[StoredPair]:
    """The pairs of a pair file (module docstring); ConfigError in one line for a missing file, missing columns or a
    missing image."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"visgen.objective.pairs {str(path)!r} does not exist (a .jsonl/.csv/.parquet of prompt, "
                          "chosen, rejected)")
    pairs = []
    for i, row in enumerate(_records(path)):
        if {"prompt", "chosen", "rejected"} <= set(row):
            prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        elif {"caption", "jpg_0", "jpg_1", "label_0"} <= set(row):
            if float(row["label_0"]) == 0.5:
                continue  # a tie: no preference
            prompt = row["caption"]
            chosen, rejected = (row["jpg_0"], row["jpg_1"]) if float(row["label_0"]) > 0.5 else (row["jpg_1"], row["jpg_0"])
        else:
            raise ConfigError(f"visgen.objective.pairs {path}: row {i} has columns {sorted(row)}; need prompt, chosen, "
                              "rejected (or Pick-a-Pic's caption, jpg_0, jpg_1, label_0)")
        refs = []
        for ref in (chosen, rejected):
            if isinstance(ref, str):
                full = Path(ref) if Path(ref).is_absolute() else path.parent / ref
                if not full.is_file():
                    raise ConfigError(f"visgen.objective.pairs {path}: row {i}: image {ref!r} does not exist")
                ref = str(full)
            refs.append(ref)
        pairs.append(StoredPair(str(prompt), refs[0], refs[1]))
    if not pairs:
        raise ConfigError(f"visgen.objective.pairs {path}: no pairs (an empty file, or every row a tie)")
    return pairs


def load_image(ref: Any, height: int, width: int) -> torch.Tensor:
    """``[3, height, width]`` float32 in [0, 1]: a path or bytes, RGB, shorter side resized (bicubic), centre crop."""
    from PIL import Image

    image = Image.open(io.BytesIO(ref) if isinstance(ref, (bytes, bytearray)) else ref).convert("RGB")
    w, h = image.size
    scale = max(width / w, height / h)
    nw, nh = max(width, round(w * scale)), max(height, round(h * scale))
    if (nw, nh) != (w, h):
        image = image.resize((nw, nh), Image.BICUBIC)
    left, top = (nw - width) // 2, (nh - height) // 2
    image = image.crop((left, top, left + width, top + height))
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(height, width, 3).permute(2, 0, 1).float() / 255


class StoredPairRollouts(VisgenRollouts):
    """A ``VisgenRollouts`` whose rollout reads stored pairs (keys = pair indices) instead of sampling; the training
    side (``log_probs``: the ``dpo`` objective's policy and reference errors) is the online one's."""

    def __init__(self, base: VisgenRollouts, pairs: list[StoredPair]) -> None:
        self.__dict__.update(base.__dict__)
        self.pairs = pairs
        self.prompts = [p.prompt for p in pairs]
        self.metas = [{} for _ in pairs]

    @torch.no_grad()
    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        if group_size != 2:
            raise ConfigError(f"offline DPO trains one stored pair per group: set rollout.group_size: 2, got {group_size}")
        import time

        t0 = time.perf_counter()
        P = len(keys)
        cond = self.adapter.encode_prompts([self.prompts[k] for k in keys], num_images_per_prompt=1,
                                           guidance_scale=self.guidance_scale, **self.sample_kwargs)
        sigmas, timesteps = self.adapter.schedule(self.num_inference_steps, cond)
        rows = torch.arange(P).repeat_interleave(2)
        cond = cond[rows.to(self.adapter.device)]
        images = torch.stack([load_image(ref, cond.height, cond.width) for k in keys
                              for ref in (self.pairs[k].chosen, self.pairs[k].rejected)])
        size = self.kernel.micro_batch or images.shape[0]
        x0 = torch.cat([self.adapter.encode_images(images[i:i + size].to(self.adapter.device), cond[torch.arange(i, min(i + size, 2 * P))],
                                                   generator) for i in range(0, images.shape[0], size)]).float()
        c = cond
        self._cond_meta = {"guidance_scale": c.guidance_scale, "do_cfg": c.do_cfg, "height": c.height,
                           "width": c.width, "shared": c.shared, "options": c.options}
        groups = rows.clone()
        is_leaf = torch.ones(2 * P, dtype=torch.bool)
        mask, payload = self.objective.training_slots(is_leaf, x0, 1, sigmas, timesteps, generator, groups)
        payload["cond"] = dict(cond.tensors)
        preference = torch.tensor([1.0, 0.0]).repeat(P)
        info = {"time/sample": time.perf_counter() - t0, "time/reward": 0.0, "dpo/stored_pairs": float(P)}
        return Rollout(keys=list(keys), group_ids=groups, rewards={PREFERENCE: preference},
                       logp_old=torch.zeros(mask.shape), mask=mask, parent=None, payload=payload, nfe=0, info=info,
                       info_reduce={k: "sum" if k.startswith("time/") or k == "dpo/stored_pairs" else "mean" for k in info},
                       key_index=torch.arange(P))


def write_shapes_pairs(out_dir: str | Path, count: int | None = None, seed: int = 0) -> Path:
    """A synthetic preference set for the shapes demo: per training prompt of the shapes task, the chosen image is a
    rendering of the prompt and the rejected one the same layout with the first object in another colour (PNG,
    32 x 32); ``pairs.jsonl`` beside them. Returns the pair file."""
    import numpy as np
    from PIL import Image

    from .tasks import shapes as task

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = task.split_prompts(seed=0)[0]
    specs = specs[:count] if count else specs
    rng = np.random.default_rng(seed)
    colours = list(task.COLORS)
    lines = []
    for i, spec in enumerate(specs):
        first = spec.objects[0]
        others = [c for c in colours if c not in {o.color for o in spec.objects}]
        wrong = task.ObjectSpec(others[int(rng.integers(len(others)))], first.shape, first.count, first.position)
        bad = task.PromptSpec(spec.kind, (wrong,) + tuple(spec.objects[1:]))
        state = int(rng.integers(2**31))
        for name, which in (("chosen", spec), ("rejected", bad)):
            pixels = (task.render(which, np.random.default_rng(state)).transpose(1, 2, 0) * 255).round().astype(np.uint8)
            Image.fromarray(pixels).save(out / f"{i:04d}_{name}.png")
        lines.append(json.dumps({"prompt": task.render_prompt_text(spec), "chosen": f"{i:04d}_chosen.png",
                                 "rejected": f"{i:04d}_rejected.png"}))
    path = out / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":  # python -m visgen.offline_dpo OUT_DIR [COUNT]: the shapes demo's pair file
    import sys

    print(write_shapes_pairs(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None))
