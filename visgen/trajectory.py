"""``visgen.sample``: batched denoising trajectories with per-step log-probs over stock diffusers pipelines.

``sample`` is the public face of the one rollout engine (``visgen.engine``): it grows the flat, depth-one forest
of a step plan — one transformer forward per step for the whole batch (or per micro-batch), the plan deciding per
sample and step whether the step is stochastic (the chosen kernel) or deterministic (Euler ODE) and whether it is
trained — and returns it as a :class:`Trajectory`. Training recomputes stored steps through
``visgen.recompute.recompute_edges`` (the same ``flow_step`` code path), which for the same batch layout equals the
stored log-probs bit for bit (importance ratio exactly 1).

Random numbers, all from ``generator``: first the initial noise (exactly as the pipeline draws it), then the step
plan if it is random and no ``plan_generator`` is given, then one full-batch standard-normal tensor per denoising
step (drawn at every step unless the kernel is ``ode``, so the same generator gives the same step noise whatever
the plan). Noise is drawn for the whole batch before splitting into micro-batches, so the micro-batch size does
not change which noise a sample gets.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from shared_rl.flow_kernels import KERNEL_NOISE_LEVELS, REDUCTIONS, gaussian_entropy, get_kernel

from .engine import flat_forest, forest_payload
from .pipelines import Conditioning, FlowPipelineAdapter, as_adapter
from .plans import FlowGRPOPlan, ODEPlan, PlanSpec, StepPlan, plan_from_config

__all__ = ["Trajectory", "sample"]


@dataclass
class Trajectory:
    """B sampled denoising chains of T steps.

    latents: ``[B, T+1, *latent]`` float32, ``latents[:, 0]`` the initial noise, ``latents[:, -1]`` the final latent
        (model layout: ``[C, h, w]`` for SD3/SANA, packed ``[N, 4C]`` tokens for FLUX).
    log_probs: ``[B, T]`` behaviour log-probs of each step (0 on deterministic steps).
    stds: ``[B, T]`` transition std of each step (0 on deterministic steps).
    sde_mask / train_mask: ``[B, T]`` the step plan (stochastic steps / trained steps).
    sigmas: ``[T+1]`` float32, from 1-ish to 0; timesteps: ``[T]`` the scheduler timesteps given to the model.
    cond: the prompt embeddings per sample (what the velocity call needs), plus guidance settings.
    kernel, noise_level, reduction: the kernel settings (needed to recompute log-probs).
    payload: what ``visgen.recompute.recompute_trajectory`` reads (the engine's per-step records of these chains).
    prompts: the prompt of each sample; nfe: model forward evaluations spent (per sample per call; CFG counts 2).
    means: ``[B, T, *latent]`` step means when ``keep_means`` was set, else None.
    images: ``[B, 3, H, W]`` in [0, 1] when decoding was asked for, else None.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    stds: torch.Tensor
    sde_mask: torch.Tensor
    train_mask: torch.Tensor
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    cond: Conditioning
    kernel: str
    noise_level: float
    reduction: str
    prompts: list[str]
    nfe: int
    payload: dict[str, Any]
    means: torch.Tensor | None = None
    images: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.log_probs.shape[1])

    @property
    def final_latents(self) -> torch.Tensor:
        return self.latents[:, -1]

    @property
    def plan(self) -> StepPlan:
        return StepPlan(self.sde_mask, self.train_mask)

    @property
    def nfe_per_sample(self) -> float:
        return self.nfe / max(self.batch_size, 1)

    def entropies(self) -> torch.Tensor:
        """``[B, T]`` analytic Gaussian entropy of each step (per element for mean reduction; E-GRPO)."""
        numel = int(self.latents[0, 0].numel())
        flat = self.stds.reshape(-1)
        return gaussian_entropy(flat, numel, self.reduction).reshape(self.stds.shape)

    def __getitem__(self, idx: Any) -> "Trajectory":
        """The sub-batch ``idx`` (slice, index list or tensor); nfe is prorated."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        device_idx = idx.to(self.latents.device) if isinstance(idx, torch.Tensor) else idx
        rows = torch.arange(self.batch_size)[idx.cpu() if isinstance(idx, torch.Tensor) else idx].tolist()
        return replace(
            self,
            latents=self.latents[device_idx],
            log_probs=self.log_probs[device_idx],
            stds=self.stds[device_idx],
            sde_mask=self.sde_mask[device_idx],
            train_mask=self.train_mask[device_idx],
            cond=self.cond[device_idx],
            payload=_rows(self.payload, torch.as_tensor(rows, dtype=torch.long)),
            prompts=[self.prompts[i] for i in rows],
            nfe=int(round(self.nfe * len(rows) / max(self.batch_size, 1))),
            means=None if self.means is None else self.means[device_idx],
            images=None if self.images is None else self.images[device_idx],
        )


def _rows(payload: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    return {k: _rows(v, rows) if isinstance(v, dict) else v[rows.to(v.device)] for k, v in payload.items()}


def _build_plan(
    plan: StepPlan | PlanSpec | dict | str | None,
    kernel: str,
    num_steps: int,
    batch_size: int,
    generator: torch.Generator | None,
    iteration: int,
) -> StepPlan:
    if plan is None:
        plan = ODEPlan() if kernel == "ode" else FlowGRPOPlan()
    if not isinstance(plan, StepPlan):
        plan = plan_from_config(plan).build(num_steps, batch_size, generator, iteration)
    if plan.sde.shape != (batch_size, num_steps):
        raise ValueError(f"step plan is {tuple(plan.sde.shape)}, expected (batch={batch_size}, steps={num_steps})")
    return plan


@torch.no_grad()
def sample(
    pipe: Any,
    prompt: str | Sequence[str],
    num_inference_steps: int = 10,
    guidance_scale: float | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    kernel: str = "sde",
    noise_level: float | None = None,
    plan: StepPlan | PlanSpec | dict | str | None = None,
    *,
    num_images_per_prompt: int = 1,
    height: int | None = None,
    width: int | None = None,
    negative_prompt: str | list[str] | None = None,
    max_sequence_length: int | None = None,
    sigmas: list[float] | None = None,
    mu: float | None = None,
    latents: torch.Tensor | None = None,
    shared_noise: bool = False,
    micro_batch_size: int | None = None,
    decode: bool = False,
    reduction: str = "mean",
    keep_means: bool = False,
    iteration: int = 0,
    plan_generator: torch.Generator | None = None,
    **encode_options: Any,
) -> Trajectory:
    """Sample ``len(prompts) * num_images_per_prompt`` denoising chains with per-step log-probs (no grad).

    Args:
        pipe: a stock ``StableDiffusion3Pipeline`` / ``FluxPipeline`` / ``SanaPipeline`` or an adapter over one.
        prompt: a prompt or a list; samples are ordered like the pipeline's batch (each prompt repeated
            ``num_images_per_prompt`` times in a row).
        guidance_scale: None uses the pipeline's default. SD3/SANA: CFG when > 1 (2 forwards per step); FLUX: the
            guidance embedding (true CFG via ``true_cfg_scale=`` and ``negative_prompt``).
        generator: a ``torch.Generator`` (or one per sample), consumed as described in the module docstring.
        kernel: ``ode``, ``sde`` (Flow-GRPO), ``cps`` or ``dance`` (DanceGRPO) for the stochastic steps.
        noise_level: the kernel's noise level (None: ``flow_kernels.KERNEL_NOISE_LEVELS``).
        plan: a built ``StepPlan``, a plan spec / config dict / name, or None (``ode`` kernel: all deterministic;
            otherwise Flow-GRPO: all steps stochastic, all but the last trained).
        latents: initial noise to start from instead of drawing it (model layout, ``[B, ...]``).
        shared_noise: draw one initial noise per prompt and give it to all ``num_images_per_prompt`` samples of that
            prompt (DanceGRPO's shared group noise: samples then differ only by their SDE steps).
        micro_batch_size: split each step's forward into chunks of this many samples (None: whole batch).
        decode: also decode the final latents into ``images`` in [0, 1].
        reduction: ``mean`` (Flow-GRPO/DDPO convention) or ``sum`` over latent elements for log-probs.
        keep_means: store the ``[B, T, ...]`` step means (for KL to a reference or debugging).
        iteration, plan_generator: passed to the plan spec's ``build`` (MixGRPO moves with the iteration).
        encode_options: model-specific prompt-encoding options (SD3 ``clip_skip``; FLUX ``true_cfg_scale``;
            SANA ``complex_human_instruction``, ``clean_caption``).
    """
    adapter: FlowPipelineAdapter = as_adapter(pipe)
    get_kernel(kernel)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    noise_level = KERNEL_NOISE_LEVELS[kernel] if noise_level is None else float(noise_level)
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    batch_size = len(prompts) * num_images_per_prompt
    if isinstance(generator, list) and len(generator) != batch_size:
        raise ValueError(f"got {len(generator)} generators for {batch_size} samples")

    cond = adapter.encode_prompts(
        prompts,
        num_images_per_prompt=num_images_per_prompt,
        guidance_scale=guidance_scale,
        negative_prompt=negative_prompt,
        max_sequence_length=max_sequence_length,
        height=height,
        width=width,
        **encode_options,
    )
    if latents is not None:
        x = latents.float().to(adapter.device)
    elif shared_noise:
        noise_generator = generator[::num_images_per_prompt] if isinstance(generator, list) else generator
        per_prompt = cond[slice(0, batch_size, num_images_per_prompt)]
        x = adapter.prepare_latents(len(prompts), per_prompt, noise_generator).repeat_interleave(num_images_per_prompt, 0)
    else:
        x = adapter.prepare_latents(batch_size, cond, generator)
    if x.shape[0] != batch_size:
        raise ValueError(f"initial latents have batch {x.shape[0]}, expected {batch_size}")
    sigma_grid, timesteps = adapter.schedule(num_inference_steps, cond, sigmas=sigmas, mu=mu)
    num_steps = int(timesteps.shape[0])
    if plan_generator is None and isinstance(generator, torch.Generator):
        plan_generator = generator
    step_plan = _build_plan(plan, kernel, num_steps, batch_size, plan_generator, iteration)

    forest = flat_forest(adapter, cond, x, step_plan.sde, step_plan.train, sigma_grid, timesteps, generator, kernel,
                         noise_level, reduction, micro_batch_size or 0, keep_means=keep_means)
    leaves = forest.leaves().to(x.device)
    final = forest.node_latent[leaves]
    images = None
    if decode:
        size = micro_batch_size or batch_size
        images = torch.cat([adapter.decode(final[i:i + size], cond[torch.arange(i, min(i + size, batch_size))])
                            for i in range(0, batch_size, size)])
    rows = leaves.cpu()
    return Trajectory(
        latents=forest.latents[leaves],
        log_probs=forest.logp[rows].to(x.device),
        stds=forest.std[rows].to(x.device),
        sde_mask=step_plan.sde.to(x.device),
        train_mask=step_plan.train.to(x.device),
        sigmas=sigma_grid,
        timesteps=timesteps,
        cond=cond,
        kernel=kernel,
        noise_level=noise_level,
        reduction=reduction,
        prompts=[p for p in prompts for _ in range(num_images_per_prompt)],
        nfe=forest.nfe,
        payload=forest_payload(forest, dict(cond.tensors), rows),
        means=None if forest.means is None else forest.means[leaves],
        images=images,
    )
