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
from typing import Literal, Sequence

import numpy as np
import torch

from shared_rl.flow_kernels import DEFAULT_NOISE_LEVEL

from .envs.metaworld_env import instruction_for
from .policies.vla import TinyVLA

HeadMode = Literal["ode", "flow_sde", "flow_noise", "sde_one_step", "fpo", "discrete", "greedy"]


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


def concat_batches(batches: list[EpisodeBatch]) -> EpisodeBatch:
    """The episodes of ``batches`` (run with the same horizon and policy) as one batch, in order."""
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    arrays = {name: np.concatenate([getattr(b, name) for b in batches], axis=0)
              for name in ("images", "proprio", "chain", "stochastic", "logp", "chunk_valid", "success_once",
                           "success_end", "dense", "length")}
    frames = None if first.frames is None else [f for b in batches for f in b.frames]
    return EpisodeBatch(keys=[k for b in batches for k in b.keys], tasks=[t for b in batches for t in b.tasks],
                        nfe=first.nfe, frames=frames, **arrays)


@dataclass
class ChunkNoise:
    """Every random draw of one chunk per row, given instead of drawn from a shared generator (``chunk_noise``)."""

    start: torch.Tensor | None  # [B, D] flow: the chain's standard-normal start
    steps: torch.Tensor | None  # [B, S, D] flow: the SDE noise of every denoising step
    one_step: torch.Tensor | None  # [B] flow, sde_one_step: the stochastic step
    gumbel: torch.Tensor | None  # [B, D, bins] discrete: Gumbel noise (argmax(log q + g) samples q exactly)


def _stream_seed(seed: int, chunk: int) -> int:
    return int(np.random.SeedSequence([int(seed) % 2**63, int(chunk)]).generate_state(1)[0])


def chunk_noise(cfg, seeds, chunk: int) -> ChunkNoise:
    """The noise of chunk ``chunk`` of the episodes whose noise streams are ``seeds``: one generator per (seed,
    chunk), so a stream's draws do not depend on the batch, the row's position, how many chunks the episode runs
    or which env it runs in — the two-stage rollout imagines a candidate with a stream and re-executes exactly
    that candidate in the simulator with the same stream (closed loop: the same noise, the real observations)."""
    gens = [torch.Generator().manual_seed(_stream_seed(s, chunk)) for s in seeds]
    if cfg.head == "flow":
        d, n = cfg.chunk * cfg.action_dim, cfg.num_denoise_steps
        start = torch.stack([torch.randn(d, generator=g) for g in gens])
        steps = torch.stack([torch.randn(n, d, generator=g) for g in gens])
        one = torch.cat([torch.randint(0, max(n - 1, 1), (1,), generator=g) for g in gens])
        return ChunkNoise(start, steps, one, None)
    u = torch.stack([torch.rand(cfg.chunk * cfg.action_dim, cfg.num_bins, generator=g) for g in gens])
    return ChunkNoise(None, None, None, -torch.log(-torch.log(u.clamp(1e-12, 1 - 1e-7))))


def sample_chunk(policy: TinyVLA, h: torch.Tensor, s: SamplingSettings, generator: torch.Generator | None,
                 start_noise: torch.Tensor | None = None, noise: ChunkNoise | None = None):
    """One action chunk per row. Returns (actions [B,K,A], chain, stochastic [B,S], logp [B,S], nfe per row).
    ``start_noise`` [B, D]: the flow chain's standard-normal start per row (else drawn from ``generator``);
    ``noise``: every draw per row (``chunk_noise``; ``generator`` is then not used)."""
    cfg = policy.cfg
    b = h.shape[0]
    if cfg.head == "flow":
        if s.mode not in ("ode", "flow_sde", "flow_noise", "sde_one_step", "fpo"):
            raise ValueError(f"a flow head samples with ode/flow_sde/flow_noise/sde_one_step/fpo, not {s.mode!r}")
        mode = "ode" if s.mode == "fpo" else s.mode  # FPO samples the ODE: its start noise is the exploration
        if noise is not None:
            out = policy.flow.sample(h, mode, generator, s.noise_level, s.logp_reduce, s.init_noise, noise.start,
                                     step_noise=noise.steps, one_step=noise.one_step)
        else:
            out = policy.flow.sample(h, mode, generator, s.noise_level, s.logp_reduce, s.init_noise, start_noise)
        if s.mode == "fpo":  # the whole chunk is what FPO trains: one slot per chunk (step 0) carries its log p-hat
            out.stochastic[:, 0] = True
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
        if noise is not None:  # Gumbel-max: an exact sample of q from the row's own noise
            bins = (logq + noise.gumbel.to(logq.device)).argmax(-1)
        else:
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
    episode_noise_seed: int | Sequence[int] | None = None,
    noise_seeds: list[int] | None = None,
    on_chunk=None,
) -> EpisodeBatch:
    """Run one episode per key (``tasks[i]`` is the task of ``keys[i]``) to the end; batched over envs.

    ``episode_noise_seed``: the flow chain's start noise of episode i comes from its own generator, seeded by
    (``episode_noise_seed``, ``keys[i]``) (or, given one seed per key, (``episode_noise_seed[i]``, ``keys[i]``): several
    start-noise draws of one state in one batch), instead of one stream shared by the batch. With the shared stream an
    episode's draws shift whenever any other episode ends earlier or later, so one task's evaluation moved when
    only another task's policy changed; per episode, an ODE evaluation of a key is a function of the weights its
    task uses, its key and the seed alone. (Evaluation: one episode per key; SDE draws stay on ``generator``.)

    ``noise_seeds``: episode i draws *every* sampling noise (start, SDE steps, sde_one_step's step, discrete bins)
    from its own stream ``noise_seeds[i]`` (``chunk_noise``), none from ``generator``: the same stream and the same
    observations give the same episode in any batch and any env (the two-stage rollout's re-execution).

    ``on_chunk(steps)``: called after each executed chunk with the env steps run so far (of at most ``horizon``;
    the evaluation's progress line)."""
    if noise_seeds is not None and (episode_noise_seed is not None or len(noise_seeds) != len(keys)):
        raise ValueError("run_episodes: noise_seeds needs one seed per key and excludes episode_noise_seed")
    cfg = policy.cfg
    b, k = len(keys), cfg.chunk
    n_chunks = math.ceil(horizon / k)
    steps = cfg.num_denoise_steps if cfg.head == "flow" else 1
    # a chain element's width: the flow head's (a LeRobot policy's chain is its whole padded chunk, wider than K x A)
    d = policy.flow.action_dim if cfg.head == "flow" else cfg.chunk * cfg.action_dim
    starts = None
    if episode_noise_seed is not None and cfg.head == "flow":
        seeds = ([int(episode_noise_seed)] * b if isinstance(episode_noise_seed, (int, np.integer))
                 else [int(x) for x in episode_noise_seed])
        if len(seeds) != b:
            raise ValueError("run_episodes: episode_noise_seed is one seed or one per key")
        starts = torch.stack([torch.randn(n_chunks, d, generator=torch.Generator().manual_seed(
            int(np.random.SeedSequence([s, int(key)]).generate_state(1)[0]))) for s, key in zip(seeds, keys)])
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
        noise = None if noise_seeds is None else chunk_noise(cfg, [noise_seeds[i] for i in act_idx], c)
        acts, ch, st, lp, nfe_row = sample_chunk(policy, h, sampling, generator,
                                                 None if starts is None else starts[act_idx, c], noise)
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
        if on_chunk is not None:
            on_chunk(min(horizon, (c + 1) * k))
    return EpisodeBatch(
        keys=list(keys), tasks=list(tasks), images=images, proprio=proprio, chain=chain, stochastic=stochastic,
        logp=logp, chunk_valid=valid, success_once=np.asarray(success_once, bool), success_end=np.asarray(success_end, bool),
        dense=(dense_max / 10.0).astype(np.float32), length=length, nfe=nfe, frames=frames,
    )


def write_gif(frames: list[np.ndarray], path, scale: int = 2, fps: float = 10.0) -> None:
    """``frames`` as a looping GIF that plays at ``fps`` frames per second of real time. imageio reads the
    duration in milliseconds; GIF stores hundredths of a second, and browsers play a delay under 20 ms at 100 ms,
    so a faster clip keeps every n-th frame instead (the same real-time speed)."""
    import imageio.v2 as imageio

    ms = 1000.0 / fps
    every = max(1, math.ceil(20.0 / ms - 1e-9))
    ims = [np.repeat(np.repeat(f[..., :3], scale, 0), scale, 1) for f in frames[::every]]
    imageio.mimsave(str(path), ims, duration=10 * max(2, round(ms * every / 10)), loop=0)
