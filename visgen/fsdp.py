"""FSDP2 (``distributed.strategy: fsdp2``) for the visgen domain: what is sharded, what is refused, and how the
training forwards are kept paired across processes.

**Sharded** (``fsdp_units``, in ``fully_shard`` order): each repeated block of the diffusers transformer (the
classes named in its ``_no_split_modules``, e.g. SD3's ``JointTransformerBlock``; LoRA adapters inside a block are
sharded with it), then the transformer itself as the root (patch embedding, time/text embedders, final norm and
projection). With full fine-tuning and ``visgen.full_reference`` the frozen reference copy is sharded the same way,
so no process holds a whole second transformer; so is Wan 2.2's second expert (below). Text encoders, the VAE and reward models stay replicated (frozen;
placed by the existing ``visgen.memory`` offload settings).

**Paired forwards.** Under FSDP2 every transformer forward all-gathers the blocks' shards and every backward
reduce-scatters their gradients, so all processes must run the same number of forwards per ``log_probs`` call.
``visgen.recompute.recompute_edges`` runs one velocity call per (trained step, rollout forward) group — a number
that depends on the SDE-step mask, the methods' per-sample step subsets and tree layouts. ``ForwardPadding``
max-reduces that count over the processes once per call, and each pass pads itself with weight-0 velocity calls
(the LLM domain's ``gather.padding_forward``, one level down: per forward instead of per micro-batch). The trainer
already equalises the number of ``log_probs`` calls per optimizer step. Inside ``FSDPShards.gathered()`` (the
deferred behaviour log-prob pass, evaluation) forwards are local and ranks make different numbers of calls, so
nothing is reduced there; only the sampling transformers are gathered there (``sampling_modules``), the full-tuning
reference copy stays sharded.

**Refused** (one-line ``ConfigError`` at trainer set-up, naming the setting): what would keep a full copy of the
trained weights on every process and swap it into sharded parameters (``visgen.ema.enabled``, the NFT / AWM / DGPO /
Flow-DPPO old copies), the likelihood-free objectives (their own forward loops are not padded), Sol-RL's
low-precision explorer (``visgen.two_stage``: a second transformer built from the live weights).

**Loading.** Only process 0 reads the transformers' weights: on every other process ``load_pipeline(...,
meta_transformers=True)`` builds ``transformer`` (and Wan 2.2's ``transformer_2``) on the meta device from their
configs, in the dtypes ``from_pretrained`` gives them, and ``from_pretrained`` loads the other components from a
view of the pipeline directory with the transformers marked null (``place_pipeline`` moves those to the device and
leaves the meta ones); LoRA and the full-tuning reference copy are then added on meta too, and ``setup_fsdp``
(``shared_rl.sharding.shard_from_rank0``) fills every process's shards from process 0's weights after checking that
every process built the same names, shapes and dtypes.

**Wan 2.2's two experts** (``transformer`` trained, LoRA or full fine-tuning, ``transformer_2`` frozen) are sharded
each on its own (blocks, then root; under full fine-tuning the reference copy of ``transformer`` too). Which expert a row goes to depends on its timestep, so under FSDP2 the adapter runs both experts in
every velocity call, an expert without rows on one weight-0 row (``WanAdapter._velocity_both_experts``); with the
padding above, every process then runs each expert equally often.
"""
from __future__ import annotations

from pathlib import Path

import torch

from shared_rl.config import ConfigError

__all__ = ["ForwardPadding", "fsdp_units", "is_sharded", "place_pipeline", "refuse_config", "sampling_modules",
           "save_sharded"]

_HOW = "or use distributed.strategy: replicate"


def refuse_config(cfg) -> None:
    """The one-line ConfigError for each visgen setting FSDP2 cannot run safely (see the module docstring), from the
    config alone: ``--dry-run`` (``visgen.preflight``) and the sharding itself both run it."""
    objective = cfg.training_objective()
    name = getattr(objective, "name", type(objective).__name__)
    if cfg.ema.enabled:
        raise ConfigError("distributed.strategy: fsdp2 with visgen.ema.enabled: the EMA is a full copy of the trained "
                          f"weights on every process, swapped into the sharded ones; set visgen.ema.enabled: false {_HOW}")
    if objective.old_policy() is not None or objective.needs_old_means:
        raise ConfigError(f"distributed.strategy: fsdp2 with visgen.objective {name!r}: its old policy is a full copy "
                          f"of the trained weights on every process; use visgen.objective: {{name: log_prob}} {_HOW}")
    if objective.likelihood_free:
        raise ConfigError(f"distributed.strategy: fsdp2 with visgen.objective {name!r}: its forwards per call are not "
                          f"paired across processes; use visgen.objective: {{name: log_prob}} {_HOW}")
    if cfg.two_stage.enabled:
        raise ConfigError("distributed.strategy: fsdp2 with visgen.two_stage.enabled: the low-precision explorer is "
                          f"a second transformer built from the live weights; set visgen.two_stage.enabled: false {_HOW}")


def _refuse(domain) -> None:
    """``refuse_config``, then what only the loaded pipeline shows (its LoRA saver)."""
    cfg = domain.cfg
    refuse_config(cfg)
    pipe = domain.pipe
    if cfg.train_mode == "lora" and not hasattr(type(pipe), "save_lora_weights"):
        raise ConfigError(f"distributed.strategy: fsdp2 with {type(pipe).__name__} and visgen.train_mode: lora: this "
                          f"pipeline has no LoRA saver to write the gathered adapter with {_HOW}")


def _units(transformer: torch.nn.Module, where: str) -> list[torch.nn.Module]:
    names = set(getattr(transformer, "_no_split_modules", None) or [])
    blocks: list[torch.nn.Module] = []

    def post_order(module: torch.nn.Module) -> None:
        # a listed module inside another listed one (HunyuanVideo 1.5's token refiner) is sharded first: fully_shard
        # must see the inner unit before the outer one claims the remaining parameters
        for child in module.children():
            post_order(child)
        if module is not transformer and type(module).__name__ in names:
            blocks.append(module)

    post_order(transformer)
    if not blocks:
        raise ConfigError(f"visgen: cannot find the repeated blocks of {where} {type(transformer).__name__} for FSDP2 "
                          f"(_no_split_modules={sorted(names)}); use distributed.strategy: replicate")
    return blocks + [transformer]


def fsdp_units(domain) -> list[torch.nn.Module]:
    """The modules to shard, blocks first then each root: the trained transformer and, under full fine-tuning, the
    frozen reference copy. Raises ConfigError for the refused features. Installs the forward padding."""
    _refuse(domain)
    policy = domain.policy
    units = _units(policy.transformer, "the transformer")
    if policy.reference_copy is not None:  # full tuning's KL reference: sharded too, never whole on every process
        units += _units(policy.reference_copy, "the reference copy of the transformer")
    second = getattr(domain.pipe, "transformer_2", None)
    if second is not None and getattr(domain.pipe, "transformer", None) is not None:  # Wan 2.2's frozen second expert
        units += _units(second, "the second expert (transformer_2)")
    domain.rollouts.forward_pad = ForwardPadding()
    return units


def sampling_modules(domain) -> list[torch.nn.Module]:
    """What rollouts, evaluation and the before/after grid run (``DomainBase.fsdp_sampling_modules``): the trained
    transformer (with LoRA its adapter-off reference too) and Wan 2.2's frozen second expert, which samples the
    low-noise steps. Not the full-tuning reference copy: its forwards are the KL's in ``log_probs`` (paired training
    forwards), and the "before" grid of a full-tuning run is drawn at start-up, before sharding. The EMA and old
    copies a sampler could roll out with are refused under FSDP2 (``refuse_config``)."""
    units = [domain.policy.transformer]
    second = getattr(domain.pipe, "transformer_2", None)
    if second is not None and getattr(domain.pipe, "transformer", None) is not None:
        units.append(second)
    return units


class ForwardPadding:
    """``recompute_edges``' ``pad``: the largest number of velocity calls per pass over the processes (one
    all-reduce; the trainer makes every process call ``log_probs`` equally often). Identity with one process and
    inside ``FSDPShards.gathered()``, where forwards issue no collective."""

    def __init__(self) -> None:
        from shared_rl.distributed import Dist

        self.dist = Dist()  # the trainer's process group, initialised before the domain is built
        self.padded = 0  # padding velocity calls this process ran (for tests and diagnostics)

    def __call__(self, n: int) -> int:
        from shared_rl.distributed import shards_gathered

        if not self.dist.enabled or shards_gathered():
            return n
        agreed = int(self.dist.all_reduce_(torch.tensor([n]), "max"))
        self.padded += agreed - n
        return agreed


def place_pipeline(pipe, device: torch.device) -> None:
    """``pipe.to(device)``, except that components on the meta device (the transformers of an FSDP2 process > 0,
    ``load_pipeline(meta_transformers=True)``) stay there: ``setup_fsdp`` allocates their shards on ``device``."""
    meta = {name for name, c in pipe.components.items()
            if isinstance(c, torch.nn.Module) and any(t.is_meta for t in c.parameters())}
    if not meta:
        pipe.to(device)
        return
    for name, c in pipe.components.items():
        if isinstance(c, torch.nn.Module) and name not in meta:
            c.to(device)


def is_sharded(module: torch.nn.Module) -> bool:
    from shared_rl.distributed import is_dtensor

    return any(is_dtensor(p) for p in module.parameters())


def save_sharded(policy, out_dir: Path, write) -> None:
    """``final/`` of a sharded run, called on every process: gather the trained tensors (collective), then only
    process 0 writes. LoRA: ``write(layers)`` gets the full PEFT adapter tensors (the one-process layout); full
    tuning: the transformer's config and its full weights in the diffusers layout (``transformer/``)."""
    import torch.distributed as dist

    from shared_rl.distributed import full_tensors

    main = dist.get_rank() == 0
    if policy.train_mode == "lora":
        from peft.utils import get_peft_model_state_dict

        layers = get_peft_model_state_dict(policy.transformer, adapter_name=policy.ADAPTER)  # DTensor shards
        layers = {k: v.detach().contiguous() for k, v in full_tensors(layers).items()}
        if main:
            write(layers)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(policy.transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if main:
        from safetensors.torch import save_file

        target = Path(out_dir) / "transformer"
        target.mkdir(parents=True, exist_ok=True)
        policy.transformer.save_config(target)
        save_file({k: v.contiguous() for k, v in state.items()}, str(target / "diffusion_pytorch_model.safetensors"),
                  metadata={"format": "pt"})
