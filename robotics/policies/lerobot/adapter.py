"""A LeRobot flow-matching policy (SmolVLA) behind the interface grove's episodes, domain and evaluation use for the
tiny VLA: ``cfg`` (head, chunk K, action_dim, num_denoise_steps), ``text.token_ids``, ``encode`` (observations ->
features) and ``flow`` (chunk sampling with per-step log-probs, recomputation of stored steps with grad).

The denoising chain is LeRobot's own: x(σ=1) = noise of shape [chunk_size, max_action_dim] (the model's padded,
normalised action space), ``num_steps`` Euler steps at LeRobot's times 1 + s·(−1/num_steps), the velocity from the
policy's action expert (``VLAFlowMatching.denoise_step``) attending to the prefix KV cache of the VLM (images,
instruction tokens, state). LeRobot's convention is grove's (x_σ = σ·ε + (1−σ)·x0, v ≈ ε − x0), so each step goes
through the shared kernels of :class:`~robotics.policies.flow_head.FlowActionHead` (``shared_rl.flow_kernels``):
``ode`` is LeRobot's ``sample_actions``, ``flow_sde`` / ``sde_one_step`` are Flow-GRPO's SDE steps with exact
Gaussian log-probs, ``flow_noise`` is ReinFlow / πRL's learned std (:class:`NoiseStdNet` on the expert's output
tokens) at every step. The features ``h`` are the prefix (:class:`Prefix`: the KV cache and pad mask, and the
pooled VLM tokens a value head reads; indexable by rows), computed once per chunk and shared by its denoising steps.

Observations map onto the policy's declared input features: each image feature gets an env camera (``cameras``),
as float [0, 1] CHW at the feature's resolution; ``observation.state`` is the env's proprio vector; ``task`` is the
task's instruction. LeRobot's own preprocessor (loaded from the policy directory) normalises the state and
tokenises the instruction; its postprocessor unnormalises the chain's end, which is then cut to the first
``chunk`` (K) actions and the env's 4 action dims. The chain itself stays in the model's space, so a recomputed step
sees exactly the sampled one.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from shared_rl.flow_kernels import DEFAULT_NOISE_LEVEL

from ..flow_head import FlowActionHead, FlowSample
from .families import LANG_MASK, LANG_TOKENS, family_of
from .prefix import Prefix

IMAGE_PREFIX = "observation.images."
EMPTY_CAMERA = "observation.images.empty_camera_"  # SmolVLA / π0 pad missing cameras with these themselves
OBS_STATE = "observation.state"
ACTION = "action"


@dataclass
class LeRobotView:
    """What grove's episode runner and domain read from ``policy.cfg`` (the tiny VLA's ``VLAConfig`` fields)."""

    family: str  # LeRobot policy type: smolvla | pi0 | pi05
    chunk: int  # actions the env executes per planned chunk (K)
    action_dim: int  # the env's action dims
    num_denoise_steps: int
    chunk_size: int  # the model's chunk (>= chunk)
    max_action_dim: int  # the model's padded action width
    hidden: int = 0  # width of the pooled prefix features (the VLM's hidden size): what a value head reads
    expert_hidden: int = 0  # the action expert's width (its output tokens: flow-noise's std net, critic.input expert)
    head: str = "flow"

    @property
    def chain_dim(self) -> int:
        """Width of one chain element: the model's whole padded chunk."""
        return self.chunk_size * self.max_action_dim


class InstructionText:
    """``token_ids`` as the tiny VLA's text encoder has it, for a policy that tokenises in its own preprocessor: a
    row's "ids" are its instruction's characters (self-contained, so a copy of the policy reads them too)."""

    @staticmethod
    def token_ids(texts: list[str]) -> list[list[int]]:
        return [[ord(c) for c in text] for text in texts]

    @staticmethod
    def texts(ids: list[list[int]]) -> list[str]:
        return ["".join(map(chr, row)) for row in ids]


class NoiseStdNet(nn.Module):
    """πRL's learned exploration noise for ``flow_noise`` (ReinFlow, Zhang et al. 2025; πRL, Chen et al. 2025,
    RLinf's ``ExploreNoiseNet`` on π0): an MLP (tanh hidden layers, RLinf's [128, 64]) from the action expert's
    output token of each chunk position (the features its velocity head ``action_out_proj`` reads, so the std
    depends on the observation through the prefix, on x_σ and on σ) to a log-variance per action dim, squashed by
    tanh into [log std_min², log std_max²]: std = exp(½·logvar) ∈ [std_min, std_max] (RLinf's defaults 0.08, 0.16).
    The bounds are settings, not state (buffers not saved)."""

    def __init__(self, in_dim: int, out_dim: int, hidden: tuple[int, ...] = (128, 64), std_min: float = 0.08,
                 std_max: float = 0.16):
        super().__init__()
        layers, d = [], in_dim
        for width in hidden:
            layers += [nn.Linear(d, width), nn.Tanh()]
            d = width
        layers.append(nn.Linear(d, out_dim))
        self.mlp = nn.Sequential(*layers)
        self.register_buffer("logvar_min", torch.tensor(math.log(std_min ** 2)), persistent=False)
        self.register_buffer("logvar_max", torch.tensor(math.log(std_max ** 2)), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` [B, chunk_size, width] -> std [B, chunk_size·out_dim] (the chain's flat layout)."""
        z = torch.tanh(self.mlp(tokens.float()))
        logvar = self.logvar_min + (self.logvar_max - self.logvar_min) * (z + 1) / 2
        return torch.exp(0.5 * logvar).flatten(1)


class LeRobotFlow(FlowActionHead):
    """The tiny VLA's flow head (sampling loop, SDE/ODE transitions through ``shared_rl.flow_kernels``, log-probs,
    which steps are stochastic) with the LeRobot action expert as the velocity. FlowActionHead's own velocity MLP and
    std head are not built (``nn.Module.__init__`` only): the velocity comes from ``velocity_fn(h, x, sigma)`` ->
    (v, expert tokens), and ``flow_noise``'s std from :class:`NoiseStdNet` on those tokens (``noise_std``, built
    by :meth:`LeRobotVLA.add_noise_head`), so one expert pass per step gives both."""

    def __init__(self, view: LeRobotView, velocity_fn, to_env_fn):
        nn.Module.__init__(self)
        self.action_dim, self.num_steps = view.chain_dim, view.num_denoise_steps
        self._velocity_fn, self._to_env_fn = velocity_fn, to_env_fn
        self.noise_std: NoiseStdNet | None = None
        self._tokens = None  # (x, sigma, expert tokens) of the last velocity, for the std of the same step
        dt = -1.0 / view.num_denoise_steps  # LeRobot's times, computed as its sample_actions does (float64 -> f32)
        times = [1.0 + s * dt for s in range(view.num_denoise_steps)] + [0.0]
        self.register_buffer("sigmas", torch.tensor(times, dtype=torch.float32), persistent=False)

    def velocity_at(self, h: Prefix, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        v, tokens = self._velocity_fn(h, x, sigma, self.noise_std is not None)
        if self.noise_std is not None:
            self._tokens = (x, sigma, tokens)
        return v

    def learned_std(self, h: Prefix, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """``flow_noise``'s per-dim std [B, chain_dim] at (x, σ): from the expert tokens of the velocity just computed
        at the same (x, σ) (``transition`` asks for v first), else from a fresh expert pass."""
        if self.noise_std is None:
            raise ValueError("this LeRobot policy has no learned noise head: load it with robotics.head_mode: "
                             "flow_noise (LeRobotVLA.add_noise_head)")
        cached, self._tokens = self._tokens, None
        if cached is None or cached[0] is not x or cached[1] is not sigma:
            self.velocity_at(h, x, sigma)
            cached, self._tokens = self._tokens, None
        return self.noise_std(cached[2])

    @torch.no_grad()
    def sample(self, h: Prefix, mode: str, generator: torch.Generator | None, noise_level: float = DEFAULT_NOISE_LEVEL,
               reduce: str = "sum", init_noise: float = 1.0, start_noise: torch.Tensor | None = None,
               step_noise: torch.Tensor | None = None, one_step: torch.Tensor | None = None) -> FlowSample:
        """FlowActionHead's sampling; ``actions`` is the env's chunk [B, K·A] (unnormalised, cut), the chain stays in
        the model's space [B, S+1, chunk_size·max_action_dim]."""
        if mode == "flow_noise" and self.noise_std is None:
            self.learned_std(h, None, None)
        out = super().sample(h, mode, generator, noise_level, reduce, init_noise, start_noise, step_noise, one_step)
        self._tokens = None
        return dataclasses.replace(out, actions=self._to_env_fn(out.actions))


class LeRobotVLA(nn.Module):
    """A LeRobot ``PreTrainedPolicy`` (SmolVLA) with its pre/postprocessors, driven as grove's robotics policy."""

    def __init__(self, policy, preprocessor, postprocessor, cameras: dict[str, int], image_sizes: dict[str, tuple],
                 n_action_steps: int, env_action_dim: int):
        super().__init__()
        self.policy = policy
        self.preprocessor, self.postprocessor = preprocessor, postprocessor
        self.cameras, self.image_sizes = dict(cameras), dict(image_sizes)  # feature -> env camera index, (H, W)
        c = policy.config
        self.family = family_of(policy.name)
        self.family.make_batch_invariant(policy)
        self.cfg = LeRobotView(family=policy.name, chunk=n_action_steps, action_dim=env_action_dim,
                               num_denoise_steps=self.family.num_steps(c), chunk_size=c.chunk_size,
                               max_action_dim=c.max_action_dim, hidden=self.family.vlm_hidden(policy),
                               expert_hidden=policy.model.action_out_proj.in_features)
        self.action_feature_dim = c.output_features[ACTION].shape[0]
        self.text = InstructionText()
        self.flow = LeRobotFlow(self.cfg, self._velocity, self._to_env)
        self._peft = None  # the peft wrapper when LoRA is on (not a submodule: it wraps self.policy)
        self.tiny = None  # a tiny π0 / π0.5's sizes (tiny_pi.TinyPi), written next to an export

    # -- observations -> LeRobot batch -> prefix features
    def observation(self, images: torch.Tensor, proprio: torch.Tensor, texts: list[str]) -> dict:
        """The raw LeRobot observation of env frames (uint8 [B, H, W, 3·cameras]), proprio [B, P] and instructions:
        one float [0, 1] CHW image per image feature at its declared resolution, the state, the task strings."""
        batch = {}
        for key, cam in self.cameras.items():
            img = images[..., 3 * cam: 3 * cam + 3].permute(0, 3, 1, 2).float() / 255.0
            if tuple(img.shape[-2:]) != self.image_sizes[key]:
                img = F.interpolate(img, size=self.image_sizes[key], mode="bilinear", align_corners=False)
            batch[key] = img
        batch[OBS_STATE] = proprio.float()
        batch["task"] = list(texts)
        return batch

    def preprocess(self, batch: dict) -> dict:
        """LeRobot's preprocessor (state normalisation, newline + tokenisation of the task), on the policy's device,
        with the instruction tokens padded to ``tokenizer_max_length``: the pipeline pads to the batch's longest
        instruction, and a fixed width keeps a row's prefix independent of the batch it is computed in (the
        rollout's batch and the recomputation's differ; the pad positions are masked either way)."""
        out = self.preprocessor(batch)
        dev = self.flow.sigmas.device
        out = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in out.items()}
        width = self.policy.config.tokenizer_max_length
        pad = width - out[LANG_TOKENS].shape[1]
        if pad > 0:
            out[LANG_TOKENS] = F.pad(out[LANG_TOKENS], (0, pad))
            out[LANG_MASK] = F.pad(out[LANG_MASK], (0, pad), value=False)
        return out

    def prefix(self, batch: dict) -> Prefix:
        """The prefix KV cache of a preprocessed batch: what the policy's ``sample_actions`` computes before its
        denoising loop, with LeRobot's own calls (``families.py``)."""
        return self.family.prefix(self.policy, batch)

    def encode(self, images: torch.Tensor, proprio: torch.Tensor, text_ids: list[list[int]]) -> Prefix:
        """Features of observations (the tiny VLA's ``encode``): the prefix of the mapped, preprocessed batch."""
        return self.prefix(self.preprocess(self.observation(images, proprio, self.text.texts(text_ids))))

    def expert_value_features(self, h: Prefix) -> torch.Tensor:
        """πRL's expert-side value input (RLinf ``value_after_vlm: false`` with ``chunk_critic_input``): the mean of
        the action expert's output tokens over the executed chunk positions [B, expert width]. RLinf reads them at
        each sampled denoising step; grove reads them once per observation at the chain's start (σ = 1) with x at
        the start noise's mean (0), so the value is a function of the observation only, not of a noise draw. One
        expert pass, paid only where values are computed (the critic calls it; sampling never does)."""
        x = torch.zeros(len(h), self.cfg.chain_dim, device=h.device)
        _, tokens = self._velocity(h, x, torch.ones(len(h), device=h.device), tokens=True)
        return tokens[:, : self.cfg.chunk].float().mean(1)

    # -- the chain's velocity and the env's actions
    def _velocity(self, h: Prefix, x: torch.Tensor, sigma: torch.Tensor, tokens: bool = False):
        """LeRobot's ``denoise_step`` at (x, σ) -> (v [B, chain_dim], the expert's output tokens [B, chunk_size, width]
        that its ``action_out_proj`` read, when ``tokens``; else None)."""
        c = self.cfg
        xt = x.view(x.shape[0], c.chunk_size, c.max_action_dim)
        seen = []
        hook = (self.policy.model.action_out_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
                if tokens else None)
        try:
            v = self.family.velocity(self.policy, h, xt, sigma.float())
        finally:
            if hook is not None:
                hook.remove()
        return v.reshape(x.shape[0], -1).float(), (seen[0] if tokens else None)

    def model_actions(self, chain_end: torch.Tensor) -> torch.Tensor:
        """The chain's end as LeRobot's ``predict_action_chunk`` returns it: [B, chunk_size, action feature dims]."""
        c = self.cfg
        return chain_end.view(chain_end.shape[0], c.chunk_size, c.max_action_dim)[:, :, : self.action_feature_dim]

    def _to_env(self, chain_end: torch.Tensor) -> torch.Tensor:
        """The env's chunk [B, K·A]: LeRobot's postprocessor (unnormalise), the first K actions, the env's A dims."""
        actions = self.postprocessor(self.model_actions(chain_end)).to(chain_end.device)
        return actions[:, : self.cfg.chunk, : self.cfg.action_dim].reshape(chain_end.shape[0], -1)

    # -- RL heads and memory
    def add_noise_head(self, hidden: tuple[int, ...] = (128, 64), std_min: float = 0.08, std_max: float = 0.16,
                       seed: int = 0) -> None:
        """The learned std of ``flow_noise`` (:class:`NoiseStdNet`, ``flow.noise_std``): RL-only, trained with the
        policy, not part of the exported LeRobot policy (its ODE actions do not read it)."""
        torch.manual_seed(seed)
        width = self.cfg.expert_hidden  # what the velocity head reads
        dev = self.flow.sigmas.device
        self.flow.noise_std = NoiseStdNet(width, self.cfg.max_action_dim, tuple(hidden), std_min, std_max).to(dev)

    def enable_gradient_checkpointing(self) -> None:
        """Activation checkpointing (``torch.utils.checkpoint``, non-reentrant, only while grad is on) of the
        family's transformer layers (``families.py``: SmolVLA's attention and MLP halves in its own layer loop;
        π0 / π0.5's Gemma attention and MLP and SigLIP layers). The results and gradients are the same (test),
        memory of a training forward drops, compute rises by about a forward. A class swap (a subclass whose
        methods checkpoint), so weights' names, ``save_pretrained`` and deep copies are unchanged."""
        self.family.enable_gradient_checkpointing(self.policy)

    # -- LoRA and export
    def add_lora(self, rank: int, alpha: float, vlm: bool = False, targets: str = "", seed: int = 0) -> None:
        """LoRA (peft) on LeRobot's default fine-tuning targets of the policy (the action expert's q/v projections
        and the state/action/time projections), optionally also the VLM's attention; B = 0, so the policy's actions
        do not change. peft freezes every other weight."""
        from peft import LoraConfig, get_peft_model

        pattern = targets or self.policy._get_default_peft_targets()["target_modules"]
        if vlm:
            pattern = f"({pattern}|{self.family.vlm_attention})"
        torch.manual_seed(seed)  # LoRA's A matrices
        # kept outside the module tree (it wraps self.policy, whose weights are already registered)
        object.__setattr__(self, "_peft", get_peft_model(self.policy, LoraConfig(r=rank, lora_alpha=alpha,
                                                                                target_modules=pattern)))
        self.family.make_batch_invariant(self.policy)  # LoRA's own layers on a batch-sensitive input

    def kl_reference(self):
        """The starting policy a KL term compares with. With LoRA: this policy with its adapters disabled
        (:class:`AdapterOffReference`; the base weights are frozen, so that *is* the starting policy) and no copy of
        the weights — a real π0 is ~3.3B parameters. Without LoRA (every trained weight moves): a frozen deep copy."""
        if self._peft is None:
            return copy.deepcopy(self).eval().requires_grad_(False)
        return AdapterOffReference(self)

    def lerobot_policy(self):
        """The LeRobot policy as LeRobot saves it: LoRA merged into a copy (the trained one keeps its adapters)."""
        if self._peft is None:
            return self.policy
        return copy.deepcopy(self._peft).merge_and_unload()

    def save_pretrained(self, out_dir: str | Path) -> None:
        """A LeRobot policy directory: ``PreTrainedPolicy.from_pretrained`` and ``make_pre_post_processors(config,
        pretrained_path=...)`` load it; grove's camera map rides along in ``grove_mapping.json``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.lerobot_policy().save_pretrained(out)
        self.preprocessor.save_pretrained(out)
        self.postprocessor.save_pretrained(out)
        from .local_files import bundle_local_files

        bundle_local_files(out, self.policy.config, self.preprocessor)  # a local VLM / tokenizer travels with it
        (out / "grove_mapping.json").write_text(json.dumps(
            {"cameras": self.cameras, "n_action_steps": self.cfg.chunk, "env_action_dim": self.cfg.action_dim}, indent=1))
        if self.tiny is not None:  # a tiny π keeps its sizes: LeRobot rebuilds π from variant names
            from .tiny_pi import TINY_FILE

            (out / TINY_FILE).write_text(json.dumps(dataclasses.asdict(self.tiny), indent=1))


class AdapterOffReference:
    """A LoRA policy's KL reference without a second copy of its weights: ``encode`` and ``flow.step_log_prob`` run the
    same modules inside peft's ``disable_adapter()`` (and ``no_grad``). ``flow_noise``'s std net has no adapter, so its
    starting weights are the one small part copied (frozen)."""

    def __init__(self, vla: LeRobotVLA):
        self._vla = vla
        std = vla.flow.noise_std
        self._std = copy.deepcopy(std).requires_grad_(False) if std is not None else None
        self.cfg = vla.cfg
        self.flow = _AdapterOffFlow(self)

    @contextlib.contextmanager
    def active(self):
        """The policy as it started: adapters off, the starting std net, no grad."""
        vla = self._vla
        std, vla.flow.noise_std = vla.flow.noise_std, self._std
        try:
            with vla._peft.disable_adapter(), torch.no_grad():
                yield vla
        finally:
            vla.flow.noise_std = std

    def encode(self, images: torch.Tensor, proprio: torch.Tensor, text_ids: list[list[int]]) -> Prefix:
        with self.active() as vla:
            return vla.encode(images, proprio, text_ids)

    def eval(self) -> "AdapterOffReference":
        return self

    def requires_grad_(self, requires_grad: bool = False) -> "AdapterOffReference":
        return self


class _AdapterOffFlow:
    def __init__(self, ref: AdapterOffReference):
        self._ref = ref

    def step_log_prob(self, *args, **kwargs):
        with self._ref.active() as vla:
            return vla.flow.step_log_prob(*args, **kwargs)
