"""The domain-agnostic GRPO-family training loop.

Read ``Trainer.iteration`` top to bottom: collect (select keys → rollout → reward metrics → filter/refill by key;
``shared_rl.collect``) → advantages (one registered estimator) → inner epochs of minibatches → per micro-batch the
loss (``Trainer.loss``: the registered policy loss, aggregated, plus kl_coef·KL, plus a critic's value loss) →
auxiliary losses → optimizer step (``shared_rl.optim``) → metrics. ``Trainer.fit`` adds evaluation, checkpoints
(``shared_rl.checkpoint.save_run`` / ``restore_run``: exact resume), signals (``shared_rl.signals``) and the
end-of-run plot and summary (``shared_rl.run_files``). The cross-process plumbing (global view, index maps, stats
reduction, FSDP2 padding forwards) lives in ``shared_rl.gather``, the FSDP2 set-up in ``shared_rl.sharding``.
``shared_rl/reference.py`` is the same iteration for one process on one screen.

Determinism: every iteration draws its randomness from a generator seeded by (seed, iteration), so a resumed
run replays exactly the iterations an uninterrupted run would (tested bitwise on CPU).
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .advantages import ESTIMATORS, AdvantageInputs, AdvantageOutput
from .checkpoint import checkpoint_sharded, restore_run, rng_state, save_run, set_rng_state
from .collect import Collector, iteration_seed, oom_hint, weighted_reward  # noqa: F401  (iteration_seed re-exported)
from .config import ConfigError, TrainConfig, dump_train_config
from .domain import RunContext, StepLogProbs
from .errors import NonFiniteError  # noqa: F401  (re-exported)
from .gather import PER_STEP_STATS, StepStats, any_rank, local_index, padding_forward, reduce_stats
from .losses import (Normalizer, aggregate, entropy_bonus, get_policy_loss, high_entropy_mask, kl_per_step,
                     off_policy_sequence_mask, value_loss)
from .metrics import MetricsLogger, duration, eta, plot_metrics
from .optim import Optimizer, WeightEMA, make_scheduler  # noqa: F401  (re-exported)
from .registry import resolve_domain
from .rewards import RewardInterrupted, reward_calls
from .rollout import Rollout
from .run_files import write_config_for_the_cli, write_summary
from .rundir import begin_final, commit_final
from .selection import make_sampler
from .sharding import check_settings, memory_line, setup_fsdp
from .signals import after_the_last_iteration, stop_on_signals
from .signals import detach_terminal as _detach_terminal  # noqa: F401  (re-exported)


@dataclass
class LossParts:
    """One micro-batch's loss (``Trainer.loss``): ``total`` to backpropagate, its policy, KL and entropy-bonus parts
    (None when off), the policy loss's per-step ``stats`` and ``kept``, the steps the policy loss trained on (the
    trained steps, or their high-entropy part under ``loss.entropy.top_quantile``)."""

    total: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor | None
    entropy_bonus: torch.Tensor | None
    stats: dict[str, torch.Tensor]
    kept: torch.Tensor


def _add_step_stats(stats: StepStats, st: dict[str, torch.Tensor], mask: torch.Tensor, out: StepLogProbs) -> None:
    """Ratio, clip fraction, approximate KL (½·log-ratio²) and entropy of one micro-batch's trained steps."""
    m = mask.bool()
    n_steps = float(m.sum())
    stats.add("ratio/mean", float(st["ratio"][m].sum()), n_steps)
    stats.add("clip_frac", float(st["clipped"][m].sum()), n_steps)
    stats.add("approx_kl", float((0.5 * st["log_ratio"][m] ** 2).sum()), n_steps)
    if m.any():
        stats.max("ratio/max", float(st["ratio"][m].max()))
    if "off_policy_dropped" in st:
        stats.add("off_policy_dropped", float(st["off_policy_dropped"][m].sum()), n_steps)
    if out.entropy is not None:
        stats.add("entropy", float(out.entropy.detach()[m].sum()), n_steps)


def gradient_noise_stats(first: torch.Tensor, second: torch.Tensor, n_first: float, n_second: float) -> dict:
    """The gradient noise scale's two estimates from one optimizer step (McCandlish et al. 2018, App. A).

    ``first`` / ``second``: the two halves' contributions to the step's gradient (they sum to it), ``n_*`` their
    sequences. With the loss a mean over the step's ``n = n_first + n_second`` sequences, each half's mean gradient is
    ``G_h = (n / n_h) · g_h``. For independent halves ``E[G_1 · G_2] = |G|²`` and ``E|G_h|² = |G|² + tr(Σ) / n_h``
    (Σ: the covariance of one sequence's gradient), so ``grad/signal_sq = G_1 · G_2`` and ``grad/noise_trace =
    mean_h n_h (|G_h|² − G_1 · G_2)`` are unbiased; their ratio is the batch at which noise equals signal."""
    if n_first < 1 or n_second < 1:
        return {}
    n = n_first + n_second
    g1, g2 = first.double() * (n / n_first), second.double() * (n / n_second)
    dot, s1, s2 = float(g1 @ g2), float(g1 @ g1), float(g2 @ g2)
    return {"grad/signal_sq": dot, "grad/noise_trace": (n_first * (s1 - dot) + n_second * (s2 - dot)) / 2,
            "grad/half_cosine": dot / math.sqrt(s1 * s2) if s1 * s2 > 0 else 0.0}


class Trainer:
    """Builds the domain from a validated ``TrainConfig`` and runs it."""

    def __init__(self, cfg: TrainConfig, run_dir: Path | None = None, log=print,
                 objects: dict[str, Any] | None = None) -> None:
        """``objects``: things the caller already holds (a model, a tokenizer...), handed to the domain
        (``RunContext.objects``) instead of being loaded from the config's paths; see ``shared_rl.api``."""
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else None
        self.log = log
        from .distributed import Dist
        from .preflight import preflight, resolve_device

        preflight(cfg)  # the device, optional loggers and the domain's inputs, before any model loads
        self.device = resolve_device(cfg.device)
        self.dist = Dist(self.device)
        if (self.dist.enabled and cfg.distributed.strategy == "replicate"
                and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"):
            raise ConfigError("launched with an accelerate FSDP config but distributed.strategy is replicate; add "
                              "distributed.strategy=fsdp2 (grove shards the policy itself and does not read "
                              "accelerate's fsdp_config) or launch with configs/accelerate/multi_gpu_ddp.yaml")
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        check_settings(cfg, self.dist.world, self.device)  # the mesh, offload and precision, before models load
        torch.manual_seed(cfg.seed)
        self._held = sorted(objects or {})  # names of the objects the caller holds (config.yaml's header)
        ctx = RunContext(run_dir=self.run_dir, device=self.device, seed=cfg.seed, log=log,
                         process_index=self.dist.rank, num_processes=self.dist.world, train_cfg=cfg,
                         objects=dict(objects or {}))
        self.domain = resolve_domain(cfg.domain)(cfg.domain_config, ctx)
        self.fsdp = setup_fsdp(cfg, self.domain, self.dist, self.device, log) if (
            cfg.distributed.strategy == "fsdp2") else None
        if cfg.loss.policy_coef == 0 and not self.domain.auxiliary_loss_names():
            raise ConfigError(f"loss.policy_coef: 0 trains the auxiliary losses alone; domain {cfg.domain!r} has none")
        params = [p for p in self.domain.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(f"domain {cfg.domain!r} exposes no trainable parameters")
        self.estimator = ESTIMATORS[cfg.advantage.estimator.name]
        self.critic = cfg.advantage.estimator.settings if cfg.advantage.kind == "step" else None  # GAESettings
        self.policy_loss = cfg.policy_loss_choice()
        if cfg.optim.backward_steps:
            self._check_backward_steps()
        self.optim = Optimizer(cfg, self.domain, params, self.critic.lr if self.critic else None, self.dist,
                               self.fsdp, log)
        self.steps_per_iteration = self.optim.steps_per_iteration
        self.sampler = self.domain.key_sampler(make_sampler(cfg.selection))
        # reward name -> weight: advantage.weights, else the domain's own defaults (e.g. llm.rewards[].weight);
        # read here, never written back into the trainer's config sections
        self.reward_weights = dict(cfg.advantage.weights or cfg.domain_config.default_reward_weights())
        self.collector = Collector(cfg, self.domain, self.dist, self.sampler, self.reward_weights, self._gathered)
        self.start_iteration = 0
        self._value_targets = None  # (old values, value targets, value mask) of this iteration's local rows (critic)
        self._policy_weight = 1.0  # 0 while the critic warms up
        self._aux_at = (0, 0)  # (iteration, optimizer step within it): what auxiliary losses draw their batch from
        self.padding_forwards = 0  # FSDP2: weight-0 forwards run to keep collectives paired (see _optimizer_step)
        self.history: list[dict[str, Any]] = []
        self._stop_requested = False
        self.stop_signal: str | None = None  # "SIGINT" / "SIGTERM" / "SIGHUP" once one asked the run to stop
        self._last_eval_s: float | None = None  # how long the previous evaluation took (announced when long)
        self._fit_clock: tuple[float, int] = (time.monotonic(), 0)  # (fit's start, its first iteration): the ETA
        self.restored_from: Path | None = None
        self.resume_note: dict[str, Any] = {}  # merged into the first record after a resume (e.g. its overrides)

    def _check_backward_steps(self) -> None:
        """optim.backward_steps splits a micro-batch's steps over backward passes: what that needs."""
        cfg, n = self.cfg, self.cfg.optim.backward_steps
        why = None
        if not self.domain.supports_step_subsets:
            why = f"domain {cfg.domain!r} computes all of a sequence's steps in one call"
        elif get_policy_loss(self.policy_loss.name).whole_sequence(self.policy_loss.settings):
            why = f"loss.policy_loss {self.policy_loss.name!r} needs all of a sequence's steps at once"
        elif cfg.loss.entropy.top_quantile < 1:
            why = "loss.entropy.top_quantile ranks all of a micro-batch's steps at once"
        elif cfg.loss.off_policy_mask is not None:
            why = "loss.off_policy_mask reads a sequence's mean KL over all its steps"
        elif self.critic is not None:
            why = "a critic's value loss is per sequence"
        elif self.fsdp is not None:
            why = "distributed.strategy fsdp2 pairs one collective forward per micro-batch"
        if why:
            raise ConfigError(f"optim.backward_steps={n}: {why}; set optim.backward_steps: 0")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optim.adamw

    @property
    def scheduler(self):
        return self.optim.scheduler

    @property
    def ema(self) -> WeightEMA | None:
        return self.optim.ema

    @property
    def nonfinite_total(self) -> int:
        return self.optim.nonfinite_total

    def _gathered(self):
        """FSDP2: the shards gathered for work whose forward count differs per rank (no-op otherwise)."""
        return self.fsdp.gathered() if self.fsdp is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------------------------------
    def iteration(self, it: int) -> dict[str, float]:
        """One GRPO iteration; returns its metrics. Decisions (filter, refill, advantages, minibatches) are taken
        on the global view of every rank's rollout (``view``); each rank trains on the sequences it sampled
        (``local``, with the domain's payload)."""
        cfg = self.cfg
        seed = iteration_seed(cfg.seed, it)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed + self.dist.rank)
        t0 = time.perf_counter()

        # 1–4. select keys, roll out (rewards included), filter and refill by key, update the key sampler
        reward_calls.begin()
        got = self.collector.collect(it, gen)
        reward_calls.check(it)  # every reward call failed: stop (exit 1) rather than train on NaN
        local, view, metrics = got.local, got.view, got.metrics
        if self.fsdp is not None and any_rank(self.dist, local is None):
            raise RuntimeError(f"iteration {it}: a process sampled no sequence, so it cannot pad its FSDP2 training "
                               f"forwards; lower rollout.groups_per_call")
        if len(view) == 0:
            self.log(f"iteration {it}: every group was filtered out; no update")
            metrics.update({"time/train": 0.0, "lr": self.optim.lr(), "nfe/train": 0})
            return metrics

        # 5. advantages: one per sequence from the global view (groups or the parent array), or one per decision
        #    from a critic's values (computed on this rank's rows; batch statistics over every rank)
        to_local = local_index(view, local)  # global sequence -> this rank's sequence, or -1
        adv = self._advantages(local, view, to_local, metrics)
        self._policy_weight = 0.0 if self.critic is not None and it < self.critic.warmup else 1.0
        self._aux_at = (it, 0)

        # 6. inner epochs of minibatches; each minibatch is one optimizer step (its loss: Trainer.loss), accumulated
        #    over micro-batches and normalised by the minibatch's global step counts
        t1 = time.perf_counter()
        nfe_train = self._prefill_deferred_logp(local, to_local) if cfg.loss.policy_coef > 0 else 0
        stats = StepStats()
        trainable = torch.nonzero(view.mask.any(dim=1)).flatten()
        for _epoch in range(cfg.optim.inner_epochs):
            order = trainable[torch.randperm(trainable.numel(), generator=gen)]
            for mb in torch.tensor_split(order, cfg.optim.minibatches_per_epoch):
                if mb.numel():
                    norm = Normalizer.from_mask(view.mask[mb], cfg.loss.max_steps_norm)
                    mine = mb[to_local[mb] >= 0]
                    nfe_train += self._optimizer_step(local, to_local[mine], adv[mine], norm, stats)

        # 7. metrics (summed over ranks)
        metrics.update(reduce_stats(self.dist, stats))
        if metrics.get("grad/signal_sq", 0.0) > 0:  # the ratio of the iteration's means (McCandlish et al.'s B_simple)
            metrics["grad/noise_scale"] = metrics["grad/noise_trace"] / metrics["grad/signal_sq"]
        nfe = torch.tensor([float(nfe_train)])
        metrics.update({"nfe/train": float(self.dist.all_reduce_(nfe)), "time/train": time.perf_counter() - t1,
                        "lr": self.optim.lr()})
        # wall time of the whole iteration (selection, rollout, gathers, advantages, updates), the same on every rank
        metrics["time/iteration"] = time.perf_counter() - t0
        first = got.drawn[0]
        leaves = int(torch.isfinite(next(iter(first.rewards.values()))).sum()) if first.rewards else len(first)
        metrics["samples_per_s"] = leaves / max(metrics["time/iteration"], 1e-9)
        return metrics

    # ---- advantages --------------------------------------------------------------------------------------------
    def _advantages(self, local: Rollout | None, view: Rollout, to_local: torch.Tensor,
                    metrics: dict[str, float]) -> torch.Tensor:
        """Advantages of the global view's sequences by the configured estimator: ``[N]`` (flat, tree), or ``[N, T]``
        per step for a critic estimator, whose per-decision advantages fill only this rank's rows (the others are
        trained elsewhere); it keeps (old values, value targets, value mask) of the local rows for the value loss."""
        a = self.cfg.advantage
        if self.critic is None:
            out = self.estimator(AdvantageInputs(view.rewards, view.group_ids, self.reward_weights, view.parent,
                                                 view.fusion_logit), a)
            metrics.update(out.metrics)
            return out.advantages
        n, t = view.mask.shape
        adv_view = torch.zeros(n, t)
        rows = torch.nonzero(to_local >= 0).flatten()
        mine = to_local[rows]
        out, values, vmask = self._critic_advantages(local, mine)
        metrics.update(out.metrics)
        self._value_targets = None
        if local is None:
            return adv_view
        if t % values.shape[1]:
            raise ValueError(f"domain {self.cfg.domain!r}: {t} log-prob steps do not split into the "
                             f"{values.shape[1]} decisions of payload['values']")
        adv_view[rows] = out.advantages.repeat_interleave(t // values.shape[1], dim=1)
        returns = torch.zeros_like(values)
        returns[mine] = out.returns
        self._value_targets = (values, returns, vmask)
        return adv_view

    def _critic_advantages(self, local: Rollout | None, mine: torch.Tensor):
        """The critic estimator on this rank's kept rows ``mine`` (every rank calls it: batch normalisation is a
        collective). Returns (its output, the local rows' values, value mask)."""
        if local is None:
            empty = torch.zeros(0, 1)
            out = self.estimator(AdvantageInputs({}, torch.zeros(0, dtype=torch.long), self.reward_weights,
                                                 values=empty, value_mask=empty.bool(),
                                                 all_reduce=self.dist.all_reduce_), self.cfg.advantage)
            return out, None, None
        p = local.payload
        if "values" not in p or "value_mask" not in p:
            raise ConfigError(f"advantage.estimator {self.estimator.name!r} needs the critic's values, but domain "
                              f"{self.cfg.domain!r} rollouts carry none (payload 'values' and 'value_mask'); enable "
                              f"the domain's critic (robotics: robotics.critic) or use a group estimator (grpo)")
        values, vmask = p["values"].float().cpu(), p["value_mask"].bool().cpu()
        step_r = p.get("step_rewards")
        inputs = AdvantageInputs({k: r[mine] for k, r in local.rewards.items()}, local.group_ids[mine],
                                 self.reward_weights, values=values[mine], value_mask=vmask[mine],
                                 step_rewards=step_r.float().cpu()[mine] if step_r is not None else None,
                                 all_reduce=self.dist.all_reduce_)
        out: AdvantageOutput = self.estimator(inputs, self.cfg.advantage)
        return out, values, vmask

    # ---- the loss ----------------------------------------------------------------------------------------------
    def loss(self, out: StepLogProbs, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             norm: Normalizer, row_steps: torch.Tensor | None = None) -> LossParts:
        """One micro-batch's share of the minibatch loss: aggregate(policy loss) + kl_coef · aggregate(KL)
        − entropy coef · mean entropy (``loss.entropy``; its ``top_quantile`` keeps the policy loss on the
        high-entropy steps only). ``row_steps``: each row's trained steps in the whole micro-batch when ``mask`` is
        a chunk of its steps."""
        lc, choice = self.cfg.loss, self.policy_loss
        per_step, st = get_policy_loss(choice.name)(out.logp, logp_old, adv, mask, lc, choice.settings, terms=out)
        ent, kept = lc.entropy, mask
        if lc.off_policy_mask is not None:  # DeepSeek-V3.2: drop far-off-policy negative-advantage sequences
            keep = off_policy_sequence_mask(adv, out.logp, logp_old, mask, lc.off_policy_mask)
            per_step = per_step * keep
            st = {**st, "off_policy_dropped": (1.0 - keep).expand_as(out.logp).detach()}
        if ent.enabled or ent.top_quantile < 1:
            if out.entropy is None:
                raise ConfigError(f"loss.entropy needs the per-step entropy, which domain {self.cfg.domain!r} does not "
                                  f"return; set loss.entropy.coef: 0, no target and top_quantile: 1")
            if ent.top_quantile < 1:
                kept = high_entropy_mask(out.entropy, mask, ent.top_quantile)
                per_step = per_step * kept
        policy = aggregate(per_step, mask, lc.aggregation, norm, row_steps)
        total, kl, bonus = policy, None, None
        if lc.kl_coef > 0:
            kl_steps = kl_per_step(lc.kl_estimator, out.logp, out.ref_logp, out.kl)
            kl = aggregate(kl_steps, mask, lc.aggregation, norm, row_steps)
            total = total + lc.kl_coef * kl
        if ent.enabled:
            if torch.is_grad_enabled() and not out.entropy.requires_grad:
                raise ConfigError(f"loss.entropy.coef: domain {self.cfg.domain!r}'s per-step entropy carries no "
                                  f"gradient (a fixed-noise Gaussian step's entropy does not depend on the weights), "
                                  f"so the bonus would change nothing; set loss.entropy.coef: 0 and no target")
            bonus = entropy_bonus(out.entropy, kept, norm)
            total = total - self.optim.entropy.applied() * bonus
        return LossParts(total, policy, kl, bonus, st, kept)

    def _optimizer_step(self, rollout: Rollout | None, local_idx: torch.Tensor, adv: torch.Tensor,
                        norm: Normalizer, stats: StepStats) -> int:
        """One optimizer step over this rank's share ``local_idx`` of a global minibatch (normalised by ``norm``,
        the minibatch's global counts), accumulated over micro-batches; gradients are summed across ranks.
        Under FSDP2 every forward is a collective: ranks with fewer micro-batches than the busiest one add padding
        forwards of loss weight 0 (``gather.padding_forward``) so that all ranks issue the same collectives."""
        cfg = self.cfg
        micro = cfg.optim.micro_batch_size or max(1, local_idx.numel())
        need_kl = cfg.loss.kl_coef > 0
        value_norm = self._value_norm(local_idx)
        self.optimizer.zero_grad(set_to_none=True)
        nfe = 0
        step_entropy = torch.zeros(2, dtype=torch.float64)  # Σ H and the count over the kept steps (adaptive bonus)
        # logging.grad_noise_scale: the micro-batches of the two halves of this share, the gradient snapshotted at
        # the boundary (the sum of the halves is the step's gradient, so the update is the same)
        noise = cfg.logging.grad_noise_scale
        half = (local_idx.numel() + 1) // 2 if noise else local_idx.numel()
        splits, boundary, first_half = [], 0, None
        for part_idx, part_adv in ((local_idx[:half], adv[:half]), (local_idx[half:], adv[half:])):
            splits += [(i, a) for i, a in zip(torch.split(part_idx, micro), torch.split(part_adv, micro)) if i.numel()]
            boundary = boundary or len(splits)
        n_calls = len(splits) if cfg.loss.policy_coef > 0 else 0  # policy_coef 0: the auxiliary losses alone
        if self.fsdp is not None:
            n_calls = int(self.dist.all_reduce_(torch.tensor([len(splits)]), "max"))
        for call in range(n_calls):
            if noise and call == boundary and first_half is None:
                first_half = self._flat_grads()
            if call >= len(splits):
                padding_forward(self.domain, rollout, need_kl)
                self.padding_forwards += 1
                continue
            idx, a = splits[call]
            full = rollout.mask[idx]
            # optim.backward_steps: this micro-batch's trained step columns in chunks, one forward + backward each,
            # so only one chunk's graph is alive at a time (the sum of the chunks' losses is the micro-batch's loss)
            for steps in _step_chunks(full, cfg.optim.backward_steps):
                with oom_hint("training", "lower optim.micro_batch_size (sequences per forward/backward), set "
                                          "optim.backward_steps: 1 or enable gradient checkpointing in the domain"):
                    out = (self.domain.log_probs(rollout, idx, need_kl) if steps is None
                           else self.domain.log_probs(rollout, idx, need_kl, steps=steps))
                nfe += out.nfe
                mask = (full if steps is None else steps).to(out.logp.device)
                logp_old = (out.logp_old.to(out.logp) if out.logp_old is not None
                            else self._behaviour_logp(rollout, idx, out, mask))
                parts = self.loss(out, logp_old, a.to(out.logp), mask, norm, row_steps=full.sum(1).to(out.logp))
                st = parts.stats
                loss = parts.total * (self._policy_weight * cfg.loss.policy_coef)  # 0 while the critic warms up
                if value_norm > 0:
                    loss = loss + self.critic.value_coef * self._value_loss(out, idx, value_norm, stats)
                stats.add("loss/policy", float(parts.policy.detach()), 0.0)
                if parts.kl is not None:
                    stats.add("loss/kl", float(parts.kl.detach()), 0.0)
                if parts.entropy_bonus is not None:
                    stats.add("loss/entropy_bonus", float(parts.entropy_bonus.detach()), 0.0)
                    if self.optim.entropy.adaptive:  # the step's mean entropy over the kept steps, for the update
                        step_entropy += torch.tensor([float((out.entropy.detach() * parts.kept).sum()),
                                                      float(parts.kept.sum())], dtype=torch.float64)
                loss.backward()
                _add_step_stats(stats, st, mask, out)
                if cfg.logging.step_clip_frac:  # which denoising steps the clip acts on (GRPO-Guard's diagnosis)
                    m = mask.bool()
                    for j in torch.nonzero(m.any(0)).flatten().tolist():
                        stats.add(f"clip_frac/step{j}", float(st["clipped"][m[:, j], j].sum()), float(m[:, j].sum()))
        if noise:
            first = first_half if first_half is not None else self._flat_grads()
            total = self._flat_grads()
            sizes = torch.tensor([float(half), float(local_idx.numel() - half)])
            buf = self.dist.all_reduce_(torch.cat([first, total - first, sizes]))  # the global halves
            for k, v in gradient_noise_stats(buf[:first.numel()], buf[first.numel():-2], *buf[-2:].tolist()).items():
                stats.add(k, v, 1.0)
        # the micro-batch losses summed (over ranks too) are the minibatch loss: count one per optimizer step
        for k in PER_STEP_STATS:
            if k != "loss/entropy_bonus" or cfg.loss.entropy.enabled:
                stats.add(k, 0.0, 1.0)
        if value_norm > 0:
            stats.add("loss/value", 0.0, 1.0)
        if self._policy_weight > 0:
            self._auxiliary_losses(stats)
        if cfg.loss.entropy.enabled:
            stats.add("entropy_coef", self.optim.entropy.applied(), 1.0)
        self.optim.step(stats)
        if self.optim.entropy.adaptive:  # after the step, from its global mean entropy: the next step's coefficient
            total_h, count = self.dist.all_reduce_(step_entropy).tolist()
            self.optim.entropy.update(total_h / max(count, 1.0))
        return nfe

    def _flat_grads(self) -> torch.Tensor:
        """This rank's gradients of the trained parameters as one float32 vector (missing ones as zeros)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float().cpu()
                          for p in self.optim.params])

    def _value_loss(self, out: StepLogProbs, idx: torch.Tensor, value_norm: float, stats: StepStats) -> torch.Tensor:
        if out.values is None:
            raise ValueError(f"domain {self.cfg.domain!r}: the critic's value_coef > 0 but log_probs returned no values")
        old_v, ret, vm = (x[idx].to(out.values.device) for x in self._value_targets)
        vl = value_loss(out.values, old_v, ret, vm, self.critic.value_clip).sum() / value_norm
        stats.add("loss/value", float(vl.detach()), 0.0)
        return vl

    def _value_norm(self, local_rows: torch.Tensor) -> float:
        """The minibatch's taken decisions over all ranks (the value loss's global denominator); 0 = no value loss."""
        if self.critic is None or self.critic.value_coef <= 0:
            return 0.0
        mine = float(self._value_targets[2][local_rows].sum()) if self._value_targets is not None else 0.0
        return max(float(self.dist.all_reduce_(torch.tensor([mine], dtype=torch.float64))), 1.0)  # every rank

    def _auxiliary_losses(self, stats: StepStats) -> None:
        """The domain's auxiliary terms of this optimizer step (e.g. demo replay), each rank its share."""
        it, step = self._aux_at
        for name, (coef, term) in self.domain.auxiliary_losses(it, step, self.dist.rank, self.dist.world).items():
            (coef * term).backward()
            stats.add(f"loss/{name}", float(term.detach()), 1.0 if self.dist.rank == 0 else 0.0)
        self._aux_at = (it, step + 1)

    # ---- deferred behaviour log-probs (Rollout.logp_deferred) ----------------------------------------------------
    @staticmethod
    def _behaviour_logp(rollout: Rollout, idx: torch.Tensor, out: StepLogProbs, computed: torch.Tensor) -> torch.Tensor:
        """``logp_old`` of micro-batch ``idx``; its deferred steps among those ``out`` computed (``computed``) are
        taken from ``out``, this first forward before any update (so their ratio is exactly 1), and stored in the
        rollout for later epochs."""
        logp_old = rollout.logp_old[idx].to(out.logp)
        deferred = rollout.logp_deferred[idx].to(out.logp.device) & computed.bool()
        if deferred.any():
            logp_old = torch.where(deferred, out.logp.detach(), logp_old)
            rollout.logp_old[idx] = logp_old.to(rollout.logp_old)
            rollout.logp_deferred[idx] = False
        return logp_old

    def _prefill_deferred_logp(self, rollout: Rollout | None, to_local: torch.Tensor) -> int:
        """Deferred behaviour log-probs are normally taken from the first loss forward, which runs before any update
        when the iteration has one minibatch per epoch. With several minibatches, later ones would see updated
        weights, so compute those of the kept, trained local sequences up front, without grad. Returns the nfe."""
        if self.cfg.optim.minibatches_per_epoch <= 1:
            return 0
        rows = to_local[to_local >= 0]
        if rollout is not None and rows.numel():
            rows = rows[rollout.logp_deferred[rows].any(dim=1) & rollout.mask[rows].any(dim=1)]
        else:
            rows = rows[:0]
        if not any_rank(self.dist, rows.numel() > 0):
            return 0
        nfe = 0
        with self._gathered():  # FSDP2: every rank gathers, the forwards are then local
            micro = self.cfg.optim.micro_batch_size or max(1, rows.numel())
            with torch.no_grad():
                for part in (torch.split(rows, micro) if rows.numel() else ()):
                    out = self.domain.log_probs(rollout, part, False)
                    nfe += out.nfe
                    deferred, old = rollout.logp_deferred[part], rollout.logp_old[part]
                    rollout.logp_old[part] = torch.where(deferred, out.logp.detach().to(old), old)
                    rollout.logp_deferred[part] = False
        return nfe

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def save(self, iteration: int) -> Path | None:
        if not self.run_dir:
            return None
        return save_run(self.run_dir / "checkpoints", iteration, self.domain, self.optim, self.sampler, self.dist,
                        self.fsdp, self.cfg.checkpoint.keep_last, checkpoint_sharded(self.cfg, self.fsdp))

    def resume(self, checkpoints: Path | None = None, exact: bool = True) -> bool:
        """Restore the newest valid checkpoint of ``checkpoints`` (default ``run_dir/checkpoints``; ``grove eval``
        reads another run's, ``exact=False``: only its weights matter); False when there is none. To continue
        training (``exact``), a checkpoint that lacks some part's state is refused (ConfigError) unless
        ``resume.allow_inexact``, which notes the gap in the next metrics record (``resume/inexact``)."""
        root = Path(checkpoints) if checkpoints else (self.run_dir / "checkpoints" if self.run_dir else None)
        allow = self.cfg.resume.allow_inexact if exact else None
        found = restore_run(root, self.domain, self.optim, self.sampler, self.fsdp, self.log, allow) if root else None
        if found is None:
            return False
        self.restored_from, self.start_iteration, missing = found
        if missing:
            self.resume_note["resume/inexact"] = "lacked the state of " + ", ".join(missing)
        if checkpoints is None:
            self.log(f"resumed from {self.restored_from} at iteration {self.start_iteration}")
        return True

    # ---- the run -----------------------------------------------------------------------------------------------
    def evaluate(self, it: int) -> dict[str, float]:
        """The domain's held-out evaluation (of the weight average when one is kept), on the main process."""
        with self._gathered():  # FSDP2: every rank gathers once, then only the main process runs forwards
            if not self.dist.is_main:  # evaluation runs on the main process only
                return {}
            if self._last_eval_s is None or self._last_eval_s >= 10:  # the first, or a long one: say it started
                took = f" (the last took {duration(self._last_eval_s)})" if self._last_eval_s else ""
                self.log(f"evaluating at iteration {it}{took}...")
            t = time.perf_counter()
            with torch.no_grad(), self.optim.averaged():
                out = dict(self.domain.evaluate(it))
            out["time/eval"] = self._last_eval_s = time.perf_counter() - t
            return out

    _evaluate = evaluate  # the name grove eval used

    def fit(self, resume: bool = False) -> list[dict[str, Any]]:
        """Run all iterations with evaluation, checkpoints and metrics; returns the metric records."""
        cfg = self.cfg
        main = self.dist.is_main
        if self.run_dir and main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_config_for_the_cli(self.run_dir, self.cfg, self._held)
        logger = MetricsLogger(self.run_dir if main else None, cfg.logging.tensorboard, cfg.logging.wandb,
                               cfg.logging.wandb_project, dump_train_config(cfg))
        if resume:
            # the CLI restores (and checks) before anything is written; a checkpoint may have vanished since
            if self.restored_from is None and not self.resume():
                raise ConfigError(f"--resume {self.run_dir}: no usable checkpoint left; nothing was changed")
            # records after the checkpoint are replayed; a checkpoint at 0 (stopped in the first evaluation) too
            logger.truncate_after(self.start_iteration if self.start_iteration else -1)
        elif self.run_dir and main:
            logger.truncate_after(-1)
        n = sum(p.numel() for p in self.domain.parameters() if p.requires_grad)
        g, gs = cfg.rollout.groups_per_iteration, cfg.rollout.group_size
        self.log(f"grove: domain={cfg.domain} trainable params={n:,} | {g} groups x {gs} per iteration | "
                 f"{self.steps_per_iteration} optimizer steps per iteration | iterations {self.start_iteration}->"
                 f"{cfg.iterations}")
        bar = None
        try:
            with stop_on_signals(self):
                if self.start_iteration == 0 and cfg.eval.at_start:
                    rec = self.evaluate(0)
                    logger.log(0, rec)
                    self.history.append({"step": 0, **rec})
                    self.log("eval before training: " + (_fmt(rec) or "no held-out metrics (the run has nothing "
                                                                      "to evaluate on; see the domain's note above)"))
                # a signal during the first evaluation: checkpoint the untouched start, so --resume picks up there
                stop_first = any_rank(self.dist, self._stop_requested)
                if stop_first:
                    self._stop_requested = True
                    self.save(self.start_iteration)
                    self._log_stop(self.start_iteration)
                bar = _progress(cfg.logging.progress and main, self.start_iteration, cfg.iterations)
                self._fit_clock = (time.monotonic(), self.start_iteration)
                for it in range(self.start_iteration, cfg.iterations if not stop_first else self.start_iteration):
                    if self._run_one(it, logger, bar):
                        break
        finally:
            if bar is not None:
                bar.close()
            logger.close()
        self.dist.barrier()
        if self.dist.enabled:
            self.log(memory_line(cfg.distributed.strategy, self.dist.rank, self.optim.params, self.optimizer,
                                 self.fsdp))
        if not self._stop_requested:
            with after_the_last_iteration(self):
                self._finish()
        return self.history

    def _run_one(self, it: int, logger: MetricsLogger, bar) -> bool:
        """Iteration ``it`` with its evaluation, record and checkpoint; True when a signal asked the run to stop."""
        cfg = self.cfg
        before = (self.sampler.state_dict(), self.domain.extra_state(), rng_state())
        try:
            metrics = self.iteration(it)
        except RewardInterrupted:  # a signal abandoned a stuck reward (collect changes no weights): checkpoint
            self.sampler.load_state_dict(before[0])  # the state from before this iteration, which then replays
            self.domain.load_extra_state(before[1])
            set_rng_state(before[2])
            self.save(it)
            self._log_stop(it)
            return True
        metrics.update(self.resume_note)
        self.resume_note = {}
        step = it + 1
        last = step == cfg.iterations
        if last:  # e.g. per-task early stopping: the final evaluation measures what the domain kept
            with torch.no_grad():
                metrics.update(self.domain.before_final_evaluation(step))
        if last or (cfg.eval.every and step % cfg.eval.every == 0):
            metrics.update(self.evaluate(step))
        metrics["nonfinite_total"] = self.nonfinite_total
        logger.log(step, metrics)
        self.history.append({"step": step, **metrics})
        if bar is not None:
            if any(k.startswith("eval/") for k in metrics):  # held-out numbers as a line above the bar, not hidden
                bar.write(f"eval at iteration {step}: " + _fmt({k: v for k, v in metrics.items() if k.startswith("eval/")}))
            bar.update(1)
            bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                            sps=f"{metrics.get('samples_per_s', 0):.1f}")
        elif self.dist.is_main:
            started, first = self._fit_clock  # the rate of this process's iterations, evaluations included
            left = eta(time.monotonic() - started, step - first, cfg.iterations - first)
            self.log(f"[{step}/{cfg.iterations}] " + _fmt(metrics, short=True) + (f" | {left}" if left else ""))
        # a SIGTERM seen by one process stops all of them at the same iteration (collectives must pair up)
        self._stop_requested = any_rank(self.dist, self._stop_requested)
        if last or self._stop_requested or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
            self.save(step)
        if self._stop_requested:
            self._log_stop(step)
        return self._stop_requested

    def _log_stop(self, step: int) -> None:
        if self.dist.is_main:
            self.log(f"{self.stop_signal or 'stop'}: checkpoint saved at iteration {step}; resume with: grove train "
                     f"--resume {self.run_dir}")

    def _finish(self) -> None:
        """End-of-run export, plot and summary (called on every process; writes on the main one)."""
        if not self.run_dir:
            return
        main = self.dist.is_main
        final = begin_final(self.run_dir, main)  # written aside, renamed to final/ last: whole or absent
        if main or self.fsdp is not None:  # FSDP2: every rank takes part in the gather
            with self.optim.averaged():
                self.domain.save_pretrained(final)
        with self._gathered():
            if main:
                self._finish_main()
                commit_final(self.run_dir)

    def _finish_main(self) -> None:
        from .metrics import read_metrics

        path = self.run_dir / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else self.history
        plot_metrics(records, self.run_dir / "curves.png", f"{self.cfg.domain}")
        self.domain.on_train_end(self.run_dir, records)
        write_summary(self.run_dir, records, self.log)
        from .report import write_report, run_facts

        report = write_report(self.run_dir, records, f"grove run: {self.run_dir.name}", run_facts(self.cfg, records))
        self.log(f"run directory: {self.run_dir} (open {report.name} in a browser)")


def _step_chunks(mask: torch.Tensor, per_chunk: int):
    """``[None]`` (every step in one backward) when ``per_chunk`` is 0, else ``mask`` split by its trained step
    columns into masks of ``per_chunk`` columns each, in step order."""
    if per_chunk <= 0:
        return [None]
    cols = torch.nonzero(mask.any(0)).flatten()
    chunks = []
    for part in torch.split(cols, per_chunk):
        keep = torch.zeros(mask.shape[1], dtype=torch.bool)
        keep[part] = True
        chunks.append(mask.bool() & keep)
    return chunks


def _fmt(m: dict[str, Any], short: bool = False) -> str:
    keys = [k for k in m if k.startswith("eval/")] + (["reward/mean", "loss/policy", "clip_frac", "samples_per_s"] if short else [])
    return " ".join(f"{k}={m[k]:.4g}" for k in keys if isinstance(m.get(k), (int, float)))


def _progress(enabled: bool, start: int, total: int):
    """A tqdm bar on a terminal; None otherwise (a log file gets one plain line per iteration instead of a
    carriage-return update per refresh)."""
    import sys

    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, desc="grove", unit="it", dynamic_ncols=True)
