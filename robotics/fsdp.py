"""FSDP2 (``distributed.strategy: fsdp2``) for the robotics domain's policies: what is sharded, what is refused.

**Tiny VLA** (``fsdp_units``, in ``fully_shard`` order): every sub-module of ``TinyVLA`` that the domain runs
through ``Module.__call__`` — the CNN, the image projection, the instruction embedding, the proprio MLP, the fusion
MLP, the task adapters (``robotics.adapters``: the tiny VLA's low-rank adapters, the run's "LoRA"), then the action
head (the flow head's velocity and ReinFlow std MLPs, or the discrete bins). ``TinyVLA`` itself is not a unit: it
has no parameter of its own and no ``forward`` (the domain calls its methods, which call those sub-modules), and a
``fully_shard`` root whose forward never runs would never finish its backward. Each unit is therefore its own FSDP2
root. The frozen KL reference copy is sharded the same way, so no process holds a second whole policy. Trained or
frozen (``robotics.train_encoder``, adapters only), every parameter of a unit is sharded.

**LeRobot policies** (SmolVLA, π0, π0.5; :func:`lerobot_units`): FSDP2 all-gathers a unit in its forward pre-hook,
so a unit must be a module LeRobot's prefix / denoising calls run through ``Module.__call__``. π0 / π0.5's Gemma
decoder layers are (``PiGemmaModel`` loops over them, for the PaliGemma VLM and for the action expert), as are the
SigLIP encoder layers: one unit per layer. SmolVLA runs its decoder layers' parts itself
(``SmolVLMWithExpertModel.forward_attn_layer`` calls a layer's norm, q/k/v/o projections and MLP, never the layer),
so each VLM and expert layer is sharded as its MLP (the largest part) and its attention projections and norms;
SmolVLM's vision encoder layers are one unit each. Every other parameter is sharded with the module that owns it
(embeddings, vision patch embedding, projector, final norms, the unused ``lm_head``s, the state / action / time
projections, the flow-noise std net), a peft LoRA layer (its base layer and adapters) as one unit. Every parameter
is covered (checked) and none is shared by two units. With LoRA (``robotics.policy.lora``) the frozen base is
sharded with its adapters and the KL reference is the adapter-off policy (no copy); with full fine-tuning the
frozen reference copy is sharded the same way.

**Paired forwards.** One ``log_probs`` call runs each unit once on the batch of needed chunks (the encoder / VLM
prefix) and once on the batch of trained steps (the head / action expert), whatever the data, and the KL reference
the same when ``loss.kl_coef > 0``; the trainer equalises the number of calls per optimizer step. Rollouts and
evaluation run with the policy's shards gathered; the KL reference copy's stay sharded (``sampling_modules``).

**Refused** (one-line ``ConfigError`` at trainer set-up): what runs forwards or changes weights outside that pattern
or holds untested state per process — the value head (``robotics.critic.enabled``), BC replay
(``robotics.replay.coef``), ``robotics.adapters.keep_best`` (swaps adapters in and out),
``robotics.adapters.steps: by_episodes`` (per-task step scaling) and the world-model rollout strategies.

**Gradient checkpointing** (``robotics.policy.gradient_checkpointing``) on π0 / π0.5: grove checkpoints each Gemma
layer's attention and MLP (inside the layer's unit) and each SigLIP layer (the unit itself, its FSDP2 hooks outside
the checkpoint), so the backward's recomputation runs on the parameters FSDP2's pre-backward hook already gathered
and issues no collective of its own. On SmolVLA the checkpoint sits *around* units: its attention half
(``forward_attn_layer``, a method of the non-unit ``SmolVLMWithExpertModel``) calls the norm and projection units,
and the MLP units are checkpointed whole (their hooks inside the checkpoint). The recomputation therefore runs
those units' FSDP2 forward hooks again inside backward — one more all-gather per unit — in the order autograd
reaches the checkpointed regions, which is the same on every process because every process runs the same paired
forwards (the 2-process test equals one process without checkpointing).
"""
from __future__ import annotations

from pathlib import Path

import torch

from shared_rl.config import ConfigError

_HOW = "or use distributed.strategy: replicate"
FLAT_ROLLOUTS = ("flat", "tree")


def refuse_config(cfg) -> None:
    """The one-line ConfigError for each robotics setting FSDP2 does not run (see the module docstring), from the
    config alone (``--dry-run`` and the sharding both call it). Gradient checkpointing is not among them: it runs
    under FSDP2 for the LeRobot policies (π0, π0.5 and SmolVLA)."""
    refused = [(cfg.critic.enabled, "robotics.critic.enabled: the value head's forwards are not paired",
                "set robotics.critic.enabled: false"),
               (cfg.replay.coef > 0, "robotics.replay.coef: the replay loss's forwards are not paired",
                "set robotics.replay.coef: 0"),
               (cfg.adapters.keep_best, "robotics.adapters.keep_best swaps adapters into the sharded weights",
                "set robotics.adapters.keep_best: false"),
               (cfg.adapters.steps != "equal", "robotics.adapters.steps: by_episodes scales per-task steps",
                "use robotics.adapters.steps: equal"),
               (cfg.rollout.name not in FLAT_ROLLOUTS, f"robotics.rollout.name {cfg.rollout.name!r} (world-model "
                "strategies train their own models per process)", f"use one of {', '.join(FLAT_ROLLOUTS)}")]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"distributed.strategy: fsdp2 with {what}; {fix} {_HOW}")


def _units(policy: torch.nn.Module) -> list[torch.nn.Module]:
    units = [policy.cnn, policy.image_proj, policy.text.embed, policy.proprio, policy.fuse]
    if policy.adapters is not None:
        units.append(policy.adapters)
    units += [policy.flow.velocity, policy.flow.noise_std] if policy.cfg.head == "flow" else [policy.bins]
    own = [name for name, _ in policy.named_parameters()
           if not any(name.startswith(prefix) for prefix in _prefixes(policy, units))]
    if own:  # a parameter outside every unit would stay whole on every process: the units must cover the model
        raise ConfigError(f"robotics: tiny-VLA parameters {own[:3]} are outside the FSDP2 units {_HOW}")
    return units


def _prefixes(policy: torch.nn.Module, units: list[torch.nn.Module]) -> list[str]:
    names = {id(m): name for name, m in policy.named_modules()}
    return [names[id(u)] + "." for u in units]


def fsdp_units(domain) -> list[torch.nn.Module]:
    """The modules to shard: the policy's units, then the KL reference copy's (none for a LoRA LeRobot policy, whose
    reference is the adapter-off policy itself)."""
    lerobot = domain.cfg.policy.type == "lerobot"
    refuse_config(domain.cfg)
    if lerobot:
        ref = domain._ref if isinstance(domain._ref, torch.nn.Module) else None
        return lerobot_units(domain.policy) + (lerobot_units(ref) if ref is not None else [])
    return _units(domain.policy) + _units(domain._ref)


def sampling_modules(domain) -> list[torch.nn.Module]:
    """What rollouts and evaluation run (``DomainBase.fsdp_sampling_modules``): the policy. Not the KL reference
    copy: it runs only in ``log_probs`` with KL (paired training forwards), so it stays sharded in ``gathered()``."""
    return [domain.policy]


# LeRobot classes (any class in a module's MRO: FSDP2 and gradient checkpointing subclass them) whose forward the
# prefix / denoising calls run through Module.__call__, sharded as one unit each (module docstring)
LEROBOT_BLOCKS = {
    "pi0": ("_PiGemmaDecoderLayerBase", "SiglipEncoderLayer"),
    "pi05": ("_PiGemmaDecoderLayerBase", "SiglipEncoderLayer"),
    "smolvla": ("SmolVLMEncoderLayer", "LlamaMLP"),
}


def _is_lora_layer(module: torch.nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, LoraLayer)


def lerobot_units(vla: torch.nn.Module, family: str = "") -> list[torch.nn.Module]:
    """The FSDP2 units of a :class:`~robotics.policies.lerobot.adapter.LeRobotVLA` (module docstring; or of any
    LeRobot module of ``family``): its family's blocks, then the owner of every other parameter (a peft LoRA layer
    whole), in module order, disjoint. Works on the meta device (only the module tree is read)."""
    blocks = set(LEROBOT_BLOCKS[family or vla.cfg.family])
    units, covered = [], []
    for name, m in vla.named_modules():
        if any(name.startswith(c) for c in covered):
            continue
        mro = {c.__name__ for c in type(m).__mro__}
        own = next(m.parameters(recurse=False), None) is not None
        if (mro & blocks) or _is_lora_layer(m) or (own and name):
            if next(m.parameters(), None) is None:
                continue
            units.append(m)
            covered.append(name + ".")
    named = dict(vla.named_parameters(remove_duplicate=False))
    in_unit = {}
    for u in units:
        for p in u.parameters():
            if id(p) in in_unit and in_unit[id(p)] is not u:
                raise ConfigError(f"robotics: a LeRobot parameter is shared by two FSDP2 units (tied weights) {_HOW}")
            in_unit[id(p)] = u
    outside = [n for n, p in named.items() if id(p) not in in_unit]
    if outside:  # a parameter of the root itself would stay whole on every process
        raise ConfigError(f"robotics: LeRobot parameters {outside[:3]} are outside the FSDP2 units {_HOW}")
    return units


def load_policy_on_rank0(cfg, ctx, load):
    """The run's policy (``robotics.domain.load_policy``), under ``distributed.strategy: fsdp2`` with several
    processes loaded by process 0 alone: every other process builds it on the meta device
    (``shared_rl.sharding.rank0_build``) and the trainer's ``setup_fsdp`` fills its shards, the KL reference copy's
    and the buffers outside the units (the flow head's noise levels, a LeRobot policy's flow times) from process 0
    (``shard_from_rank0``; adapters added after it are overwritten the same way). The tiny VLA: fresh, or
    ``robotics.checkpoint`` (whose small file the others still read). A LeRobot policy (SmolVLA, π0, π0.5): built
    from its config on the meta device, no weight file read (``policies.lerobot.load._meta_policy``); its pre- and
    post-processors, which hold the normalisation statistics, are read from the policy directory's processor files
    on every process (they are not module tensors, so no broadcast is needed). ``load``: the domain's
    ``load_policy`` (passed in: this module never imports the domain). A policy the caller holds and a run with
    ``robotics.eval_baseline`` (every process checks the starting weights' digest) load on every process as
    before. With one process, or under ``replicate``, plain ``load_policy``. Returned on ``ctx.device`` (a policy on
    the meta device stays there: ``Module.to`` cannot move it)."""
    from shared_rl.sharding import rank0_build

    if (ctx.objects or {}).get("policy") is not None or cfg.eval_baseline:
        return load(cfg, ctx.seed, ctx.objects).to(ctx.device)
    with rank0_build(ctx):
        policy = load(cfg, ctx.seed, ctx.objects)
    return policy if any(p.is_meta for p in policy.parameters()) else policy.to(ctx.device)


def is_sharded(module: torch.nn.Module) -> bool:
    from shared_rl.distributed import is_dtensor

    return any(is_dtensor(p) for p in module.parameters())


def save_sharded(policy, out_dir: Path) -> None:
    """``final/`` of a sharded run, called on every process: the full weights gathered (a collective), written by
    process 0 in the one-process layout (``model.safetensors`` + ``config.json``, ``TinyVLA.load_pretrained``; a
    LeRobot policy's directory, :func:`unsharded_lerobot`)."""
    import json
    from dataclasses import asdict

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    if getattr(policy, "family", None) is not None:  # a LeRobotVLA
        unsharded_lerobot(policy, state).save_pretrained(out_dir)
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(asdict(policy.cfg), indent=1))


def unsharded_lerobot(vla, state: dict[str, torch.Tensor]):
    """A plain (unsharded) copy of a sharded :class:`LeRobotVLA` holding ``state`` (its full state dict, gathered):
    the LeRobot policy built on the meta device from the live one's config (its tiny-π sizes when it has them; no
    VLM weights read), LoRA added the same way, and the tensors of ``state`` assigned in place (no copy, no random
    init). What ``save_pretrained`` writes (LoRA merged) is then the one-process export. The flow-noise std net is
    RL-only (not exported) and left out."""
    import contextlib
    import copy

    from .policies.lerobot.adapter import LeRobotVLA
    from .policies.lerobot.tiny_pi import tiny_pi_sizes

    cfg = copy.copy(vla.policy.config)
    cfg.device = "meta"  # π0 / π0.5 move themselves to config.device in __init__
    if hasattr(cfg, "load_vlm_weights"):
        cfg.load_vlm_weights = False  # SmolVLA: the VLM from its config only; its weights come from ``state``
    sizes = tiny_pi_sizes(vla.tiny) if vla.tiny is not None else contextlib.nullcontext()
    with sizes, torch.device("meta"):
        skeleton = type(vla.policy)(cfg)
    skeleton.config = vla.policy.config
    out = LeRobotVLA(skeleton, vla.preprocessor, vla.postprocessor, vla.cameras, vla.image_sizes, vla.cfg.chunk,
                     vla.cfg.action_dim)
    out.tiny = vla.tiny
    if vla._peft is not None:
        from peft import get_peft_model

        with torch.device("meta"):
            object.__setattr__(out, "_peft", get_peft_model(skeleton, copy.deepcopy(vla._peft.peft_config["default"])))
    # own storage per tensor (a gathered tensor can be a view into a larger buffer, which safetensors refuses)
    keep = {k: v.detach().clone() for k, v in state.items() if not k.startswith("flow.noise_std.")}
    missing, unexpected = out.load_state_dict(keep, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"the gathered LeRobot state does not fit its rebuilt policy: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    return out


class _GatheredView:
    """What ``evaluation.policy_digest`` reads of a policy (``state_dict()``, ``adapters``), from the gathered
    weights: inside ``FSDPShards.gathered()`` a sharded module's parameters are the full tensors, but its
    ``state_dict()`` swaps the shards back in (and gathering them again would be a collective on one process)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy, self.adapters = policy, policy.adapters

    def state_dict(self) -> dict[str, torch.Tensor]:
        # copies: the digest reads tensors through numpy, which pins a storage, and FSDP2 must free the gathered
        # parameters' storage when the block ends
        out = {}
        for prefix, module in self.policy.named_modules():
            dot = prefix + "." if prefix else ""
            out.update({dot + n: b.detach().clone() for n, b in module.named_buffers(recurse=False)
                        if n not in module._non_persistent_buffers_set})
            out.update({dot + n: p.detach().clone() for n, p in module.named_parameters(recurse=False)})
        return out


def gathered_digest(policy: torch.nn.Module) -> str:
    """``policy_digest`` of a sharded policy inside ``gathered()`` (on one process: no collective)."""
    from .evaluation import policy_digest

    return policy_digest(_GatheredView(policy))
