"""Adapters over stock diffusers pipelines (SD3, FLUX, SANA): parity with the pipeline, recomputation, batching."""
from __future__ import annotations

import pytest
import torch
from .conftest import CALL_OPTIONS, PROMPTS, SIZES, build_sana, ready

import visgen
from visgen.pipelines import FluxAdapter, SanaAdapter, SD3Adapter, as_adapter
from visgen.plans import DanceGRPOPlan, MixGRPOPlan
from shared_rl.flow_kernels import sde_mean_kl
from visgen.recompute import recompute_trajectory
from visgen.trajectory import sample

STEPS = 4


def pipe_call(pipe, family, guidance, seed, output_type="latent", **extra):
    options = dict(CALL_OPTIONS[family])
    if family == "sana":
        options["use_resolution_binning"] = False
    size = SIZES[family]
    return pipe(
        PROMPTS, height=size, width=size, num_inference_steps=STEPS, guidance_scale=guidance,
        generator=torch.Generator().manual_seed(seed), output_type=output_type, num_images_per_prompt=2,
        **options, **extra,
    ).images


def visgen_sample(pipe, family, guidance, seed, kernel="ode", **extra):
    size = SIZES[family]
    return sample(
        pipe, PROMPTS, STEPS, guidance, torch.Generator().manual_seed(seed), kernel=kernel,
        num_images_per_prompt=2, height=size, width=size, **CALL_OPTIONS[family], **extra,
    )


def test_as_adapter_dispatch(sd3_pipe, flux_pipe, sana_pipe):
    assert isinstance(as_adapter(sd3_pipe), SD3Adapter)
    assert isinstance(as_adapter(flux_pipe), FluxAdapter)
    assert isinstance(as_adapter(sana_pipe), SanaAdapter)
    adapter = as_adapter(sd3_pipe)
    assert as_adapter(adapter) is adapter
    with pytest.raises(TypeError, match="no visgen adapter"):
        as_adapter(object())


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_ode_reproduces_stock_pipeline_bit_for_bit(tiny_pipe, family, guidance):
    expected = pipe_call(tiny_pipe, family, guidance, seed=3)
    traj = visgen_sample(tiny_pipe, family, guidance, seed=3)
    assert traj.final_latents.shape == expected.shape
    assert torch.equal(traj.final_latents, expected.float())
    assert traj.log_probs.abs().sum() == 0 and not traj.sde_mask.any()
    # CFG counts two forwards (SD3/SANA); FLUX uses a guidance embedding: one forward
    per_step = 2 if guidance > 1 and family != "flux" else 1
    assert traj.nfe == 4 * STEPS * per_step and traj.nfe_per_sample == STEPS * per_step


def test_decoded_images_match_pipeline(tiny_pipe, family):
    expected = pipe_call(tiny_pipe, family, 1.0, seed=4, output_type="pt")
    traj = visgen_sample(tiny_pipe, family, 1.0, seed=4, decode=True)
    assert traj.images.shape == expected.shape and traj.images.shape[1] == 3
    assert traj.images.min() >= 0 and traj.images.max() <= 1
    assert torch.equal(traj.images, expected.float())


def test_flux_true_cfg_matches_pipeline(flux_pipe):
    expected = pipe_call(flux_pipe, "flux", 2.0, seed=5, true_cfg_scale=2.5, negative_prompt=["photo", "photo"])
    traj = visgen_sample(flux_pipe, "flux", 2.0, seed=5, true_cfg_scale=2.5, negative_prompt=["photo", "photo"])
    assert torch.equal(traj.final_latents, expected)
    assert traj.nfe_per_sample == 2 * STEPS


@pytest.mark.parametrize("kernel", ["sde", "cps", "dance"])
def test_noise_level_zero_sampling_equals_ode(sd3_pipe, kernel):
    ode = visgen_sample(sd3_pipe, "sd3", 3.0, seed=6)
    stochastic = visgen_sample(sd3_pipe, "sd3", 3.0, seed=6, kernel=kernel, noise_level=0.0)
    assert torch.equal(stochastic.latents, ode.latents)
    assert stochastic.log_probs.abs().sum() == 0


@pytest.mark.parametrize("kernel", ["sde", "cps", "dance"])
def test_recompute_reproduces_log_probs_exactly(tiny_pipe, family, kernel):
    traj = visgen_sample(tiny_pipe, family, 3.0, seed=7, kernel=kernel)
    assert traj.sde_mask.all() and traj.train_mask[:, :-1].all() and not traj.train_mask[:, -1].any()
    stochastic_steps = traj.log_probs[:, :-1] if kernel == "cps" else traj.log_probs
    assert (stochastic_steps != 0).all()
    recomputed = recompute_trajectory(tiny_pipe, traj, list(range(STEPS)))
    assert recomputed.logp.requires_grad
    ratio = torch.exp(recomputed.logp - traj.log_probs)
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert torch.equal(recomputed.entropy, traj.entropies())
    assert recomputed.nfe == traj.nfe


def test_recompute_gradient_reaches_the_transformer(sd3_pipe):
    traj = visgen_sample(sd3_pipe, "sd3", 1.0, seed=8, kernel="sde")
    sd3_pipe.transformer.zero_grad()
    recompute_trajectory(sd3_pipe, traj, [0, 1]).logp.sum().backward()
    grads = [p.grad for p in sd3_pipe.transformer.parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    sd3_pipe.transformer.zero_grad(set_to_none=True)


def test_micro_batches_match_whole_batch(tiny_pipe, family):
    whole = visgen_sample(tiny_pipe, family, 3.0, seed=9, kernel="sde", keep_means=True)
    for micro in (1, 3):
        split = visgen_sample(tiny_pipe, family, 3.0, seed=9, kernel="sde", micro_batch_size=micro)
        assert torch.allclose(split.latents, whole.latents, atol=1e-5)
        assert torch.allclose(split.log_probs, whole.log_probs, atol=1e-5)
        assert split.nfe == whole.nfe
    # recomputing a rollout micro-batch with the same layout is exact
    split = visgen_sample(tiny_pipe, family, 3.0, seed=9, kernel="sde", micro_batch_size=2)
    for rows in (slice(0, 2), slice(2, 4)):
        part = split[rows]
        assert torch.equal(recompute_trajectory(tiny_pipe, part, list(range(STEPS))).logp, part.log_probs)
    # a different layout (rows of two rollout micro-batches in one call per step) agrees to float tolerance
    assert torch.allclose(recompute_trajectory(tiny_pipe, split, [0, 2]).logp[:, [0, 2]], split.log_probs[:, [0, 2]],
                          atol=1e-4)


def test_per_sample_step_indices_and_kl(sd3_pipe):
    plan = DanceGRPOPlan(train_fraction=0.5)
    traj = visgen_sample(sd3_pipe, "sd3", 1.0, seed=10, kernel="dance", plan=plan, keep_means=True)
    steps = torch.stack([torch.nonzero(row).flatten()[:2] for row in traj.train_mask])  # [4, 2], per sample
    assert len({tuple(r.tolist()) for r in steps}) > 1
    import contextlib

    out = recompute_trajectory(sd3_pipe, traj, steps, reference=contextlib.nullcontext)
    rows = torch.arange(4).unsqueeze(1)
    assert torch.allclose(out.logp[rows, steps], traj.log_probs[rows, steps], atol=1e-4)
    assert (out.logp.ne(0).sum(1) == 2).all()  # only the asked steps
    # the reference is the same model here: the Gaussian-mean KL of every recomputed step is 0
    assert out.kl.shape == (4, STEPS) and out.kl.abs().max() < 1e-6
    # means were kept while sampling: the step Gaussians the KL compares
    std = traj.stds[rows, steps][:, 0]
    assert sde_mean_kl(traj.means[rows, steps][:, 0], traj.means[rows, steps][:, 0], std).abs().max() == 0


def test_mix_grpo_plan_runs_ode_outside_the_window(sd3_pipe):
    ode = visgen_sample(sd3_pipe, "sd3", 1.0, seed=11)
    plan = MixGRPOPlan(window_size=2, iters_per_shift=1)
    traj = visgen_sample(sd3_pipe, "sd3", 1.0, seed=11, kernel="sde", plan=plan, iteration=1)
    assert traj.sde_mask[0].tolist() == [False, True, True, False] == traj.train_mask[0].tolist()
    assert torch.equal(traj.latents[:, :2], ode.latents[:, :2])  # identical until the window starts
    assert not torch.equal(traj.latents[:, 2], ode.latents[:, 2])
    assert (traj.log_probs[:, [0, 3]] == 0).all() and (traj.log_probs[:, [1, 2]] != 0).all()


def test_trajectory_layout_and_indexing(flux_pipe):
    traj = visgen_sample(flux_pipe, "flux", 3.5, seed=12, kernel="sde")
    assert traj.latents.shape == (4, STEPS + 1, 16, 16)  # packed FLUX tokens: (16/2/2)^2 = 16 tokens of 4*4 ch
    assert traj.sigmas.shape == (STEPS + 1,) and traj.sigmas[-1] == 0 and traj.sigmas[0] == 1
    assert traj.prompts == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    part = traj[torch.tensor([1, 3])]
    assert part.batch_size == 2 and part.prompts == [PROMPTS[0], PROMPTS[1]]
    assert torch.equal(part.latents, traj.latents[[1, 3]]) and len(part.cond) == 2
    assert traj.entropies().shape == (4, STEPS) and (traj.entropies() != 0).all()
    adapter = as_adapter(flux_pipe)
    image_latents = adapter.unpack(traj.final_latents, traj.cond)
    assert image_latents.shape == (4, 4, 8, 8) and torch.equal(adapter.pack(image_latents), traj.final_latents)


def test_per_sample_generators_make_samples_independent_of_the_batch(sd3_pipe):
    gens = [torch.Generator().manual_seed(100 + i) for i in range(2)]
    both = sample(sd3_pipe, ["a red square"] * 2, STEPS, 1.0, gens, height=16, width=16, max_sequence_length=4)
    alone = sample(sd3_pipe, "a red square", STEPS, 1.0, [torch.Generator().manual_seed(101)], height=16, width=16,
                   max_sequence_length=4)
    assert torch.allclose(both.latents[1], alone.latents[0], atol=1e-5)
    assert torch.allclose(both.log_probs[1], alone.log_probs[0], atol=1e-5)


def test_sana_with_dpm_solver_scheduler_uses_its_flow_sigmas():
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    pipe = ready(build_sana(scheduler))
    adapter = as_adapter(pipe)
    cond = adapter.encode_prompts(PROMPTS, guidance_scale=1.0, max_sequence_length=6, complex_human_instruction=None)
    sigmas, timesteps = adapter.schedule(STEPS, cond)
    scheduler.set_timesteps(STEPS)
    assert torch.equal(sigmas, scheduler.sigmas.float()) and sigmas[-1] == 0 and sigmas[0] < 1
    assert torch.equal(timesteps, scheduler.timesteps.float())
    traj = sample(pipe, PROMPTS, STEPS, 1.0, torch.Generator().manual_seed(0), height=32, width=32,
                  max_sequence_length=6, complex_human_instruction=None)
    assert torch.isfinite(traj.log_probs).all()


def test_non_flow_scheduler_is_rejected():
    from diffusers import DDIMScheduler

    pipe = ready(build_sana(DDIMScheduler()))
    with pytest.raises(ValueError, match="not a flow-matching scheduler"):
        sample(pipe, PROMPTS, STEPS, 1.0, torch.Generator().manual_seed(0), height=32, width=32,
               max_sequence_length=6, complex_human_instruction=None)


def test_public_api_is_exported():
    assert visgen.sample is sample and visgen.recompute_trajectory is recompute_trajectory
