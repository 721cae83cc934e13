"""Batched denoising trajectories with per-step log-probs over stock diffusers pipelines, and their recomputation.

``sample`` runs the denoising chain of a pipeline through its adapter: one transformer forward per step for the
whole batch (or per micro-batch), a step plan deciding per sample and step whether the step is stochastic (the
chosen kernel) or deterministic (Euler ODE) and whether it is trained. It records everything needed to recompute
the behaviour log-probs with grad: all latents, the sigmas/timesteps, the plan, the kernel settings and the prompt
embeddings. ``recompute_log_probs`` re-runs the same step computation (the same ``flow_step`` code path) with grad;
for the same batch layout the result equals the stored log-probs bit for bit (importance ratio exactly 1).

Random numbers, all from ``generator``: first the initial noise (exactly as the pipeline draws it), then the step
plan if it is random and no ``plan_generator`` is given, then one full-batch standard-normal tensor per denoising
step (drawn at every step unless the sampler is ``ode``, so the same generator gives the same step noise whatever
the plan). Noise is drawn for the whole batch before splitting into micro-batches, so the micro-batch size does
not change which noise a sample gets.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Sequence

import torch
from diffusers.utils.torch_utils import randn_tensor

from .pipelines import Conditioning, FlowPipelineAdapter, as_adapter
from .plans import FlowGRPOPlan, ODEPlan, PlanSpec, StepPlan, plan_from_config
from shared_rl.flow_kernels import DEFAULT_NOISE_LEVEL, REDUCTIONS, flow_step, gaussian_entropy, get_kernel

__all__ = ["Trajectory", "RecomputedSteps", "sample", "recompute_log_probs"]


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
    sampler, noise_level, reduction: the kernel settings (needed to recompute log-probs).
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
    sampler: str
    noise_level: float
    reduction: str
    prompts: list[str]
    nfe: int
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
            prompts=[self.prompts[i] for i in rows],
            nfe=int(round(self.nfe * len(rows) / max(self.batch_size, 1))),
            means=None if self.means is None else self.means[device_idx],
            images=None if self.images is None else self.images[device_idx],
        )


def _chunks(n: int, size: int | None) -> list[slice]:
    size = n if not size or size >= n else size
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _build_plan(
    plan: StepPlan | PlanSpec | dict | str | None,
    sampler: str,
    num_steps: int,
    batch_size: int,
    generator: torch.Generator | None,
    iteration: int,
) -> StepPlan:
    if plan is None:
        plan = ODEPlan() if sampler == "ode" else FlowGRPOPlan()
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
    sampler: str = "sde",
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
        sampler: ``ode``, ``sde`` (Flow-GRPO), ``cps`` or ``dance`` (DanceGRPO) for the stochastic steps.
        noise_level: the kernel's noise level (None: 0.7 for sde/cps, 0.3 for dance).
        plan: a built ``StepPlan``, a plan spec / config dict / name, or None (``ode`` sampler: all deterministic;
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
    get_kernel(sampler)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    noise_level = DEFAULT_NOISE_LEVEL[sampler] if noise_level is None else float(noise_level)
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
    step_plan = _build_plan(plan, sampler, num_steps, batch_size, plan_generator, iteration)
    sde_mask = step_plan.sde.to(x.device)

    device = x.device
    all_latents = torch.empty((batch_size, num_steps + 1, *x.shape[1:]), dtype=torch.float32, device=device)
    all_latents[:, 0] = x
    log_probs = torch.zeros(batch_size, num_steps, dtype=torch.float32, device=device)
    stds = torch.zeros(batch_size, num_steps, dtype=torch.float32, device=device)
    means = torch.empty_like(all_latents[:, 1:]) if keep_means else None
    chunks = _chunks(batch_size, micro_batch_size)
    chunk_conds = [cond[c] for c in chunks]
    forwards = 0
    for i in range(num_steps):
        noise = None
        if sampler != "ode":
            noise = randn_tensor(tuple(x.shape), generator=generator, device=device, dtype=torch.float32)
        t = timesteps[i].expand(batch_size)
        next_x = torch.empty_like(x)
        for c, c_cond in zip(chunks, chunk_conds):
            v = adapter.velocity(x[c], t[c], c_cond)
            out = flow_step(
                sampler, x[c], v, sigma_grid[i], sigma_grid[i + 1], noise_level,
                noise=None if noise is None else noise[c], stochastic=sde_mask[c, i], reduction=reduction,
            )
            next_x[c] = out.next_sample
            log_probs[c, i] = out.log_prob
            stds[c, i] = out.std.reshape(-1)
            if means is not None:
                means[c, i] = out.mean
            forwards += adapter.forwards_per_step(c_cond) * (c.stop - c.start)
        x = next_x
        all_latents[:, i + 1] = x

    images = None
    if decode:
        images = torch.cat([adapter.decode(x[c], c_cond) for c, c_cond in zip(chunks, chunk_conds)])
    return Trajectory(
        latents=all_latents,
        log_probs=log_probs,
        stds=stds,
        sde_mask=sde_mask,
        train_mask=step_plan.train.to(device),
        sigmas=sigma_grid,
        timesteps=timesteps,
        cond=cond,
        sampler=sampler,
        noise_level=noise_level,
        reduction=reduction,
        prompts=[p for p in prompts for _ in range(num_images_per_prompt)],
        nfe=forwards,
        means=means,
        images=images,
    )


class RecomputedSteps(NamedTuple):
    """log_prob, std: ``[n, k]``; mean: ``[n, k, *latent]`` (with grad) when asked for, else None; nfe: forwards."""

    log_prob: torch.Tensor
    std: torch.Tensor
    mean: torch.Tensor | None
    nfe: int


def recompute_log_probs(
    pipe: Any,
    traj: Trajectory,
    step_indices: int | Sequence[int] | torch.Tensor,
    *,
    return_means: bool = False,
) -> RecomputedSteps:
    """Log-probs of stored transitions ``latents[:, s] -> latents[:, s+1]`` under the current model, with grad.

    ``step_indices``: an int, a ``[k]`` list/tensor (the same steps for every sample) or an ``[n, k]`` tensor (per
    sample, e.g. DanceGRPO's random subsets). Column ``j`` is one batched forward over the ``n`` samples of ``traj``
    (pass a sub-trajectory ``traj[idx]`` for a minibatch). For the same batch layout as the rollout (same samples
    per forward, same step), the result equals ``traj.log_probs`` exactly: the same ``flow_step`` code computes the
    mean from the same inputs and scores the stored next latent. Grad flows into the model through ``v``.
    """
    adapter = as_adapter(pipe)
    n = traj.batch_size
    device = traj.latents.device
    steps = torch.as_tensor(step_indices, dtype=torch.long, device=device)
    if steps.dim() == 0:
        steps = steps.view(1)
    if steps.dim() == 1:
        steps = steps.unsqueeze(0).expand(n, -1)
    if steps.shape[0] != n:
        raise ValueError(f"step_indices has {steps.shape[0]} rows for a trajectory of {n} samples")
    if bool((steps < 0).any()) or bool((steps >= traj.num_steps).any()):
        raise ValueError(f"step_indices must be in 0..{traj.num_steps - 1}")
    rows = torch.arange(n, device=device)
    log_probs, stds, means = [], [], []
    forwards = 0
    for j in range(steps.shape[1]):
        s = steps[:, j]
        x = traj.latents[rows, s]
        x_next = traj.latents[rows, s + 1]
        v = adapter.velocity(x, traj.timesteps[s], traj.cond)
        out = flow_step(
            traj.sampler, x, v, traj.sigmas[s], traj.sigmas[s + 1], traj.noise_level,
            next_sample=x_next, stochastic=traj.sde_mask[rows, s], reduction=traj.reduction,
        )
        log_probs.append(out.log_prob)
        stds.append(out.std.reshape(-1))
        if return_means:
            means.append(out.mean)
        forwards += adapter.forwards_per_step(traj.cond) * n
    return RecomputedSteps(
        log_prob=torch.stack(log_probs, 1),
        std=torch.stack(stds, 1),
        mean=torch.stack(means, 1) if return_means else None,
        nfe=forwards,
    )
