"""The contract between the domain-agnostic trainer and a domain (visgen, robotics, llm, toy): one hook protocol,
declared here once.

A domain is found by name through ``shared_rl.registry`` (a string -> "module:Class" table plus the
``grove.domains`` entry point group), so ``shared_rl`` never imports ``visgen`` or ``robotics``. A domain subclasses
``DomainBase`` and names its settings class (``config_class``, a dataclass subclassing ``DomainConfig``, filled from
the YAML section named after the domain). Every optional hook has its default on these two base classes; the
trainer and the config loader call them directly (no probing).

One training iteration, as the trainer runs it (``shared_rl/trainer.py``; ``shared_rl/reference.py`` is the same
loop on one screen)::

    keys    = sampler.select(domain.train_keys(), groups_per_iteration)   # sampler = domain.key_sampler(configured)
    rollout = domain.rollout(keys, group_size, generator, iteration)    # no grad; rewards included
    rollout = selection filter by key (+ refill: more keys, domain.rollout again; trim to groups_per_iteration keys)
    sampler.update(each drawn key once, successes summed over its groups)
    adv     = ESTIMATORS[advantage.estimator](rewards, group ids | parent array | critic values)
    for epoch, minibatch, micro-batch:
        out  = domain.log_probs(rollout, idx, need_kl)                  # with grad, [n, T]
        loss = aggregate(policy_loss(out.logp, rollout.logp_old[idx], adv[idx], rollout.mask[idx])) + kl_coef*KL
             (+ value_coef * value loss with a critic estimator)
    + Σ coef·loss over domain.auxiliary_losses(iteration, step, rank, world)   # e.g. robotics' demo replay
    domain.before_optimizer_step() -> optimizer step -> domain.after_optimizer_step()
    -> metrics -> domain.evaluate() -> checkpoint (domain.state_dict, domain.extra_state)

**Groups.** ``rollout.keys`` has one entry per group. A key may own several groups (E-GRPO: one per (prompt,
consolidated step)); the trainer counts, filters, refills and trims by requested key, so a domain returning
several groups per key lists the key once per group and, when one call may request the same key twice, says
which request each group answers in ``Rollout.key_index``.

**A critic (PPO, ``advantage.estimator: {name: gae, ...}``).** The domain's rollout puts in its payload ``values``
``[N, C]`` (the critic's value of the state at each of a sequence's C decisions, e.g. action chunks; each decision
owns T / C consecutive steps) and ``value_mask`` ``[N, C]`` (the decisions taken, a prefix of each row), optionally
``step_rewards`` ``[N, C]``; ``log_probs`` returns ``StepLogProbs.values`` with grad, and the critic's parameters
are among ``parameters()`` and listed by ``critic_parameters()``. The estimator turns them into per-step advantages
and value targets (``advantages.gae``); the trainer adds ``value_coef ·`` the value loss (``losses.value_loss``).

**Deferred behaviour log-probs.** A domain whose rollout is sampled by the current weights may leave
``logp_old`` to the trainer's first forward: it marks those steps in ``Rollout.logp_deferred``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from .domain_config import DomainConfig  # noqa: F401  (shared_rl.domain.DomainConfig, as before)
from .rollout import Rollout


@dataclass
class StepLogProbs:
    """What ``Domain.log_probs`` returns for a micro-batch of n sequences of T steps.

    logp: ``[n, T]`` log-probs under the current parameters (with grad), same layout as ``Rollout.logp_old``.
    kl: ``[n, T]`` per-step KL to the reference policy (with grad) when the domain computes it itself (e.g.
        Flow-GRPO's Gaussian-mean KL), else None.
    ref_logp: ``[n, T]`` reference-policy log-probs (no grad) when asked for KL and ``kl`` is None; the trainer
        then applies the configured estimator (k1/k3).
    entropy: ``[n, T]`` per-step entropy, or None: logged, and trained by ``loss.entropy`` where it carries grad
        (llm, toy).
    objective_pos, objective_neg: ``[n, T]`` (with grad) the two per-step terms of a likelihood-free objective,
        for the policy losses that combine them with the advantage (``nft``: DiffusionNFT's positive/negative
        branch losses; ``awm``: the flow-matching loss in ``objective_pos``). ``logp`` is then zeros. None otherwise.
    """

    logp: torch.Tensor
    kl: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    nfe: int = 0  # model forward evaluations spent on this call (per sample; CFG counts 2)
    objective_pos: torch.Tensor | None = None
    objective_neg: torch.Tensor | None = None
    step_std: torch.Tensor | None = None  # [n, T] each step's transition std (flow domains; GRPO-Guard's RatioNorm)
    values: torch.Tensor | None = None  # [n, C] the critic's value per decision (with grad; PPO, advantage.estimator: gae)
    group: torch.Tensor | None = None  # [n] the group of each row, for losses that couple a group's rows (DGPO)
    # [n, T] the old policy's log-probs computed in this call, when the domain keeps a lagging copy that moves within an
    # iteration (DGPO's EMA ``ema_ref``): the trainer's ratio uses it instead of the rollout's ``logp_old``
    logp_old: torch.Tensor | None = None
    # [n, T] the KL between the policy's and the old policy's step Gaussians, ||mu - mu_old||^2 / (2 std^2), the old
    # means frozen for the batch (Flow-DPPO's mask, loss.policy_loss flow_dppo); None when not computed
    old_kl: torch.Tensor | None = None


@dataclass
class RunContext:
    """What the trainer hands a domain: where to write, which device, the seed, and the process layout."""

    run_dir: Path | None
    device: torch.device
    seed: int
    process_index: int = 0
    num_processes: int = 1
    log: Any = print  # a callable taking one string, for human-readable progress lines
    # the validated TrainConfig (None for a domain built by hand): trainer-section values a domain needs at run time
    # (e.g. which rewards train, advantage.weights) are read from here, never copied into its own config
    train_cfg: Any = None
    # objects the user already holds, handed over through the Python API instead of paths in the config (e.g. the
    # llm domain reads "model" and "tokenizer"); a domain documents the names it reads and ignores the rest
    objects: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Domain(Protocol):
    """A policy plus its environment/reward, as the trainer needs it.

    Implementations also define a class attribute ``config_class``: a dataclass of domain settings, filled from
    the YAML section named after the domain (validated by ``shared_rl.config``).
    """

    def train_keys(self) -> Sequence[int]:
        """The pool of group keys the selector draws from (prompt ids, training reset-state ids)."""

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        """Sample ``group_size`` outcomes (or a tree) per key, score them, return a ``Rollout`` (no grad)."""

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool) -> StepLogProbs:
        """Recompute the log-probs of sequences ``idx`` of ``rollout`` under the current parameters, with grad.

        Must reproduce ``rollout.logp_old[idx]`` exactly (ratio 1) before any update for the same batch layout.
        """

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters (LoRA adapters, or the whole model)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trainable weights (plus EMA or other tensors the domain needs to resume exactly)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def evaluate(self, iteration: int) -> dict[str, float]:
        """Held-out evaluation; keys start with ``eval/``. Called before the first update and at the end."""


class DomainBase:
    """The optional hooks of a domain, with their defaults; every domain subclasses it."""

    config_class: type[DomainConfig] = DomainConfig
    # log_probs(rollout, idx, need_kl, steps=mask) computes only the steps of ``steps`` (a subset of the rows'
    # trained steps; the others may be 0), so the trainer can back-propagate step by step (optim.backward_steps)
    supports_step_subsets: bool = False

    def critic_parameters(self) -> list[torch.nn.Parameter]:
        """The critic's (value head's) parameters, also among ``parameters()``; a critic estimator with its own
        ``lr`` steps them at that rate (PPO practice: a value head moving at the policy's rate turns its own noise
        into advantage noise)."""
        return []

    def key_sampler(self, sampler):
        """The key sampler the trainer draws with: the configured one (``selection.sampler``), or the domain's
        wrapping of it (robotics: ``selection.StratifiedSampler`` over its tasks, from its own config). A sampler
        reports its own metrics (``iteration_metrics``)."""
        return sampler

    def auxiliary_losses(self, iteration: int, step: int, rank: int, world: int) -> dict[str, tuple[float, torch.Tensor]]:
        """Named ``(coefficient, loss with grad)`` terms added to each optimizer step after its micro-batches
        (skipped while a critic warms up): e.g. robotics' replay of its demonstrations, an anchor against
        forgetting. Drawn from (seed, ``iteration``, optimizer ``step``) only, so a resumed run replays the same
        batches; with ``world`` processes each returns its share of one global minibatch (rows ``rank::world``,
        weighted by their fraction) so that the sum over ranks is the global mean. The trainer logs ``loss/<name>``."""
        return {}

    def auxiliary_loss_names(self) -> list[str]:
        """The names ``auxiliary_losses`` returns terms for in this run (none by default); ``loss.policy_coef: 0``
        needs at least one, since nothing else would train."""
        return []

    def before_optimizer_step(self) -> None:
        """Called right before each optimizer step, after the gradients are summed and clipped (a domain that
        rescales the step of some weights snapshots them here and rescales in ``after_optimizer_step``)."""

    def after_optimizer_step(self) -> None:
        """Called after each optimizer step (EMA updates, schedule moves)."""

    def extra_state(self) -> dict[str, Any]:
        """JSON-serialisable state to resume exactly (besides ``state_dict``)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def before_final_evaluation(self, iteration: int) -> dict[str, float]:
        """Called once after the last iteration, before the final evaluation (no grad): a domain that selects
        among the weights it saw (per-task early stopping) puts the selected ones in place here; returns metrics."""
        return {}

    def on_train_end(self, run_dir: Path | None, history: list[dict[str, float]]) -> None:
        """Write plots, sample grids, a summary."""

    def save_pretrained(self, out_dir: Path) -> None:
        """Export the trained policy in its native format (PEFT/diffusers layout, transformers...)."""

    def evaluate(self, iteration: int) -> dict[str, float]:
        return {}

    def fsdp_modules(self) -> list[torch.nn.Module]:
        """The modules to shard with FSDP2 (``distributed.strategy: fsdp2``), in ``fully_shard`` order: the
        repeated blocks (transformer layers) first, then the root module whose forward the domain calls. Empty (the
        default) means the domain does not support FSDP2; the trainer then stops with a ConfigError.

        A domain that returns modules agrees to: (1) run its training forward through the root's ``__call__`` and
        read parameters through the modules at call time (FSDP2 swaps shards and gathered tensors in and out of
        module attributes); (2) make every ``log_probs`` call issue the same sequence of module forwards whatever
        the data (each forward is a collective); (3) accept DTensor values in ``load_state_dict`` laid out like its
        own ``state_dict`` (the trainer shards checkpoints before handing them over); (4) under FSDP2,
        ``save_pretrained`` is called on *every* process (gather, then write on ``process_index == 0``).
        Rollouts, evaluation and ``on_train_end`` run with the shards of ``fsdp_sampling_modules()`` gathered, so
        they may use those modules freely (but not ``Module.state_dict()``)."""
        return []

    def fsdp_sampling_modules(self) -> list[torch.nn.Module] | None:
        """Under FSDP2 the models rollouts, evaluation and ``on_train_end`` run forwards of (called after
        ``fsdp_modules()``): ``FSDPShards.gathered()`` all-gathers only the ``fsdp_modules()`` units inside them (or
        holding one), so a frozen copy only the training forwards use (a full-fine-tuning KL reference) stays
        sharded and a rollout round holds one whole model per process, not two; a left-out unit's forward inside
        raises. Name every copy the samplers or evaluation run (Wan 2.2's frozen second expert, an old / EMA copy a
        sampler rolls out with). None (the default): every unit is gathered."""
        return None

    def fsdp_roots(self) -> list[torch.nn.Module]:
        """The models the ``fsdp_modules()`` units belong to, with whatever lies outside every unit (buffers such
        as the tiny VLA's noise levels, a whole frozen reference copy): where a process built its models on the
        meta device (``shared_rl.sharding.meta_unless_rank0``), ``setup_fsdp`` broadcasts those tensors from process
        0. Default: the domain's ``torch.nn.Module`` attributes, in the order they were set (the same on every
        process)."""
        return [v for v in vars(self).values() if isinstance(v, torch.nn.Module)]
