"""The domain-agnostic GRPO-family training loop.

Read ``Trainer.iteration`` top to bottom: select keys → rollout → reward metrics → filter/refill (by key) →
advantages → inner epochs of minibatches → loss (``Trainer._loss``: the registered policy loss, aggregated, plus
kl_coef·KL) → optimizer step → metrics. ``Trainer.fit`` adds evaluation, checkpoints, exact resume, SIGTERM handling
and the end-of-run plot/summary. The cross-process plumbing (global view, index maps, stats reduction, FSDP2
padding forwards) lives in ``shared_rl.gather``.

Determinism: every iteration draws its randomness from a generator seeded by (seed, iteration), so a resumed
run replays exactly the iterations an uninterrupted run would (tested bitwise on CPU).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .advantages import STEP_ESTIMATORS, combine_rewards, step_advantages
from .checkpoint import load_latest_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import ConfigError, ResourceError, TrainConfig, dump_train_config
from .domain import DomainBase, RunContext, StepLogProbs
from .gather import PER_STEP_STATS, StepStats, any_rank, global_view, local_index, padding_forward, reduce_stats
from .losses import Normalizer, aggregate, get_policy_loss, kl_per_step, value_loss
from .metrics import MetricsLogger, plot_metrics
from .registry import resolve_domain
from .rollout import Rollout
from .selection import group_keep_mask, group_success, make_sampler


from .errors import NonFiniteError  # noqa: E402  (re-exported)


@contextlib.contextmanager
def _oom_hint(stage: str, advice: str):
    """Turn an out-of-memory error into a ResourceError that says which setting to change."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise ResourceError(f"out of memory during {stage}: {advice}") from e


class WeightEMA:
    """Weight averaging of the trained parameters (Polyak & Juditsky 1992; the EMA that diffusion training evaluates).
    After optimizer step t: ema ← d_t·ema + (1 − d_t)·w, d_t = min(decay, (1 + t) / (10 + t)), so the first steps are
    not tied to the starting weights for long. Rollouts and updates keep the live weights; ``swapped()`` puts the
    average into the parameters for evaluation and export and restores the live ones bitwise after."""

    PREFIX = "_ema/"  # its tensors travel in the checkpoint's model.safetensors under these keys

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        self.params, self.decay, self.steps = list(params), float(decay), 0
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.steps) / (10 + self.steps))
        for avg, p in zip(self.shadow, self.params):
            avg.lerp_(p.detach(), 1.0 - d)
        self.steps += 1

    @contextlib.contextmanager
    def swapped(self):
        live = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, avg in zip(self.params, self.shadow):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, live):
                    p.copy_(w)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{self.PREFIX}{i}": avg for i, avg in enumerate(self.shadow)}

    def load(self, tensors: dict[str, torch.Tensor], steps: int) -> None:
        if len(tensors) != len(self.shadow):
            raise ConfigError(f"the checkpoint's weight average holds {len(tensors)} tensors, this policy trains "
                              f"{len(self.shadow)}: resume with the config the run was started with")
        with torch.no_grad():
            for i, avg in enumerate(self.shadow):
                avg.copy_(tensors[f"{self.PREFIX}{i}"])
        self.steps = int(steps)


def iteration_seed(seed: int, iteration: int) -> int:
    return (seed * 1_000_003 + iteration * 7_919 + 17) % (2**63 - 1)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warm, kind = cfg.warmup_steps, cfg.schedule

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant" or total_steps <= warm:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1.0 - frac

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def group_draws(rollout: Rollout) -> torch.Tensor:
    """``[G]`` the draw (requested key, numbered over the iteration's rounds; ``Rollout.origin``) of each group."""
    draws = torch.full((len(rollout.keys),), -1, dtype=torch.long)
    draws[rollout.group_ids] = rollout.origin[:, 4]
    return draws


def _num_draws(views: list[Rollout]) -> int:
    """How many distinct draws (requested keys) own at least one group of ``views``."""
    return len(set(torch.cat([group_draws(v) for v in views]).tolist())) if views else 0


def _add_step_stats(stats: StepStats, st: dict[str, torch.Tensor], mask: torch.Tensor, out: StepLogProbs) -> None:
    """Ratio, clip fraction, approximate KL (½·log-ratio²) and entropy of one micro-batch's trained steps."""
    m = mask.bool()
    n_steps = float(m.sum())
    stats.add("ratio/mean", float(st["ratio"][m].sum()), n_steps)
    stats.add("clip_frac", float(st["clipped"][m].sum()), n_steps)
    stats.add("approx_kl", float((0.5 * st["log_ratio"][m] ** 2).sum()), n_steps)
    if m.any():
        stats.max("ratio/max", float(st["ratio"][m].max()))
    if out.entropy is not None:
        stats.add("entropy", float(out.entropy.detach()[m].sum()), n_steps)


class Trainer:
    """Builds the domain from a validated ``TrainConfig`` and runs it."""

    def __init__(self, cfg: TrainConfig, run_dir: Path | None = None, log=print) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else None
        self.log = log
        from .preflight import preflight, resolve_device

        preflight(cfg)  # the device, optional loggers and the domain's inputs, before any model loads
        self.device = resolve_device(cfg.device)
        from .distributed import Dist

        self.dist = Dist(self.device)
        if (self.dist.enabled and cfg.distributed.strategy == "replicate"
                and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"):
            raise ConfigError("launched with an accelerate FSDP config but distributed.strategy is replicate; add "
                              "distributed.strategy=fsdp2 (grove shards the policy itself and does not read "
                              "accelerate's fsdp_config) or launch with configs/accelerate/multi_gpu_ddp.yaml")
        if self.dist.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        torch.manual_seed(cfg.seed)
        ctx = RunContext(run_dir=self.run_dir, device=self.device, seed=cfg.seed, log=log,
                         process_index=self.dist.rank, num_processes=self.dist.world)
        self.domain = resolve_domain(cfg.domain)(cfg.domain_config, ctx)
        self.fsdp = self._setup_fsdp() if cfg.distributed.strategy == "fsdp2" else None
        params = [p for p in self.domain.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(f"domain {cfg.domain!r} exposes no trainable parameters")
        replay = getattr(type(self.domain), "replay_loss", None)
        if cfg.loss.replay_coef > 0 and (replay is None or replay is DomainBase.replay_loss):
            raise ConfigError(f"loss.replay_coef={cfg.loss.replay_coef}: domain {cfg.domain!r} has no demonstrations "
                              f"to replay (no replay_loss hook); set loss.replay_coef: 0")
        o = cfg.optim
        groups = self._param_groups(params)
        self.optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        self.steps_per_iteration = o.inner_epochs * o.minibatches_per_epoch
        self.scheduler = make_scheduler(self.optimizer, o, cfg.iterations * self.steps_per_iteration)
        if o.ema_decay > 0 and self.fsdp is not None:
            raise ConfigError("optim.ema_decay keeps a whole copy of the trained weights per process; with "
                              "distributed.strategy: fsdp2 set optim.ema_decay: 0 (or use replicate)")
        self.ema = WeightEMA(params, o.ema_decay) if o.ema_decay > 0 else None
        self.sampler = make_sampler(cfg.selection)
        if cfg.selection.balance:
            stratum = getattr(self.domain, "key_stratum", None)
            if not callable(stratum):
                raise ConfigError(f"selection.balance: true needs the domain's key_stratum(key) hook, which domain "
                                  f"{cfg.domain!r} does not have; set selection.balance: false")
            from .selection import StratifiedSampler

            self.sampler = StratifiedSampler(self.sampler, stratum, by_need=cfg.selection.balance_by == "need",
                                             need_decay=cfg.selection.need_decay,
                                             need_floor=cfg.selection.need_floor)
        # reward name -> weight: advantage.weights, else the domain's own defaults (e.g. llm.rewards[].weight);
        # read here, never written back into the trainer's config sections
        defaults = getattr(cfg.domain_config, "default_reward_weights", None)
        self.reward_weights = dict(cfg.advantage.weights or (defaults() if callable(defaults) else {}))
        self.start_iteration = 0
        self.nonfinite_steps = 0
        self.nonfinite_total = 0
        self._critic = None  # (old values, value targets, value mask) of this iteration's local rows (gae)
        self._policy_weight = 1.0  # 0 during loss.critic_warmup
        self._replay_at = (0, 0)  # (iteration, optimizer step within it): what loss.replay_coef's batch is drawn from
        self.padding_forwards = 0  # FSDP2: weight-0 forwards run to keep collectives paired (see _optimizer_step)
        self.history: list[dict[str, Any]] = []
        self._stop_requested = False
        self.stop_signal: str | None = None  # "SIGINT" / "SIGTERM" once one asked the run to stop
        self.restored_from: Path | None = None
        self.resume_note: dict[str, Any] = {}  # merged into the first record after a resume (e.g. its overrides)

    def _param_groups(self, params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
        """One AdamW group, or two when the domain names its critic's parameters (``critic_parameters()``) and
        ``optim.critic_lr`` is set: the critic then steps at its own rate (PPO practice; a value table or head
        moving at the policy's rate turns its own noise into advantage noise)."""
        hook = getattr(self.domain, "critic_parameters", None)
        critic_lr = self.cfg.optim.critic_lr
        if critic_lr is None or not callable(hook):
            return [{"params": params}]
        critic_ids = {id(p) for p in hook()}
        policy = [p for p in params if id(p) not in critic_ids]
        critic = [p for p in params if id(p) in critic_ids]
        return [g for g in ({"params": policy}, {"params": critic, "lr": critic_lr}) if g["params"]]

    def _setup_fsdp(self):
        """Shard the domain's ``fsdp_modules()`` with FSDP2 (several processes) after checking the layout."""
        cfg, d = self.cfg, self.dist
        hook = getattr(self.domain, "fsdp_modules", None)
        modules = list(hook()) if hook else []
        if not modules:
            raise ConfigError(f"distributed.strategy: fsdp2 is not supported by domain {cfg.domain!r} (its "
                              f"fsdp_modules() lists no modules to shard); use distributed.strategy: replicate")
        if not d.enabled:
            self.log("fsdp2 with one process: nothing to shard, the policy stays whole (same result as replicate)")
            return None
        # every rank pads its training micro-batches with forwards on its own sequences: each needs a rollout chunk
        groups = cfg.rollout.groups_per_iteration
        per_call = self._groups_per_call(groups)
        chunks = -(-groups // per_call)
        if chunks < d.world:
            fix = (f"raise rollout.groups_per_iteration to >= {d.world}" if groups < d.world else
                   f"set rollout.groups_per_call <= {groups // d.world}")
            raise ConfigError(f"distributed.strategy: fsdp2 needs a rollout chunk on each of the {d.world} processes, "
                              f"but {groups} groups in calls of {per_call} make {chunks} chunks; {fix}")
        from .distributed import FSDPShards

        shards = FSDPShards(modules, d, self.device, cfg.distributed.reshard_after_forward)
        local, full = shards.local_parameter_bytes()
        self.log(f"fsdp2: {len(modules)} modules sharded over {d.world} processes; process {d.rank} holds "
                 f"{local:,} of their {full:,} parameter bytes")
        return shards

    def _groups_per_call(self, n_groups: int) -> int:
        """Groups per rollout call: ``rollout.groups_per_call``, else an even share of ``n_groups`` per process."""
        return self.cfg.rollout.groups_per_call or -(-n_groups // self.dist.world)

    def _averaged(self):
        """The weight average (optim.ema_decay) in the parameters, for evaluation and export; no-op when off."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def _gathered(self):
        """FSDP2: the shards gathered for work whose forward count differs per rank (no-op otherwise)."""
        return self.fsdp.gathered() if self.fsdp is not None else contextlib.nullcontext()

    def _any_rank(self, flag: bool) -> bool:
        return any_rank(self.dist, flag)

    # ------------------------------------------------------------------------------------------------------------
    def iteration(self, it: int) -> dict[str, float]:
        """One GRPO iteration; returns its metrics. Decisions (filter, refill, advantages, minibatches) are taken
        on the global view of every rank's rollout (``view``); each rank trains on the sequences it sampled
        (``local``, with the domain's payload)."""
        cfg = self.cfg
        seed = iteration_seed(cfg.seed, it)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed + self.dist.rank)
        pool = list(self.domain.train_keys())
        t0 = time.perf_counter()

        # 1. select keys, 2. rollout (rewards included)
        keys = self.sampler.select(pool, cfg.rollout.groups_per_iteration, gen)
        local, view = self._rollout_round(keys, it, 0, first_draw=0)
        if self.fsdp is not None and self._any_rank(local is None):  # _setup_fsdp checks this; sampler may differ
            raise RuntimeError(f"iteration {it}: a process sampled no sequence, so it cannot pad its FSDP2 training "
                               f"forwards; lower rollout.groups_per_call")

        # 3. reward metrics of what was sampled first
        metrics = self._reward_metrics(view)
        if cfg.selection.balance and cfg.selection.balance_by == "need":  # where the need-weighted keys went
            metrics.update({f"selection/keys/{name}": n for name, n in Counter(map(self.sampler.stratum, keys)).items()})
        if cfg.selection.balance:  # each stratum's (task's) success in this iteration's rollouts: per-task training curves
            metrics.update(self._stratum_success(view))
        skipped = self.sampler.num_skipped()
        if skipped is not None:  # history sampler: the keys (reset states) held out of this draw
            metrics["selection/skipped"] = skipped

        # 4. filter / refill by key (dynamic sampling), then one key-sampler update with every drawn key
        drawn = [view]
        if cfg.selection.filter != "none":
            local, view, drawn = self._filter_and_refill(local, view, len(keys), pool, it, gen)
        self._update_sampler(drawn, it)
        metrics.update({
            "groups/drawn": sum(len(v.keys) for v in drawn), "groups/kept": len(view.keys),
            "nfe/rollout": sum(v.nfe for v in drawn),
            "time/rollout": time.perf_counter() - t0,
        })
        if local is not None:
            metrics.update({k: v for k, v in local.info.items() if isinstance(v, (int, float))})
        if len(view) == 0:
            self.log(f"iteration {it}: every group was filtered out; no update")
            metrics.update({"time/train": 0.0, "lr": self.scheduler.get_last_lr()[0], "nfe/train": 0})
            return metrics

        # 5. advantages on the global view: one per sequence (tree estimators read the parent array), or, with a
        #    critic (gae), one per step from each sequence's rewards and values (no groups: computed locally)
        a = cfg.advantage
        to_local = local_index(view, local)  # global sequence -> this rank's sequence, or -1
        self._critic = None
        if a.estimator in STEP_ESTIMATORS:
            adv = self._step_advantages(local, view, to_local, metrics)
        else:
            adv = combine_rewards(view.rewards, view.group_ids, a.estimator, self.reward_weights, a.multi_reward,
                                  view.parent, a.clip, a.eps, fusion_logit=view.fusion_logit)
            metrics["advantage/abs_mean"] = float(adv.abs().mean())
        self._policy_weight = 0.0 if it < cfg.loss.critic_warmup else 1.0
        self._replay_at = (it, 0)

        # 6. inner epochs of minibatches; each minibatch is one optimizer step (loss: _loss), split in micro-batches
        t1 = time.perf_counter()
        nfe_train = self._prefill_deferred_logp(local, to_local)
        stats = StepStats()
        trainable = torch.nonzero(view.mask.any(dim=1)).flatten()
        for _epoch in range(cfg.optim.inner_epochs):
            order = trainable[torch.randperm(trainable.numel(), generator=gen)]
            for mb in torch.tensor_split(order, cfg.optim.minibatches_per_epoch):
                if mb.numel():
                    norm = Normalizer.from_mask(view.mask[mb], cfg.loss.max_steps_norm)
                    mine = mb[to_local[mb] >= 0]
                    value_norm = self._value_norm(to_local[mine])
                    nfe_train += self._optimizer_step(local, to_local[mine], adv[mine], norm, stats, value_norm)

        # 7. metrics (summed over ranks)
        metrics.update(reduce_stats(self.dist, stats))
        nfe = torch.tensor([float(nfe_train)])
        metrics.update({"nfe/train": float(self.dist.all_reduce_(nfe)), "time/train": time.perf_counter() - t1,
                        "lr": self.scheduler.get_last_lr()[0]})
        # wall time of the whole iteration (selection, rollout, gathers, advantages, updates), the same on every rank
        metrics["time/iteration"] = time.perf_counter() - t0
        first = drawn[0]
        leaves = int(torch.isfinite(next(iter(first.rewards.values()))).sum()) if first.rewards else len(first)
        metrics["samples_per_s"] = leaves / max(metrics["time/iteration"], 1e-9)
        return metrics

    # ---- a critic: per-step advantages (gae) and the value loss ---------------------------------------------------
    def _step_advantages(self, local: Rollout | None, view: Rollout, to_local: torch.Tensor,
                         metrics: dict[str, float]) -> torch.Tensor:
        """``[N, T]`` per-step advantages of the global view's sequences from the domain's critic values
        (``advantage.estimator`` a ``STEP_ESTIMATORS`` entry; see ``shared_rl.domain``): each sequence's weighted
        reward sum is the reward of its last decision. Only this rank's rows are filled (the others are trained
        elsewhere); ``advantage.normalize: batch`` z-scores over the taken decisions of every rank's kept rows.
        Keeps (old values, value targets, value mask) of the local rows for the value loss."""
        cfg, a = self.cfg, self.cfg.advantage
        n, t = view.mask.shape
        adv_view = torch.zeros(n, t)
        rows = torch.nonzero(to_local >= 0).flatten()
        if local is None:
            if a.normalize == "batch":  # the other ranks' collective
                self.dist.all_reduce_(torch.zeros(3, dtype=torch.float64))
            return adv_view
        p = local.payload
        if "values" not in p or "value_mask" not in p:
            raise ConfigError(f"advantage.estimator {a.estimator!r} needs the critic's values, but domain "
                              f"{cfg.domain!r} rollouts carry none (payload 'values' and 'value_mask'); enable the "
                              f"domain's critic (robotics: robotics.critic: true) or use a group estimator (grpo)")
        values, vmask = p["values"].float().cpu(), p["value_mask"].bool().cpu()
        if t % values.shape[1]:
            raise ValueError(f"domain {cfg.domain!r}: {t} log-prob steps do not split into the {values.shape[1]} "
                             f"decisions of payload['values']")
        w = self.reward_weights
        outcome = sum(w.get(k, 1.0) * r.float() for k, r in local.rewards.items() if w.get(k, 1.0) != 0)
        step_r = p.get("step_rewards")
        adv_c, returns = step_advantages(a.estimator, outcome, values, vmask, a.gamma, a.lam,
                                         step_r.float().cpu() if step_r is not None else None)
        mine = to_local[rows]
        m = vmask[mine]
        if a.normalize == "batch":
            x = adv_c[mine][m].double()
            st = self.dist.all_reduce_(torch.stack([x.new_tensor(float(x.numel())), x.sum(), (x * x).sum()]))
            cnt = max(float(st[0]), 1.0)
            mean = float(st[1]) / cnt
            std = math.sqrt(max(float(st[2]) / cnt - mean * mean, 0.0))
            adv_c = torch.where(vmask, (adv_c - mean) / (std + a.eps), torch.zeros_like(adv_c))
        if a.clip is not None:
            adv_c = adv_c.clamp(-a.clip, a.clip)
        adv_view[rows] = adv_c.repeat_interleave(t // values.shape[1], dim=1)[mine]
        self._critic = (values, returns, vmask)
        metrics["advantage/abs_mean"] = float(adv_c[mine][m].abs().mean()) if m.any() else 0.0
        if m.any():
            v, r = values[mine][m], returns[mine][m]
            metrics["value/mean"] = float(v.mean())
            var = float(r.var()) if r.numel() > 1 else 0.0
            metrics["value/explained_variance"] = 1.0 - float((r - v).var()) / var if var > 0 else 0.0
        return adv_view

    def _value_norm(self, local_rows: torch.Tensor) -> float:
        """The minibatch's taken decisions over all ranks (the value loss's global denominator); 0 = no critic."""
        if self.cfg.advantage.estimator not in STEP_ESTIMATORS or self.cfg.loss.value_coef <= 0:
            return 0.0
        mine = float(self._critic[2][local_rows].sum()) if self._critic is not None else 0.0
        return max(float(self.dist.all_reduce_(torch.tensor([mine], dtype=torch.float64))), 1.0)  # every rank

    # ---- the loss ----------------------------------------------------------------------------------------------
    def _loss(self, out: StepLogProbs, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              norm: Normalizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
        """One micro-batch's share of the minibatch loss: aggregate(policy loss) + kl_coef · aggregate(KL).

        Returns (loss to backpropagate, its policy part, its KL part or None, the policy loss's per-step stats)."""
        lc = self.cfg.loss
        policy_loss = get_policy_loss(lc.policy_loss)
        terms = {"terms": out} if getattr(policy_loss, "uses_domain_terms", False) else {}  # likelihood-free: NFT, AWM
        per_step, st = policy_loss(out.logp, logp_old, adv, mask, lc, **terms)
        policy = aggregate(per_step, mask, lc.aggregation, norm)
        if lc.kl_coef <= 0:
            return policy, policy, None, st
        kl = aggregate(kl_per_step(lc.kl_estimator, out.logp, out.ref_logp, out.kl), mask, lc.aggregation, norm)
        return policy + lc.kl_coef * kl, policy, kl, st

    def _optimizer_step(self, rollout: Rollout | None, local_idx: torch.Tensor, adv: torch.Tensor,
                        norm: Normalizer, stats: StepStats, value_norm: float = 0.0) -> int:
        """One optimizer step over this rank's share ``local_idx`` of a global minibatch (normalised by ``norm``,
        the minibatch's global counts), accumulated over micro-batches; gradients are summed across ranks.
        Under FSDP2 every forward is a collective: ranks with fewer micro-batches than the busiest one add padding
        forwards of loss weight 0 (``gather.padding_forward``) so that all ranks issue the same collectives."""
        cfg = self.cfg
        micro = cfg.optim.micro_batch_size or max(1, local_idx.numel())
        need_kl = cfg.loss.kl_coef > 0
        self.optimizer.zero_grad(set_to_none=True)
        nfe = 0
        splits = [(i, a) for i, a in zip(torch.split(local_idx, micro), torch.split(adv, micro)) if i.numel()]
        n_calls = len(splits)
        if self.fsdp is not None:
            n_calls = int(self.dist.all_reduce_(torch.tensor([len(splits)]), "max"))
        for call in range(n_calls):
            if call >= len(splits):
                padding_forward(self.domain, rollout, need_kl)
                self.padding_forwards += 1
                continue
            idx, a = splits[call]
            with _oom_hint("training", "lower optim.micro_batch_size (sequences per forward/backward) or enable "
                                       "gradient checkpointing in the domain config"):
                out = self.domain.log_probs(rollout, idx, need_kl)
            nfe += out.nfe
            mask = rollout.mask[idx].to(out.logp.device)
            logp_old = self._behaviour_logp(rollout, idx, out)
            loss, policy, kl, st = self._loss(out, logp_old, a.to(out.logp), mask, norm)
            if self._policy_weight != 1.0:  # critic warm-up (loss.critic_warmup): the policy term weighs 0
                loss = loss * self._policy_weight
            if value_norm > 0:
                if out.values is None:
                    raise ValueError(f"domain {cfg.domain!r}: loss.value_coef > 0 but log_probs returned no values")
                old_v, ret, vm = (x[idx].to(out.values.device) for x in self._critic)
                vl = value_loss(out.values, old_v, ret, vm, cfg.loss.value_clip).sum() / value_norm
                loss = loss + cfg.loss.value_coef * vl
                stats.add("loss/value", float(vl.detach()), 0.0)
            stats.add("loss/policy", float(policy.detach()), 0.0)
            if kl is not None:
                stats.add("loss/kl", float(kl.detach()), 0.0)
            loss.backward()
            _add_step_stats(stats, st, mask, out)
            if cfg.logging.step_clip_frac:  # which denoising steps the clip acts on (GRPO-Guard's diagnosis)
                m = mask.bool()
                for j in torch.nonzero(m.any(0)).flatten().tolist():
                    stats.add(f"clip_frac/step{j}", float(st["clipped"][m[:, j], j].sum()), float(m[:, j].sum()))
        # the micro-batch losses summed (over ranks too) are the minibatch loss: count one per optimizer step
        for k in PER_STEP_STATS:
            stats.add(k, 0.0, 1.0)
        if value_norm > 0:
            stats.add("loss/value", 0.0, 1.0)
        if cfg.loss.replay_coef > 0 and self._policy_weight > 0:
            # the anchor to the pretraining data: one replay minibatch per optimizer step (each rank its share)
            it, step = self._replay_at
            replay = self.domain.replay_loss(it, step, self.dist.rank, self.dist.world)
            (cfg.loss.replay_coef * replay).backward()
            stats.add("loss/replay", float(replay.detach()), 1.0 if self.dist.rank == 0 else 0.0)
            self._replay_at = (it, step + 1)
        self._clip_and_step(stats)
        return nfe

    def _clip_and_step(self, stats: StepStats) -> None:
        """Sum gradients over ranks, clip, then step (or skip a non-finite step, stopping after too many)."""
        cfg = self.cfg
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.dist.sum_gradients(params)  # FSDP2-sharded gradients (DTensors) are already summed: skipped
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else float("inf")
        if self.fsdp is not None:
            from .distributed import clip_grad_norm_global_

            grad_norm = clip_grad_norm_global_(params, clip, self.dist)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if not torch.isfinite(grad_norm):
            self.nonfinite_steps += 1
            self.nonfinite_total += 1
            stats.add("nonfinite_steps", 1.0, 0.0)
            self.optimizer.zero_grad(set_to_none=True)
            self.log(f"WARNING: non-finite loss/gradient; optimizer step skipped ({self.nonfinite_steps} in a row)")
            if self.nonfinite_steps >= cfg.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_steps} optimizer steps in a row had NaN/Inf gradients; lower optim.lr, set "
                    f"optim.grad_clip, or raise max_nonfinite_steps (now {cfg.max_nonfinite_steps})"
                )
            return
        self.nonfinite_steps = 0
        stats.add("grad_norm", float(grad_norm), 1.0)
        before = getattr(self.domain, "before_optimizer_step", None)
        if before:
            before()
        self.optimizer.step()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update()
        after = getattr(self.domain, "after_optimizer_step", None)
        if after:
            after()

    # ---- deferred behaviour log-probs (Rollout.logp_deferred) ----------------------------------------------------
    @staticmethod
    def _behaviour_logp(rollout: Rollout, idx: torch.Tensor, out: StepLogProbs) -> torch.Tensor:
        """``logp_old`` of micro-batch ``idx``; its deferred steps are taken from ``out``, this first forward before
        any update (so their ratio is exactly 1), and stored in the rollout for later epochs."""
        logp_old = rollout.logp_old[idx].to(out.logp)
        deferred = rollout.logp_deferred[idx].to(out.logp.device)
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
        if not self._any_rank(rows.numel() > 0):
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

    # ---- rollouts, filters, key sampler -------------------------------------------------------------------------
    def _rollout_round(self, keys: list[int], it: int, rnd: int, first_draw: int) -> tuple[Rollout | None, Rollout]:
        """Sample ``keys`` in calls of ``rollout.groups_per_call`` keys spread over ranks; every call draws from its
        own generator seeded by (seed, iteration, round, call), so results do not depend on the process count.
        Key ``j`` of this round is draw ``first_draw + j``. Returns (this rank's rollout with payload, the global
        view without payload)."""
        per_call = self._groups_per_call(len(keys))
        chunks = [keys[i: i + per_call] for i in range(0, len(keys), per_call)]
        parts = []
        with self._gathered():  # FSDP2: ranks sample different numbers of chunks and tokens
            for c, chunk in enumerate(chunks):
                if c % self.dist.world == self.dist.rank:
                    parts.append(self._sample_chunk(chunk, it, rnd, c, first_draw + c * per_call))
        local = Rollout.cat(parts) if parts else None
        return local, global_view(self.dist, local)

    def _sample_chunk(self, chunk: list[int], it: int, rnd: int, c: int, first_draw: int) -> Rollout:
        """One ``Domain.rollout`` call, stamped with ``Rollout.origin`` (round, call, group, position, draw)."""
        chunk_seed = iteration_seed(self.cfg.seed, it) + 1_000_003 * (rnd + 1) + 7919 * c
        g = torch.Generator().manual_seed(chunk_seed)
        torch.manual_seed(chunk_seed)  # for domains that also draw from the global RNG: same on any layout
        with torch.no_grad(), _oom_hint("rollout", "lower rollout.groups_per_call (groups per rollout call) or "
                                         "the domain's rollout micro-batch size"):
            part = self.domain.rollout(chunk, self.cfg.rollout.group_size, g, it)
        try:
            key_pos = part.resolve_key_index(list(chunk))
        except ValueError as e:
            raise ValueError(f"domain {self.cfg.domain!r}, rollout of keys {list(chunk)}: {e}") from None
        n = len(part)
        gid = part.group_ids.long()
        part.origin = torch.stack([torch.full((n,), rnd), torch.full((n,), c), gid, torch.arange(n),
                                   first_draw + key_pos[gid]], 1)
        return part

    def _filter_and_refill(self, local: Rollout | None, view: Rollout, n_drawn: int, pool: list[int], it: int,
                           gen: torch.Generator) -> tuple[Rollout | None, Rollout, list[Rollout]]:
        """Dynamic sampling (DAPO, Yu et al. 2025) by key, where a key may own several groups: drop the groups
        without signal (``selection.filter``); a drawn key is kept while any of its groups is; draw
        (groups_per_iteration − kept keys) more keys, at most ``selection.max_refill_rounds`` times; then keep
        every kept group of the first groups_per_iteration kept keys (in draw order).
        Returns (this rank's rollout of all rounds, the kept global view, the global view of each round)."""
        n_keys, max_rounds = self.cfg.rollout.groups_per_iteration, self.cfg.selection.max_refill_rounds
        drawn, kept = [view], [self._filtered(view)]
        rounds = 0
        while _num_draws(kept) < n_keys and rounds < max_rounds:
            rounds += 1
            more = self.sampler.select(pool, n_keys - _num_draws(kept), gen)
            more_local, more_view = self._rollout_round(more, it, rounds, first_draw=n_drawn)
            n_drawn += len(more)
            if more_local is not None:
                local = more_local if local is None else Rollout.cat([local, more_local])
            drawn.append(more_view)
            kept.append(self._filtered(more_view))
        view = Rollout.cat(kept)
        draws = group_draws(view)
        first = torch.unique(draws)  # sorted: draw order
        if first.numel() > n_keys:
            view = view.select_groups(torch.isin(draws, first[:n_keys]))
        return local, view, drawn

    def _update_sampler(self, drawn: list[Rollout], it: int) -> None:
        """One key-sampler update per iteration: every drawn key once, its successes and counts summed over all its
        groups and rounds (VADE's decay and the history window then advance once per iteration)."""
        successes: dict[Any, float] = {}
        counts: dict[Any, int] = {}
        for part in drawn:
            succ, cnt = group_success(self._filter_reward(part), part.group_ids, len(part.keys))
            for k, s, n in zip(part.keys, succ, cnt):
                successes[k] = successes[k] + s if k in successes else s
                counts[k] = counts[k] + n if k in counts else n
        self.sampler.update(list(successes), list(successes.values()), [counts[k] for k in successes], it)

    def _stratum_success(self, rollout: Rollout) -> dict[str, float]:
        """``selection/success/<stratum>``: the band reward's mean over the stratum's sampled episodes."""
        succ, cnt = group_success(self._filter_reward(rollout), rollout.group_ids, len(rollout.keys))
        return {f"selection/success/{name}": r for name, r in self.sampler.rates(rollout.keys, succ, cnt).items()}

    def _filter_reward(self, rollout: Rollout) -> torch.Tensor:
        name = self.cfg.selection.band_reward or next(iter(rollout.rewards))
        if name not in rollout.rewards:
            raise ConfigError(f"selection.band_reward {name!r} is not a reward; rewards are {sorted(rollout.rewards)}")
        return rollout.rewards[name]

    def _filtered(self, rollout: Rollout) -> Rollout:
        s = self.cfg.selection
        if len(rollout.rewards) > 1 and s.filter == "zero_std":
            w = self.reward_weights
            r = sum(w.get(k, 1.0) * v for k, v in rollout.rewards.items())
        else:
            r = self._filter_reward(rollout)
        keep = group_keep_mask(r, rollout.group_ids, len(rollout.keys), s.filter, s.band)
        return rollout.select_groups(keep)

    def _reward_metrics(self, rollout: Rollout) -> dict[str, float]:
        m: dict[str, float] = {}
        total = None
        w = self.reward_weights
        for name, r in rollout.rewards.items():
            ok = torch.isfinite(r)
            m[f"reward/{name}/mean"] = float(r[ok].mean()) if ok.any() else float("nan")
            total = w.get(name, 1.0) * r if total is None else total + w.get(name, 1.0) * r
        if total is not None:
            leaf = torch.isfinite(total)
            m["reward/mean"] = float(total[leaf].mean()) if leaf.any() else float("nan")
            m["reward/std"] = float(total[leaf].std()) if leaf.sum() > 1 else 0.0
            keep = group_keep_mask(total, rollout.group_ids, len(rollout.keys), "zero_std")
            m["frac_zero_std"] = float((~keep).float().mean()) if keep.numel() else 0.0
            # a reward that failed is NaN on a leaf; count leaves whose reward is missing
            leaves = torch.ones(len(rollout), dtype=torch.bool)
            if rollout.parent is not None:
                leaves[rollout.parent[rollout.parent >= 0]] = False
            m["reward/nan_count"] = float((leaves & ~leaf).sum())
        return m

    # ------------------------------------------------------------------------------------------------------------
    def state(self, iteration: int) -> dict[str, Any]:
        extra = getattr(self.domain, "extra_state", None)
        return {
            "iteration": iteration,
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "domain": extra() if extra else {},
            "rng": rng_state(),
            "nonfinite_total": self.nonfinite_total,
            **({"ema_steps": self.ema.steps} if self.ema is not None else {}),
        }

    def save(self, iteration: int) -> Path | None:
        if not self.run_dir:
            return None
        if self.fsdp is not None:  # gather the shards (collective, every rank), write the one-process layout on rank 0
            from .distributed import full_optimizer_state, full_tensors

            model_state = full_tensors(self.domain.state_dict())
            opt_state = full_optimizer_state(self.optimizer.state_dict())
        elif self.dist.is_main:
            model_state, opt_state = self.domain.state_dict(), self.optimizer.state_dict()
            if self.ema is not None:
                model_state = {**model_state, **self.ema.tensors()}
        if not self.dist.is_main:
            return None
        return save_checkpoint(self.run_dir / "checkpoints", iteration, model_state, opt_state, self.state(iteration),
                               self.cfg.checkpoint.keep_last)

    def resume(self, checkpoints: Path | None = None) -> bool:
        """Restore the newest valid checkpoint of ``checkpoints`` (default ``run_dir/checkpoints``; ``grove eval``
        reads another run's); False when there is none."""
        root = Path(checkpoints) if checkpoints else (self.run_dir / "checkpoints" if self.run_dir else None)
        found = load_latest_checkpoint(root, self.log) if root else None
        if found is None:
            return False
        path, model_state, opt_state, state = found
        ema_state = {k: model_state.pop(k) for k in [k for k in model_state if k.startswith(WeightEMA.PREFIX)]}
        if self.fsdp is not None:  # full tensors -> this rank's shards, laid out like the live parameters
            from .distributed import shard_like, shard_optimizer_state

            current = self.domain.state_dict()
            model_state = {k: shard_like(v, current[k]) if k in current else v for k, v in sorted(model_state.items())}
            if opt_state is not None:
                opt_state = shard_optimizer_state(opt_state, self.optimizer)
        self.domain.load_state_dict(model_state)
        if self.ema is not None and ema_state:
            self.ema.load(ema_state, state.get("ema_steps", 0))
        elif self.ema is not None:  # a run started without optim.ema_decay: the average starts at its weights
            self.log("the checkpoint has no weight average (optim.ema_decay was 0): it starts at its weights")
            self.ema = WeightEMA(self.ema.params, self.ema.decay)
        if opt_state is not None:
            self.optimizer.load_state_dict(opt_state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        load_extra = getattr(self.domain, "load_extra_state", None)
        if load_extra:
            load_extra(state.get("domain", {}))
        set_rng_state(state["rng"])
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        self.start_iteration = int(state["iteration"])
        self.restored_from = path
        if checkpoints is None:
            self.log(f"resumed from {path} at iteration {self.start_iteration}")
        return True

    def _evaluate(self, it: int) -> dict[str, float]:
        with self._gathered():  # FSDP2: every rank gathers once, then only the main process runs forwards
            if not self.dist.is_main:  # evaluation runs on the main process only
                return {}
            t = time.perf_counter()
            with torch.no_grad(), self._averaged():
                out = dict(self.domain.evaluate(it))
            out["time/eval"] = time.perf_counter() - t
            return out

    def fit(self, resume: bool = False) -> list[dict[str, Any]]:
        """Run all iterations with evaluation, checkpoints and metrics; returns the metric records."""
        cfg = self.cfg
        main = self.dist.is_main
        if self.run_dir and main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        logger = MetricsLogger(self.run_dir if main else None, cfg.logging.tensorboard, cfg.logging.wandb, cfg.logging.wandb_project,
                               dump_train_config(cfg))
        if resume:
            # the CLI restores (and checks) before anything is written; a checkpoint may have vanished since
            if self.restored_from is None and not self.resume():
                raise ConfigError(f"--resume {self.run_dir}: no usable checkpoint left; nothing was changed")
            # records after the checkpoint are replayed; a checkpoint at 0 (stopped in the first evaluation) too
            logger.truncate_after(self.start_iteration if self.start_iteration else -1)
        elif self.run_dir and main:
            logger.truncate_after(-1)
        old_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def on_signal(signum, frame):  # finish the current iteration, checkpoint, exit; a second Ctrl-C aborts
            name = signal.Signals(signum).name
            if name == "SIGINT" and self.stop_signal is not None:
                raise KeyboardInterrupt
            if self.stop_signal is None and main:
                self.log(f"{name}: finishing this iteration, then checkpointing"
                         + (" (Ctrl-C again to abort without saving)" if name == "SIGINT" else ""))
            self._stop_requested = True
            self.stop_signal = self.stop_signal or name

        try:
            for sig in old_handlers:
                signal.signal(sig, on_signal)
        except ValueError:  # not in the main thread
            pass
        n = sum(p.numel() for p in self.domain.parameters() if p.requires_grad)
        g, gs = cfg.rollout.groups_per_iteration, cfg.rollout.group_size
        self.log(f"grove: domain={cfg.domain} trainable params={n:,} | {g} groups x {gs} per iteration | "
                 f"{self.steps_per_iteration} optimizer steps per iteration | iterations {self.start_iteration}->{cfg.iterations}")
        if self.start_iteration == 0 and cfg.eval.at_start:
            rec = self._evaluate(0)
            logger.log(0, rec)
            self.history.append({"step": 0, **rec})
            self.log("eval before training: " + _fmt(rec))
        # a signal during the first evaluation: checkpoint the untouched start, so --resume picks up from there
        stop_first = self._any_rank(self._stop_requested)
        if stop_first:
            self._stop_requested = True
            self.save(self.start_iteration)
            self._log_stop(self.start_iteration)
        bar = _progress(cfg.logging.progress and main, self.start_iteration, cfg.iterations)
        try:
            for it in range(self.start_iteration, cfg.iterations if not stop_first else self.start_iteration):
                metrics = self.iteration(it)
                if self.resume_note:
                    metrics.update(self.resume_note)
                    self.resume_note = {}
                step = it + 1
                last = step == cfg.iterations
                select = getattr(self.domain, "before_final_evaluation", None) if last else None
                if select is not None:  # e.g. per-task early stopping: the final evaluation measures what it kept
                    with torch.no_grad():
                        metrics.update(select(step))
                if last or (cfg.eval.every and step % cfg.eval.every == 0):
                    metrics.update(self._evaluate(step))
                metrics["nonfinite_total"] = self.nonfinite_total
                logger.log(step, metrics)
                self.history.append({"step": step, **metrics})
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                    sps=f"{metrics.get('samples_per_s', 0):.1f}")
                elif main:
                    self.log(f"[{step}/{cfg.iterations}] " + _fmt(metrics, short=True))
                # a SIGTERM seen by one process stops all of them at the same iteration (collectives must pair up)
                self._stop_requested = self._any_rank(self._stop_requested)
                if last or self._stop_requested or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                    self.save(step)
                if self._stop_requested:
                    self._log_stop(step)
                    break
        finally:
            if bar is not None:
                bar.close()
            logger.close()
            try:
                for sig, handler in old_handlers.items():
                    signal.signal(sig, handler)
            except (ValueError, TypeError):
                pass
        self.dist.barrier()
        if self.dist.enabled:
            self.log(self._memory_line())
        if not self._stop_requested:
            self._finish()
        return self.history

    def _log_stop(self, step: int) -> None:
        if self.dist.is_main:
            self.log(f"{self.stop_signal or 'stop'}: checkpoint saved at iteration {step}; resume with: grove train "
                     f"--resume {self.run_dir}")

    def _memory_line(self) -> str:
        """What this process holds of the trained state (bytes of its local shards under FSDP2)."""
        from .distributed import is_dtensor

        def local_bytes(t: torch.Tensor) -> int:
            return (t.to_local() if is_dtensor(t) else t).numel() * t.element_size()

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        opt = sum(local_bytes(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
        line = (f"memory ({self.cfg.distributed.strategy}): process {self.dist.rank} holds "
                f"{sum(local_bytes(p) for p in params):,} trainable-parameter bytes, {opt:,} optimizer-state bytes")
        if self.fsdp is not None:
            local, full = self.fsdp.local_parameter_bytes()
            line += f", {local:,} of the sharded modules' {full:,} parameter bytes"
        return line

    def _finish(self) -> None:
        """End-of-run export, plot and summary (called on every process; writes on the main one)."""
        if not self.run_dir:
            return
        main = self.dist.is_main
        save_pretrained = getattr(self.domain, "save_pretrained", None)
        if save_pretrained and (main or self.fsdp is not None):  # FSDP2: every rank takes part in the gather
            with self._averaged():
                save_pretrained(self.run_dir / "final")
        with self._gathered():
            if main:
                self._finish_main()

    def _finish_main(self) -> None:
        from .metrics import read_metrics

        records = read_metrics(self.run_dir / "metrics.jsonl") if (self.run_dir / "metrics.jsonl").is_file() else self.history
        plot_metrics(records, self.run_dir / "curves.png", f"{self.cfg.domain}")
        on_end = getattr(self.domain, "on_train_end", None)
        if on_end:
            on_end(self.run_dir, records)
        evals = [r for r in records if any(k.startswith("eval/") for k in r)]
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            lines = [f"{k}: {first[k]:.4g} -> {last[k]:.4g}" for k in sorted(last)
                     if k.startswith("eval/") and isinstance(first.get(k), (int, float)) and isinstance(last.get(k), (int, float))]
            summary = "summary (step %d -> %d)\n  " % (first["step"], last["step"]) + "\n  ".join(lines)
            (self.run_dir / "summary.txt").write_text(summary + "\n")
            self.log(summary)
        self.log(f"run directory: {self.run_dir}")


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
