"""FSDP2 (``distributed.strategy: fsdp2``) for the robotics domain's tiny VLA: what is sharded, what is refused.

**Sharded** (``fsdp_units``, in ``fully_shard`` order): every sub-module of ``TinyVLA`` that the domain runs through
``Module.__call__`` — the CNN, the image projection, the instruction embedding, the proprio MLP, the fusion MLP,
the task adapters (``robotics.adapters``: the tiny VLA's low-rank adapters, the run's "LoRA"), then the action head
(the flow head's velocity and ReinFlow std MLPs, or the discrete bins). ``TinyVLA`` itself is not a unit: it has no
parameter of its own and no ``forward`` (the domain calls its methods, which call those sub-modules), and a
``fully_shard`` root whose forward never runs would never finish its backward. Each unit is therefore its own FSDP2
root. The frozen KL reference copy is sharded the same way, so no process holds a second whole policy. Trained or
frozen (``robotics.train_encoder``, adapters only), every parameter of a unit is sharded.

**Paired forwards.** One ``log_probs`` call runs each unit once on the batch of needed chunks (the encoder) and once
on the batch of trained steps (the head), whatever the data, and the KL reference the same when ``loss.kl_coef >
0``; the trainer equalises the number of calls per optimizer step. Rollouts and evaluation run with the shards
gathered.

**Refused** (one-line ``ConfigError`` at trainer set-up): what runs forwards or changes weights outside that pattern
or holds untested state per process — LeRobot policies (SmolVLA / π0 / π0.5), the value head
(``robotics.critic.enabled``), BC replay (``robotics.replay.coef``), ``robotics.adapters.keep_best`` (swaps
adapters in and out), ``robotics.adapters.steps: by_episodes`` (per-task step scaling) and the world-model rollout
strategies.
"""
from __future__ import annotations

from pathlib import Path

import torch

from shared_rl.config import ConfigError

_HOW = "or use distributed.strategy: replicate"
FLAT_ROLLOUTS = ("flat", "tree")


def refuse_config(cfg) -> None:
    """The one-line ConfigError for each robotics setting FSDP2 does not run (see the module docstring)."""
    if cfg.policy.type != "tiny_vla":
        raise ConfigError(f"distributed.strategy: fsdp2 with robotics.policy.type {cfg.policy.type!r}: only the tiny "
                          f"VLA is sharded so far {_HOW}")
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
    """The modules to shard: the policy's units, then the KL reference copy's."""
    refuse_config(domain.cfg)
    return _units(domain.policy) + _units(domain._ref)


def is_sharded(module: torch.nn.Module) -> bool:
    from shared_rl.distributed import is_dtensor

    return any(is_dtensor(p) for p in module.parameters())


def save_sharded(policy, out_dir: Path) -> None:
    """``final/`` of a sharded run, called on every process: the full weights gathered (a collective), written by
    process 0 in the one-process layout (``model.safetensors`` + ``config.json``, ``TinyVLA.load_pretrained``)."""
    import json
    from dataclasses import asdict

    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(asdict(policy.cfg), indent=1))


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
