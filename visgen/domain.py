"""The visgen training domain: GRPO-family RL of a flow-matching text-to-image pipeline against reward models.

One class covers every visgen method; they differ only in ``visgen.method`` (a tagged union over the registry in
``visgen.methods``) and ``visgen.kernel``:

| method          | ``kernel`` | ``method``                                          | rollout shape                          |
|-----------------|------------|-----------------------------------------------------|----------------------------------------|
| Flow-GRPO       | ``sde``    | ``{name: flow_grpo, train_fraction: 0.3}``           | flat: group_size chains per prompt     |
| DanceGRPO       | ``dance``  | ``{name: dance_grpo}`` (random 60% of steps/sample)  | flat                                   |
| Flow-GRPO-Fast  | ``sde``    | ``{name: flow_grpo_fast}`` (SDE in a 1-3 step window)| flat, ODE elsewhere                    |
| MixGRPO         | ``sde``    | ``{name: mix_grpo}`` (sliding SDE window)            | flat                                   |
| BranchGRPO(-Mix)| ``sde``    | ``{name: branch_grpo, split_steps: [0, 2, 4, 6]}``   | one tree per prompt, pruning           |
| TreeGRPO        | ``sde``    | ``{name: tree_grpo, branch: [2, 2, 2, 2]}``          | one tree per prompt, SDE window        |
| E-GRPO          | ``sde``    | ``{name: egrpo}``                                    | one group per (prompt, merged step)    |

An iteration, as the shared trainer drives it: ``rollout`` encodes the prompts, lets the method grow its forest on
the one engine (``visgen.engine``: one batched transformer forward per level and step, SDE where the method says
so, log-probs recorded), decodes and scores the leaves with the reward registry, lets the method prune, and returns
the trainable edges; the trainer turns rewards into group-relative (or tree) advantages; ``log_probs`` recomputes
the trained steps' log-probs with grad (``visgen.recompute``) for the policy loss and, with ``loss.kl_coef > 0``,
the Flow-GRPO Gaussian-mean KL to the base model (the LoRA adapter switched off). ``evaluate`` samples held-out
prompts with the deterministic ODE and fixed seeds. The model stays in eval mode throughout (no dropout), so the
first inner step's importance ratio is exactly 1 when the training batch layout equals the rollout's.

Config: see :class:`VisgenConfig` (``grove config show`` prints every field with its help); recipes in
``configs/visgen/``; method pages in ``docs/methods/``.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from shared_rl.config import ConfigError
from shared_rl.domain import DomainBase, RunContext, StepLogProbs
from shared_rl.rewards import guarded_reward
from shared_rl.rollout import Rollout
from shared_rl.sharding import loads_on_meta

from .fsdp import place_pipeline
# the config (VisgenConfig and its sections) is torch-free, so grove config show and the config's checks run without
# this module (shared_rl.registry.DOMAIN_CONFIGS names visgen.config); its names stay here, as before
from .config import EvalSettings, RewardSpec, VisgenConfig, _import_optional_rewards  # noqa: F401
from .pipelines.load import load_pipeline  # noqa: F401  (visgen.domain.load_pipeline, as before)
from .policy import FlowPolicy
from .rollout import VisgenRollouts
from .tasks import get_task
from .tasks.files import read_prompt_file  # noqa: F401  (visgen.domain.read_prompt_file, as before)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# display names of the shapes reward outputs in evaluation metrics
EVAL_NAMES = {"shapes": "score", "shapes_strict": "strict"}


# ------------------------------------------------------------------------------------------------------ domain
class VisgenDomain(DomainBase):
    """GRPO-family RL of a diffusers flow-matching pipeline (see the module docstring)."""

    config_class = VisgenConfig

    def __init__(self, cfg: VisgenConfig, ctx: RunContext) -> None:
        from .pipelines import as_adapter
        from .pipelines.memory import apply_memory_settings
        from .rewards import get_reward
        from .rewards.video import OffloadedReward

        self.cfg, self.ctx = cfg, ctx
        self.task = get_task(cfg.task)
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if ctx.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormal floats make CPU kernels crawl as LoRA deltas shrink
        held = ctx.objects.get("pipeline")  # a pipeline the caller holds (visgen.api), trained in place
        if held is not None:
            self.pipe, self.model_location, local = held, cfg.model, False
            self.pipe.set_progress_bar_config(disable=True)
        else:
            # FSDP2 with several processes: the transformers on the meta device on processes > 0 (process 0 alone
            # loads them; setup_fsdp fills the others' shards: visgen/fsdp.py)
            self.pipe, self.model_location, local = load_pipeline(cfg.model, DTYPES[cfg.dtype],
                                                                  meta_transformers=loads_on_meta(ctx))
        place_pipeline(self.pipe, ctx.device)
        self.adapter = as_adapter(self.pipe)
        settings = self._asset_settings(local)
        self.max_sequence_length = cfg.max_sequence_length or settings.get("max_sequence_length")
        resolution = cfg.resolution or settings.get("resolution")
        self.height = self.width = int(resolution) if resolution else None
        if self.height:
            multiple = self.adapter.size_multiple()  # VAE downsampling x patch size (x 2 for 2x2-packed latents)
            if self.height % multiple:
                raise ConfigError(f"visgen.resolution {self.height} must be a multiple of {multiple} for this "
                                  f"pipeline (VAE downsampling x transformer patch size); try "
                                  f"{max(multiple, round(self.height / multiple) * multiple)}")
        self.policy = FlowPolicy(self.pipe, cfg.train_mode, cfg.lora, cfg.ema, cfg.gradient_checkpointing,
                                 cfg.full_reference)
        self.num_frames = cfg.num_frames or settings.get("num_frames")
        if cfg.num_frames and not self.adapter.is_video:
            raise ConfigError(f"visgen.num_frames is for video pipelines; {type(self.pipe).__name__} makes images")
        self.fps = int(settings.get("fps", 8))
        self.memory = apply_memory_settings(self.pipe, self.adapter, cfg.memory)
        self._load_prompts(settings)
        _import_optional_rewards()
        def guarded(name: str, fn: Any) -> Any:
            fn = OffloadedReward(fn, ctx.device) if cfg.memory.offload_rewards else fn
            return guarded_reward(fn, name, cfg.reward_guard, lambda images, prompts, metas: len(prompts), log=ctx.log)

        raw = [(spec.name, get_reward(spec.name, **spec.kwargs)) for spec in cfg.rewards]
        self.rewards = [(name, guarded(name, fn)) for name, fn in raw]
        self.eval_rewards = list(self.rewards)
        if self.task.eval_reward and not any(name == self.task.eval_reward[0] for name, _ in self.rewards):
            name, kwargs = self.task.eval_reward  # the task's own metric, always reported
            self.eval_rewards.append((name, guarded(name, get_reward(name, **kwargs))))
        self.gold_rewards = [(spec.name, guarded(spec.name, get_reward(spec.name, **spec.kwargs)))
                             for spec in cfg.gold_rewards]
        self.method = cfg.rollout_method(train_cfg=ctx.train_cfg)
        self.objective = cfg.training_objective()
        schedule = self.objective.old_policy()
        if schedule is not None:  # DiffusionNFT's lagging "old" adapter (v_old, the sampler), AWM's EMA copy
            self.policy.enable_old_policy(schedule.decay_max, schedule.ramp, schedule.flat, schedule.update)
        self.rollouts = VisgenRollouts.from_config(cfg, self.adapter, self.policy, self.method, self.objective,
                                                   self.train_prompts, self.train_meta, self.score,
                                                   self._sample_kwargs(),
                                                   granular_outputs=cfg.granular_base_outputs(ctx.train_cfg))
        if getattr(self.objective.settings, "pairs", None):  # offline DPO: the stored pairs are the training data
            from .offline_dpo import StoredPairRollouts, read_pairs

            self.rollouts = StoredPairRollouts(self.rollouts, read_pairs(self.objective.settings.pairs))
            self.train_prompts, self.train_meta = self.rollouts.prompts, self.rollouts.metas
        from .objectives import Objective

        if self.objective.builds_targets:  # DiffusionOPSD: the trained reward with its gradient to the images
            self.rollouts.grad_reward = self._grad_reward(raw)
            vae = getattr(self.pipe, "vae", None)
            if cfg.gradient_checkpointing and hasattr(vae, "enable_gradient_checkpointing"):
                vae.enable_gradient_checkpointing()  # the reference's: the reward gradient runs through the decode
        if type(self.objective).select_rows is not Objective.select_rows:  # DPO ranks its pairs by the trained reward
            weights = dict(ctx.train_cfg.advantage.weights or {}) if ctx.train_cfg is not None else {}
            self.rollouts.reward_weights = {n: float(weights.get(n, 1.0)) for n in cfg.trained_outputs(ctx.train_cfg)}
        # inner epochs of the current iteration (a likelihood-free objective may draw fresh noise per epoch)
        self._minibatches = ctx.train_cfg.optim.minibatches_per_epoch if ctx.train_cfg is not None else 1
        self._iteration, self._iteration_steps = None, 0
        self._before_grid: torch.Tensor | None = None
        if not self.policy.has_base_switch and cfg.eval.grid_prompts and not loads_on_meta(ctx):
            # (only the main process plots the grid: a process on the meta device has no weights to sample with)
            self._before_grid = self._grid_images()  # full tuning: no adapter to switch off later

    def _grad_reward(self, raw: list[tuple[str, Any]]):
        """``(images, prompts, metas) -> [n]``: the weighted sum of the trained outputs (``advantage.weights``) of the
        rewards' ``differentiable`` calls, with the graph to the images (the reference's training-reward ascent)."""
        weights = dict(self.ctx.train_cfg.advantage.weights or {}) if self.ctx.train_cfg is not None else {}
        trained = set(self.cfg.trained_outputs(self.ctx.train_cfg))
        from .preflight import reward_outputs

        fns = []
        for spec, (name, fn) in zip(self.cfg.rewards, raw):
            outputs = reward_outputs(spec.name, spec.kwargs)
            if outputs is not None and not trained.intersection(outputs):
                continue  # logged only
            if not hasattr(fn, "differentiable"):
                raise ConfigError(f"visgen.objective {self.objective.name}: reward {name!r} has no differentiable call")
            fns.append(fn)
        from .rewards.video import OffloadedReward

        # visgen.memory.offload_rewards: the models come to the device for each call, as the scoring path's
        places = [OffloadedReward(fn, self.ctx.device).offload if self.cfg.memory.offload_rewards else None for fn in fns]

        def reward(images: torch.Tensor, prompts: list[str], metas: list[dict]) -> torch.Tensor:
            total = images.new_zeros(images.shape[0])
            for fn, place in zip(fns, places):
                with place if place is not None else contextlib.nullcontext():
                    outputs = fn.differentiable(images, prompts, metas)
                for out, value in outputs.items():
                    if out in trained:
                        total = total + float(weights.get(out, 1.0)) * value.to(total)
            return total

        return reward

    # -------------------------------------------------------------------------------------------- setup helpers
    def _asset_settings(self, local: bool) -> dict:
        if not local:
            return {}
        path = Path(self.model_location) / "grove.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    def _load_prompts(self, settings: dict) -> None:
        cfg = self.cfg
        self.train_prompts, self.train_meta, self.eval_prompts, self.eval_meta = self.task.prompts(cfg, settings)
        if cfg.train_subset is not None:
            bad = [i for i in cfg.train_subset if not 0 <= i < len(self.train_prompts)]
            if bad or not cfg.train_subset:
                raise ConfigError(f"visgen.train_subset must list prompt indices in 0..{len(self.train_prompts) - 1}, "
                                  f"got {cfg.train_subset}")
            self.train_prompts = [self.train_prompts[i] for i in cfg.train_subset]
            self.train_meta = [self.train_meta[i] for i in cfg.train_subset]
        if cfg.eval.max_prompts and len(self.eval_prompts) > cfg.eval.max_prompts:
            # evenly spaced, so a short evaluation still covers every prompt kind of a sorted file
            step = len(self.eval_prompts) / cfg.eval.max_prompts
            keep = [int(i * step) for i in range(cfg.eval.max_prompts)]
            self.eval_prompts = [self.eval_prompts[i] for i in keep]
            self.eval_meta = [self.eval_meta[i] for i in keep]
        if not self.eval_prompts:
            self.ctx.log("visgen: no evaluation prompts (visgen.eval_prompts, or eval_prompts= in the Python API): "
                         "held-out evaluation is off; the summary reports the training rewards")

    def _sample_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_sequence_length": self.max_sequence_length}
        if self.height:
            kw.update(height=self.height, width=self.width)
        if getattr(self, "num_frames", None) and self.adapter.is_video:
            kw["num_frames"] = int(self.num_frames)
        kw.update(self.cfg.encode_options)
        return kw

    # -------------------------------------------------------------------------------------------- protocol
    def train_keys(self) -> list[int]:
        return list(range(len(self.train_prompts)))

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.policy.parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.policy.load_state_dict(state)

    def extra_state(self) -> dict[str, Any]:
        return self.policy.extra_state()

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.policy.load_extra_state(state)

    def after_optimizer_step(self) -> None:
        self.policy.update_ema()
        self.policy.old_policy_step()  # no-op unless the objective keeps an old policy (NFT, AWM)
        self._iteration_steps += 1
        self.rollouts.epoch = self._iteration_steps // max(self._minibatches, 1)

    def score(self, images: torch.Tensor, prompts: list[str], metas: list[dict],
              rewards: list[tuple[str, Any]] | None = None) -> dict[str, torch.Tensor]:
        """Every output of every reward for a batch of images (name -> ``[N]`` float32 on CPU)."""
        out: dict[str, torch.Tensor] = {}
        for name, fn in rewards if rewards is not None else self.rewards:
            for key, value in fn(images, prompts, metas).items():
                if key in out:
                    raise ConfigError(f"two rewards emit the output {key!r}; list each reward once")
                out[key] = torch.as_tensor(value, dtype=torch.float32).detach().cpu().reshape(-1)
        return out

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        """The configured method's rollout on the one engine (``visgen.rollout.VisgenRollouts.rollout``). The first
        call of an iteration soft-updates the old policy (NFT / AWM, ``FlowPolicy.sync_old_policy``) and restarts
        the inner-epoch count."""
        if iteration != self._iteration:
            self._iteration, self._iteration_steps, self.rollouts.epoch = iteration, 0, 0
            self.policy.sync_old_policy(iteration)
        return self.rollouts.rollout(keys, group_size, generator, iteration)

    supports_step_subsets = True  # optim.backward_steps: the recompute forwards only the asked steps

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool, steps: torch.Tensor | None = None
                  ) -> StepLogProbs:
        """Recompute the trained steps of edges ``idx`` (those of ``steps`` when given) with grad
        (``visgen.recompute``), plus the KL when asked."""
        return self.rollouts.log_probs(rollout, idx, need_kl, steps)

    def fsdp_modules(self) -> list[torch.nn.Module]:
        """FSDP2 units: the transformer's repeated blocks (its ``_no_split_modules``), then the transformer (and the
        full-tuning reference copy likewise); the refused settings raise ConfigError (``visgen.fsdp``)."""
        from .fsdp import fsdp_units

        return fsdp_units(self)

    def fsdp_sampling_modules(self) -> list[torch.nn.Module]:
        """The units rollouts and evaluation gather: the transformers that sample (``visgen.fsdp.sampling_modules``)."""
        from .fsdp import sampling_modules

        return sampling_modules(self)

    def trained_outputs(self) -> list[str]:
        """The reward outputs this run trains on (``VisgenConfig.trained_outputs`` under the trainer's sections)."""
        return self.cfg.trained_outputs(self.ctx.train_cfg)

    # -------------------------------------------------------------------------------------------- evaluation
    def _eval_settings(self) -> tuple[int, float]:
        e = self.cfg.eval
        steps = e.num_inference_steps or self.cfg.num_inference_steps
        guidance = self.cfg.guidance_scale if e.guidance_scale is None else e.guidance_scale
        return steps, guidance

    @torch.no_grad()
    def sample_ode(self, prompts: list[str], seed: int, batch_size: int | None = None) -> torch.Tensor:
        """Deterministic (ODE) images ``[N, 3, H, W]`` in [0, 1]; chunk j uses the generator seeded ``seed + j``,
        so the same prompts and seed give the same initial noise before and after training."""
        from .trajectory import sample as visgen_sample

        from shared_rl.metrics import Progress

        steps, guidance = self._eval_settings()
        batch_size = batch_size or self.cfg.eval.batch_size
        images = []
        progress = Progress(self.ctx.log, "ODE sampling (evaluation)", len(prompts), "images")
        for j, start in enumerate(range(0, len(prompts), batch_size)):
            generator = torch.Generator().manual_seed(seed + j)
            traj = visgen_sample(self.pipe, prompts[start:start + batch_size], steps, guidance, generator, "ode",
                                 decode=True, **self._sample_kwargs())
            images.append(traj.images.float().cpu())
            progress.update(min(len(prompts), start + batch_size))
        return torch.cat(images) if images else torch.zeros(0, 3, 1, 1)

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Held-out prompts, ODE sampling, fixed seeds: mean of every reward output (``eval/score``,
        ``eval/strict`` for the shapes reward, plus strict accuracy per prompt kind, and the task's own metrics)."""
        e = self.cfg.eval
        if not self.eval_prompts:
            return {}
        prompts = [p for p in self.eval_prompts for _ in range(e.samples_per_prompt)]
        metas = [m for m in self.eval_meta for _ in range(e.samples_per_prompt)]
        with self.policy.ema_weights() if e.use_ema else contextlib.nullcontext():
            images = self.sample_ode(prompts, e.seed)
        scores = self.score(images, prompts, metas, self.eval_rewards)
        out = {}
        for name, values in scores.items():
            ok = torch.isfinite(values)
            out[f"eval/{EVAL_NAMES.get(name, name)}"] = float(values[ok].mean()) if ok.any() else float("nan")
        out.update(self.task.eval_metrics(scores))
        if self.gold_rewards:  # held-out gold rewards on the same images (never trained on)
            from .rewards.gold import gold_metrics

            out.update(gold_metrics(self.score(images, prompts, metas, self.gold_rewards)))
        if "shapes_strict" in scores:
            kinds = [m.get("kind") for m in metas]
            for kind in ("single", "count", "pair"):
                sel = torch.tensor([k == kind for k in kinds])
                if sel.any():
                    out[f"eval/strict_{kind}"] = float(scores["shapes_strict"][sel].nanmean())
        return out

    # -------------------------------------------------------------------------------------------- outputs
    def _grid_prompts(self) -> list[str]:
        g = self.cfg.eval.grid_prompts
        pool = self.eval_prompts or self.train_prompts
        if not g or not pool:
            return []
        step = max(1, len(pool) // g)
        return pool[::step][:g]

    def _grid_images(self) -> torch.Tensor:
        prompts = [p for p in self._grid_prompts() for _ in range(self.cfg.eval.grid_samples)]
        return self.sample_ode(prompts, self.cfg.eval.seed + 777) if prompts else torch.zeros(0, 3, 1, 1)

    def _grid_captions(self, prompts: list[str], before: torch.Tensor, after: torch.Tensor) -> list[str]:
        """``prompt | reward before -> after`` per grid row: the evaluation rewards' outputs (at most three), each
        the mean over the row's samples."""
        pool = dict(zip(self.train_prompts, self.train_meta)) | dict(zip(self.eval_prompts, self.eval_meta))
        n = self.cfg.eval.grid_samples
        reps = [p for p in prompts for _ in range(n)]
        metas = [pool.get(p, {}) for p in reps]
        b, a = (self.score(x, reps, metas, self.eval_rewards) for x in (before, after))
        names = [k for k in b if k in a][:3]
        return [f"{p}  |  " + ", ".join(f"{k} {b[k][i * n:(i + 1) * n].nanmean():.2f} -> "
                                        f"{a[k][i * n:(i + 1) * n].nanmean():.2f}" for k in names)
                for i, p in enumerate(prompts)]

    def save_pretrained(self, out_dir: Path) -> None:
        # the resolved location: a path relative to the repo would not load from anywhere else; a base inside the
        # checkout (the project's assets) is also named relative to it, so the export loads in a checkout elsewhere
        from .export import checkout_relative

        info = {"base_model": self.model_location, "method": self.cfg.method_config(), "kernel": self.cfg.kernel,
                **({"base_model_in_checkout": rel} if (rel := checkout_relative(self.model_location)) else {}),
                "num_inference_steps": self.cfg.num_inference_steps, "guidance_scale": self.cfg.guidance_scale,
                "max_sequence_length": self.max_sequence_length, "resolution": self.height}
        self.policy.save_pretrained(Path(out_dir), use_ema=self.cfg.eval.use_ema, info=info)

    def on_train_end(self, run_dir: Path | None, history: list[dict[str, float]]) -> None:
        """Before/after sample grid (same prompts and seeds; "before" = the base model) and a short summary."""
        if run_dir is None:
            return
        run_dir = Path(run_dir)
        prompts = self._grid_prompts()
        if prompts:
            if self._before_grid is not None:
                before = self._before_grid
            else:
                with torch.no_grad(), self.policy.reference():
                    before = self._grid_images()
            with self.policy.ema_weights() if self.cfg.eval.use_ema else contextlib.nullcontext():
                after = self._grid_images()
            if before.dim() == 5:  # video clips [N, F, 3, H, W]: a GIF (and an MP4 when an encoder is installed)
                from .tasks.video import save_before_after_clips

                save_before_after_clips(before, after, prompts, self.cfg.eval.grid_samples, run_dir, fps=self.fps)
            else:
                save_before_after(before, after, prompts, self.cfg.eval.grid_samples,
                                  run_dir / "samples_before_after.png", self._grid_captions(prompts, before, after))
        evals = [r for r in history if any(k.startswith("eval/") for k in r)]
        lines = [f"visgen: {self.cfg.model} | kernel {self.cfg.kernel} | method {self.method.name} | "
                 f"{self.cfg.train_mode} ({sum(p.numel() for p in self.parameters()):,} trainable parameters)"]
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            for k in sorted(last):
                if k.startswith("eval/") and isinstance(first.get(k), (int, float)) and isinstance(last.get(k), (int, float)):
                    lines.append(f"{k}: {first[k]:.3f} (step {first['step']}) -> {last[k]:.3f} (step {last['step']})")
        from .pipelines.cache import prompt_cache

        stats = prompt_cache(self.pipe).stats()
        if stats["hits"] + stats["misses"]:
            lines.append(f"prompt cache: {stats['hits']:.0f} hits, {stats['misses']:.0f} misses (hit rate "
                         f"{stats['hit_rate']:.3f}), {stats['prompts']:.0f} prompts kept")
        timed = [r for r in history if "time/rollout" in r]
        if timed:
            total = sum(r.get("time/rollout", 0) + r.get("time/train", 0) + r.get("time/eval", 0) for r in timed)
            lines.append(f"iterations: {len(timed)}, rollout+train+eval time {total:.0f} s")
        if prompts:
            grid = "samples_before_after.gif/.mp4" if self.adapter.is_video else "samples_before_after.png"
            lines.append(f"grid: {grid} (left: before, right: after; one prompt per row, captioned)")
        if self.cfg.gold_rewards:  # the hacking guard: trained vs gold rewards, in curves.png and here
            from .rewards.gold import hacking_report

            lines += hacking_report(run_dir, history, self.trained_outputs(), self.ctx.log)
        (run_dir / "visgen_summary.txt").write_text("\n".join(lines) + "\n")


def save_before_after(before: torch.Tensor, after: torch.Tensor, prompts: list[str], per_prompt: int, path: Path,
                      captions: list[str] | None = None) -> None:
    """One row per prompt under its caption (default: the prompt): ``per_prompt`` "before" samples, a gap, the same
    seeds "after"; small images upscaled."""
    from shared_rl.report import captioned_rows

    rows = []
    h, w = before.shape[-2:]
    scale = max(1, math.ceil(128 / max(h, w)))
    gap = torch.full((3, h, max(2, w // 4)), 0.5)
    for i in range(len(prompts)):
        b = torch.cat(list(before[i * per_prompt:(i + 1) * per_prompt]), dim=2)
        a = torch.cat(list(after[i * per_prompt:(i + 1) * per_prompt]), dim=2)
        rows.append(torch.cat([b, gap, a], dim=2))
    grid = torch.stack(rows)
    if scale > 1:
        grid = torch.nn.functional.interpolate(grid, scale_factor=scale, mode="nearest")
    pixels = (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    captioned_rows(list(pixels), captions or list(prompts),
                   f"left: {per_prompt} before training | right: the same seeds after").save(path)
    path.with_suffix(".txt").write_text("left: before training, right: after (same seeds)\n" + "\n".join(
        f"row {i}: {c}" for i, c in enumerate(captions or prompts)) + "\n")
