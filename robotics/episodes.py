"""The batched closed-loop episode runner shared by RL rollouts, evaluation and behaviour cloning.

All envs of a batch step in lock-step by action chunk: the policy sees the frame rendered after the previous
chunk (rendering happens only when a new chunk is planned), plans the next K actions for every unfinished env
in one batched forward, and the vector env executes them. What a rollout needs to recompute log-probs later is
recorded per chunk: the observation, the denoising chain (flow head) or the sampled bins (discrete head), which
denoising steps were stochastic, and their behaviour log-probs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from shared_rl.flow_kernels import DEFAULT_NOISE_LEVEL

from .envs.metaworld_env import instruction_for
from .policies.vla import TinyVLA

HeadMode = Literal["ode", "flow_sde", "flow_noise", "sde_one_step", "discrete", "greedy"]


@dataclass
class SamplingSettings:
    mode: HeadMode = "flow_sde"
    noise_level: float = DEFAULT_NOISE_LEVEL  # Flow-GRPO a
    temperature: float = 1.0  # discrete head
    logp_reduce: Literal["sum", "mean"] = "sum"
    init_noise: float = 1.0  # flow head: std of the chain's starting point (0 = start at the origin)


@dataclass
class EpisodeBatch:
    """B episodes of at most C chunks. S = steps recorded per chunk (denoising steps, or 1 for discrete)."""

    keys: list[int]
    tasks: list[str]
    images: np.ndarray  # [B, C, H, W, Ch] uint8, observation at each chunk start
    proprio: np.ndarray  # [B, C, P] float32
    chain: np.ndarray  # [B, C, S+1, D] float32 (flow) or [B, C, 1, D] int bins (discrete)
    stochastic: np.ndarray  # [B, C, S] bool
    logp: np.ndarray  # [B, C, S] float32
    chunk_valid: np.ndarray  # [B, C] bool, chunk was planned and executed
    success_once: np.ndarray  # [B] bool
    success_end: np.ndarray  # [B] bool
    dense: np.ndarray  # [B] float32 best Meta-World shaped reward / 10 over executed steps (in [0, 1])
    length: np.ndarray  # [B] int, env steps executed
    nfe: int  # policy forward evaluations (per sample)
    frames: list[list[np.ndarray]] | None = None  # per env, the frames seen (for GIFs)


def sample_chunk(policy: TinyVLA, h: torch.Tensor, s: SamplingSettings, generator: torch.Generator | None,
                 start_noise: torch.Tensor | None = None):
    """One action chunk per row. Returns (actions [B,K,A], chain, stochastic [B,S], logp [B,S], nfe per row).
    ``start_noise`` [B, D]: the flow chain's standard-normal start per row (else drawn from ``generator``)."""
    cfg = policy.cfg
    b = h.shape[0]
    if cfg.head == "flow":
        if s.mode not in ("ode", "flow_sde", "flow_noise", "sde_one_step"):
            raise ValueError(f"a flow head samples with ode/flow_sde/flow_noise/sde_one_step, not {s.mode!r}")
        out = policy.flow.sample(h, s.mode, generator, s.noise_level, s.logp_reduce, s.init_noise, start_noise)
        acts = out.actions.view(b, cfg.chunk, cfg.action_dim)
        return acts, out.chain, out.stochastic, out.logp, cfg.num_denoise_steps
    if s.mode not in ("discrete", "greedy"):
        raise ValueError(f"a discrete head samples with discrete (temperature) or greedy, not {s.mode!r}")
    logits = policy.bin_logits(h)  # [B, D, bins]
    if s.mode == "greedy":
        bins = logits.argmax(-1)
        logp = torch.zeros(b, 1)
        stoch = torch.zeros(b, 1, dtype=torch.bool)
    else:
        logq = torch.log_softmax(logits / s.temperature, -1)
        bins = torch.multinomial(logq.exp().view(-1, cfg.num_bins), 1, generator=generator).view(b, -1)
        lp = logq.gather(-1, bins[..., None]).squeeze(-1)
        logp = (lp.sum(-1) if s.logp_reduce == "sum" else lp.mean(-1))[:, None]
        stoch = torch.ones(b, 1, dtype=torch.bool)
    acts = policy.bin_centers(h.device)[bins].view(b, cfg.chunk, cfg.action_dim)
    return acts, bins[:, None, :], stoch, logp, 1


@torch.no_grad()
def run_episodes(
    policy: TinyVLA,
    venv,
    keys: list[int],
    tasks: list[str],
    sampling: SamplingSettings,
    horizon: int,
    generator: torch.Generator | None = None,
    record_frames: bool = False,
    device: torch.device | str = "cpu",
    episode_noise_seed: int | None = None,
) -> EpisodeBatch:
    """Run one episode per key (``tasks[i]`` is the task of ``keys[i]``) to the end; batched over envs.

    ``episode_noise_seed``: the flow chain's start noise of episode i comes from its own generator, seeded by
    (``episode_noise_seed``, ``keys[i]``), instead of one stream shared by the batch. With the shared stream an
    episode's draws shift whenever any other episode ends earlier or later, so one task's evaluation moved when
    only another task's policy changed; per episode, an ODE evaluation of a key is a function of the weights its
    task uses, its key and the seed alone. (Evaluation: one episode per key; SDE draws stay on ``generator``.)"""
    cfg = policy.cfg
    b, k = len(keys), cfg.chunk
    n_chunks = math.ceil(horizon / k)
    steps = cfg.num_denoise_steps if cfg.head == "flow" else 1
    d = cfg.chunk * cfg.action_dim
    starts = None
    if episode_noise_seed is not None and cfg.head == "flow":
        starts = torch.stack([torch.randn(n_chunks, d, generator=torch.Generator().manual_seed(
            int(np.random.SeedSequence([episode_noise_seed, int(key)]).generate_state(1)[0]))) for key in keys])
    obs = venv.reset(keys)
    img, pro = obs["image"], obs["proprio"]
    h_, w_, c_ = img.shape[1:]
    images = np.zeros((b, n_chunks, h_, w_, c_), np.uint8)
    proprio = np.zeros((b, n_chunks, pro.shape[1]), np.float32)
    chain = np.zeros((b, n_chunks, steps + 1 if cfg.head == "flow" else 1, d), np.float32 if cfg.head == "flow" else np.int64)
    stochastic = np.zeros((b, n_chunks, steps), bool)
    logp = np.zeros((b, n_chunks, steps), np.float32)
    valid = np.zeros((b, n_chunks), bool)
    dense_max = np.zeros(b, np.float64)
    length = np.zeros(b, np.int64)
    text_ids = policy.text.token_ids([instruction_for(t) for t in tasks])
    frames = [[img[i]] for i in range(b)] if record_frames else None
    done = np.zeros(b, bool)
    success_once = np.zeros(b, bool)
    success_end = np.zeros(b, bool)
    nfe = 0
    for c in range(n_chunks):
        act_idx = np.nonzero(~done)[0]
        if act_idx.size == 0:
            break
        images[act_idx, c] = img[act_idx]
        proprio[act_idx, c] = pro[act_idx]
        h = policy.encode(torch.from_numpy(img[act_idx]).to(device), torch.from_numpy(pro[act_idx]).to(device),
                          [text_ids[i] for i in act_idx])
        acts, ch, st, lp, nfe_row = sample_chunk(policy, h, sampling, generator,
                                                 None if starts is None else starts[act_idx, c])
        nfe += nfe_row * len(act_idx)
        chain[act_idx, c] = ch.cpu().numpy()
        stochastic[act_idx, c] = st.cpu().numpy()
        logp[act_idx, c] = lp.cpu().numpy()
        valid[act_idx, c] = True
        full = np.zeros((b, k, cfg.action_dim), np.float32)
        full[act_idx] = acts.clamp(-1, 1).cpu().numpy()
        res = venv.step_chunk(full, ~done)
        dense_max = np.maximum(dense_max, np.where(res.executed, res.reward, 0.0).max(1))
        length += res.executed.sum(1)
        done = res.done.copy()
        success_once, success_end = res.success_once, res.success_end
        img, pro = res.image, res.proprio
        if record_frames:
            for i in act_idx:
                if not done[i]:
                    frames[i].append(img[i])
    return EpisodeBatch(
        keys=list(keys), tasks=list(tasks), images=images, proprio=proprio, chain=chain, stochastic=stochastic,
        logp=logp, chunk_valid=valid, success_once=np.asarray(success_once, bool), success_end=np.asarray(success_end, bool),
        dense=(dense_max / 10.0).astype(np.float32), length=length, nfe=nfe, frames=frames,
    )


def success_by_task(batch: EpisodeBatch, mode: str = "once") -> dict[str, float]:
    """``eval/success`` and ``eval/success/<task>`` (the mean over the batch's episodes)."""
    succ = batch.success_once if mode == "once" else batch.success_end
    out = {"eval/success": float(np.mean(succ))}
    for task in sorted(set(batch.tasks)):
        sel = np.array([t == task for t in batch.tasks])
        out[f"eval/success/{task}"] = float(np.mean(succ[sel]))
    out["eval/episode_length"] = float(np.mean(batch.length))
    return out


def write_gif(frames: list[np.ndarray], path, scale: int = 2, fps: int = 10) -> None:
    import imageio.v2 as imageio

    ims = [np.repeat(np.repeat(f[..., :3], scale, 0), scale, 1) for f in frames]
    imageio.mimsave(str(path), ims, duration=1.0 / fps, loop=0)
