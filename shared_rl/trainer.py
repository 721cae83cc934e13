"""The domain-agnostic GRPO-family training loop.

Read ``Trainer.iteration`` top to bottom: select keys → rollout → advantages → filter/refill groups → inner
epochs of minibatches (micro-batched, globally normalised) → optimizer step → metrics. ``Trainer.fit`` adds
evaluation, checkpoints, exact resume, SIGTERM handling and the end-of-run plot/summary.

Determinism: every iteration draws its randomness from a generator seeded by (seed, iteration), so a resumed
run replays exactly the iterations an uninterrupted run would (tested bitwise on CPU).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .advantages import combine_rewards
from .checkpoint import load_latest_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import ConfigError, ResourceError, TrainConfig, dump_train_config
from .domain import RunContext
from .losses import KL_ESTIMATORS, Normalizer, aggregate, clipped_surrogate
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


@dataclass
class _StepStats:
    """Accumulates per-step statistics over one iteration's optimizer steps."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def max(self, name: str, value: float) -> None:
        self.maxes[name] = max(self.maxes.get(name, -math.inf), float(value))

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / self.counts[k] for k in self.sums if self.counts[k] > 0}
        out.update(self.maxes)
        return out


class Trainer:
    """Builds the domain from a validated ``TrainConfig`` and runs it."""

    def __init__(self, cfg: TrainConfig, run_dir: Path | None = None, log=print) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else None
        self.log = log
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
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
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        self.steps_per_iteration = o.inner_epochs * o.minibatches_per_epoch
        self.scheduler = make_scheduler(self.optimizer, o, cfg.iterations * self.steps_per_iteration)
        self.sampler = make_sampler(cfg.selection)
        self.start_iteration = 0
        self.nonfinite_steps = 0
        self.nonfinite_total = 0
        self.padding_forwards = 0  # FSDP2: weight-0 forwards run to keep collectives paired (see _optimizer_step)
        self.history: list[dict[str, Any]] = []
        self._stop_requested = False

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

    def _gathered(self):
        """FSDP2: the shards gathered for work whose forward count differs per rank (no-op otherwise)."""
        return self.fsdp.gathered() if self.fsdp is not None else contextlib.nullcontext()

    def _any_rank(self, flag: bool) -> bool:
        return bool(self.dist.all_reduce_(torch.tensor([1.0 if flag else 0.0]), "max")) if self.dist.enabled else flag

    # ------------------------------------------------------------------------------------------------------------
    def iteration(self, it: int) -> dict[str, float]:
        """One GRPO iteration; returns its metrics."""
        cfg, dom = self.cfg, self.domain
        gen = torch.Generator().manual_seed(iteration_seed(cfg.seed, it))
        torch.manual_seed(iteration_seed(cfg.seed, it) + self.dist.rank)
        n_groups, group_size = cfg.rollout.groups_per_iteration, cfg.rollout.group_size
        pool = list(dom.train_keys())

        # 1. rollout (rewards included); decisions use the global view (all ranks), training the local part
        t0 = time.perf_counter()
        keys = self.sampler.select(pool, n_groups, gen)
        local, view = self._rollout_round(keys, it, 0)
        if self.fsdp is not None and self._any_rank(local is None):  # _setup_fsdp checks this; sampler may differ
            raise RuntimeError(f"iteration {it}: a process sampled no sequence, so it cannot pad its FSDP2 training "
                               f"forwards; lower rollout.groups_per_call")
        metrics = self._reward_metrics(view)
        drawn_views = [view]
        if cfg.selection.filter != "none":  # dynamic sampling: drop groups without signal, refill, trim
            kept_views = [self._filtered(view)]
            rounds = 0
            while sum(len(v.keys) for v in kept_views) < n_groups and rounds < cfg.selection.max_refill_rounds:
                rounds += 1
                more_keys = self.sampler.select(pool, n_groups - sum(len(v.keys) for v in kept_views), gen)
                more_local, more_view = self._rollout_round(more_keys, it, rounds)
                local = Rollout.cat([p for p in (local, more_local) if p is not None]) if (local or more_local) else None
                drawn_views.append(more_view)
                kept_views.append(self._filtered(more_view))
            view = Rollout.cat(kept_views)
            if len(view.keys) > n_groups:
                view = view.select_groups(torch.arange(len(view.keys)) < n_groups)
        for part in drawn_views:
            succ, cnt = group_success(self._filter_reward(part), part.group_ids, len(part.keys))
            self.sampler.update(part.keys, succ, cnt, it)
        metrics.update({
            "groups/drawn": sum(len(v.keys) for v in drawn_views), "groups/kept": len(view.keys),
            "nfe/rollout": sum(v.nfe for v in drawn_views),
            "time/rollout": time.perf_counter() - t0,
        })
        if local is not None:
            for k, v in local.info.items():
                if isinstance(v, (int, float)):
                    metrics[k] = v

        # 2. advantages on the global view: one per sequence (tree estimators read the parent array)
        if len(view) == 0:
            self.log(f"iteration {it}: every group was filtered out; no update")
            metrics.update({"time/train": 0.0, "lr": self.scheduler.get_last_lr()[0], "nfe/train": 0})
            return metrics
        a = cfg.advantage
        adv = combine_rewards(view.rewards, view.group_ids, a.estimator, a.weights, a.multi_reward,
                              view.parent, a.clip, a.eps)
        metrics["advantage/abs_mean"] = float(adv.abs().mean())
        # map global sequence -> local sequence of this rank (or -1)
        to_local = torch.full((len(view),), -1, dtype=torch.long)
        if local is not None:
            pos = {tuple(o): i for i, o in enumerate(local.payload["_order"].tolist())}
            for gi, o in enumerate(view.payload["_order"].tolist()):
                to_local[gi] = pos.get(tuple(o), -1)

        # 3. inner epochs of minibatches; each minibatch is one optimizer step, split into micro-batches
        t1 = time.perf_counter()
        kept_local = to_local[to_local >= 0]
        nfe_train = 0
        if cfg.optim.minibatches_per_epoch > 1:
            deferred = self._deferred_rows(local, kept_local)
            if self._any_rank(deferred.numel() > 0):  # FSDP2: every rank gathers, the forwards are then local
                with self._gathered():
                    nfe_train = self._fill_deferred_logp(local, deferred)
        stats = _StepStats()
        trainable = torch.nonzero(view.mask.any(dim=1)).flatten()
        for _epoch in range(cfg.optim.inner_epochs):
            order = trainable[torch.randperm(trainable.numel(), generator=gen)]
            for mb in torch.tensor_split(order, cfg.optim.minibatches_per_epoch):
                if mb.numel():
                    norm = Normalizer.from_mask(view.mask[mb], cfg.loss.max_steps_norm)
                    mine = mb[to_local[mb] >= 0]
                    nfe_train += self._optimizer_step(local, to_local[mine], adv[mine], norm, stats)
        metrics.update(self._reduce_stats(stats))
        nfe = torch.tensor([float(nfe_train)])
        metrics.update({"nfe/train": float(self.dist.all_reduce_(nfe)), "time/train": time.perf_counter() - t1,
                        "lr": self.scheduler.get_last_lr()[0]})
        # wall time of the whole iteration (selection, rollout, gathers, advantages, updates), the same on every rank
        metrics["time/iteration"] = time.perf_counter() - t0
        first = drawn_views[0]
        leaves = int(torch.isfinite(next(iter(first.rewards.values()))).sum()) if first.rewards else len(first)
        metrics["samples_per_s"] = leaves / max(metrics["time/iteration"], 1e-9)
        return metrics

    @staticmethod
    def _deferred_rows(rollout: Rollout | None, rows: torch.Tensor) -> torch.Tensor:
        """The kept, trained local sequences whose behaviour log-probs are deferred (NaN)."""
        if rollout is None or rows.numel() == 0:
            return rows[:0]
        return rows[torch.isnan(rollout.logp_old[rows]).any(dim=1) & rollout.mask[rows].any(dim=1)]

    def _fill_deferred_logp(self, rollout: Rollout | None, idx: torch.Tensor) -> int:
        """Deferred behaviour log-probs (NaN in ``logp_old``, see ``Rollout``) are normally taken from the first
        loss forward, which runs before any update when the iteration has one minibatch per epoch. With several
        minibatches, later ones would see updated weights, so compute them up front (rows ``idx`` from
        ``_deferred_rows``) without grad instead."""
        if rollout is None or idx.numel() == 0:
            return 0
        micro = self.cfg.optim.micro_batch_size or max(1, idx.numel())
        nfe = 0
        with torch.no_grad():
            for part in torch.split(idx, micro):
                out = self.domain.log_probs(rollout, part, False)
                nfe += out.nfe
                old = rollout.logp_old[part]
                rollout.logp_old[part] = torch.where(torch.isnan(old), out.logp.detach().to(old), old)
        return nfe

    def _rollout_round(self, keys: list[int], it: int, rnd: int) -> tuple[Rollout | None, Rollout]:
        """Sample ``keys`` in chunks of ``rollout.groups_per_call`` spread over ranks; every chunk draws from its
        own generator seeded by (seed, iteration, round, chunk), so results do not depend on the process count.
        Returns (this rank's rollout with payload, the global light view without payload)."""
        per_call = self._groups_per_call(len(keys))
        chunks = [keys[i: i + per_call] for i in range(0, len(keys), per_call)]
        parts = []
        with self._gathered():  # FSDP2: ranks sample different numbers of chunks and tokens
            self._sample_chunks(chunks, it, rnd, parts)
        local = Rollout.cat(parts) if parts else None
        return local, self._global_view(local, chunks)

    def _sample_chunks(self, chunks: list[list[int]], it: int, rnd: int, parts: list[Rollout]) -> None:
        for c, chunk in enumerate(chunks):
            if c % self.dist.world != self.dist.rank:
                continue
            chunk_seed = iteration_seed(self.cfg.seed, it) + 1_000_003 * (rnd + 1) + 7919 * c
            g = torch.Generator().manual_seed(chunk_seed)
            torch.manual_seed(chunk_seed)  # for domains that also draw from the global RNG: same on any layout
            with torch.no_grad(), _oom_hint("rollout", "lower rollout.groups_per_call (groups per rollout call) or "
                                             "the domain's rollout micro-batch size"):
                part = self.domain.rollout(chunk, self.cfg.rollout.group_size, g, it)
            n = len(part)
            order = torch.stack([torch.full((n,), rnd), torch.full((n,), c), part.group_ids.long(), torch.arange(n)], 1)
            part.payload["_order"] = order
            part.payload["_parent_pos"] = part.parent.clone() if part.parent is not None else torch.full((n,), -1)
            parts.append(part)

    def _global_view(self, local: Rollout | None, chunks: list[list[int]]) -> Rollout:
        """Rewards, masks, log-probs and tree structure of every rank's sequences, in (round, chunk, pos) order."""
        d = self.dist
        if not d.enabled:
            assert local is not None
            light = Rollout(local.keys, local.group_ids, local.rewards, local.logp_old, local.mask, local.parent,
                            {"_order": local.payload["_order"]}, local.nfe, {})
            return light
        names = sorted(local.rewards) if local is not None else []
        # every rank must agree on reward names and the step count: take them from the gathered data
        T = int(d.all_reduce_(torch.tensor([local.num_steps if local is not None else 0]), "max"))
        n = len(local) if local is not None else 0

        def pad_t(x: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((n, T), fill, dtype=x.dtype)
            out[:, : x.shape[1]] = x
            return out

        if local is not None:
            order, ppos = local.payload["_order"], local.payload["_parent_pos"]
            rewards = torch.stack([local.rewards[k].float() for k in names], 1) if names else torch.zeros(n, 0)
            logp, mask = pad_t(local.logp_old.float(), 0.0), pad_t(local.mask, False)
        else:
            order, ppos = torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.long)
            rewards, logp, mask = torch.zeros(0, 0), torch.zeros(0, T), torch.zeros(0, T, dtype=torch.bool)
        n_rewards = int(d.all_reduce_(torch.tensor([len(names)]), "max"))
        if rewards.shape[1] != n_rewards:
            rewards = torch.zeros(n, n_rewards)
        g_order = d.gather_cat(order)
        g_rewards = d.gather_cat(rewards)
        g_logp = d.gather_cat(logp)
        g_mask = d.gather_cat(mask.to(torch.uint8)).bool()
        g_ppos = d.gather_cat(ppos)
        g_nfe = d.all_reduce_(torch.tensor([float(local.nfe if local is not None else 0)]))
        name_codes = d.gather_cat(torch.tensor([[ord(ch) for ch in "|".join(names).ljust(256)[:256]]]) if names
                                  else torch.zeros(0, 256, dtype=torch.long))
        names = "".join(chr(int(x)) for x in name_codes[0]).strip().split("|") if name_codes.numel() else []
        # sort by (round, chunk, position); rebuild group ids, keys and parents
        key = ((g_order[:, 0] * 100_000 + g_order[:, 1]) * 10_000_000 + g_order[:, 3])
        perm = torch.argsort(key)
        g_order, g_rewards, g_logp, g_mask, g_ppos = (x[perm] for x in (g_order, g_rewards, g_logp, g_mask, g_ppos))
        group_of, keys, gids = {}, [], []
        for rnd, c, gid, _pos in g_order.tolist():
            k = (rnd, c, gid)
            if k not in group_of:
                group_of[k] = len(keys)
                keys.append(chunks[c][gid])
            gids.append(group_of[k])
        parent = None
        if bool((g_ppos >= 0).any()):
            where = {(r, c, p): i for i, (r, c, _g, p) in enumerate(g_order.tolist())}
            parent = torch.tensor([where[(r, c, int(pp))] if pp >= 0 else -1
                                   for (r, c, _g, _p), pp in zip(g_order.tolist(), g_ppos.tolist())], dtype=torch.long)
        return Rollout(keys, torch.tensor(gids, dtype=torch.long), {k: g_rewards[:, i] for i, k in enumerate(names)},
                       g_logp, g_mask, parent, {"_order": g_order}, int(g_nfe), {})

    _SUM_STATS = ("loss/policy", "loss/kl", "ratio/mean", "clip_frac", "approx_kl", "entropy", "grad_norm",
                  "nonfinite_steps")

    def _reduce_stats(self, stats: _StepStats) -> dict[str, float]:
        """Merge per-rank step statistics (sums and counts added, maxima maxed)."""
        if self.dist.enabled:
            names = self._SUM_STATS
            buf = torch.tensor([[stats.sums.get(k, 0.0), stats.counts.get(k, 0.0)] for k in names], dtype=torch.float64)
            self.dist.all_reduce_(buf)
            for i, k in enumerate(names):  # per-optimizer-step counts were added once per rank
                if k in ("loss/policy", "loss/kl"):
                    buf[i, 1] /= self.dist.world
            mx = torch.tensor([stats.maxes.get("ratio/max", -math.inf)], dtype=torch.float64)
            self.dist.all_reduce_(mx, "max")
            # grad_norm is computed after the sum over ranks: identical everywhere, so average, don't add
            stats = _StepStats({k: float(buf[i, 0]) for i, k in enumerate(names) if buf[i, 1] > 0},
                               {k: float(buf[i, 1]) for i, k in enumerate(names) if buf[i, 1] > 0},
                               {"ratio/max": float(mx)} if math.isfinite(float(mx)) else {})
        return stats.result()

    def _filter_reward(self, rollout: Rollout) -> torch.Tensor:
        name = self.cfg.selection.band_reward or next(iter(rollout.rewards))
        if name not in rollout.rewards:
            raise ConfigError(f"selection.band_reward {name!r} is not a reward; rewards are {sorted(rollout.rewards)}")
        return rollout.rewards[name]

    def _filtered(self, rollout: Rollout) -> Rollout:
        s = self.cfg.selection
        if len(rollout.rewards) > 1 and s.filter == "zero_std":
            w = self.cfg.advantage.weights
            r = sum(w.get(k, 1.0) * v for k, v in rollout.rewards.items())
        else:
            r = self._filter_reward(rollout)
        keep = group_keep_mask(r, rollout.group_ids, len(rollout.keys), s.filter, s.band)
        return rollout.select_groups(keep)

    def _reward_metrics(self, rollout: Rollout) -> dict[str, float]:
        m: dict[str, float] = {}
        total = None
        w = self.cfg.advantage.weights
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

    def _optimizer_step(self, rollout: Rollout | None, local_idx: torch.Tensor, adv: torch.Tensor,
                        norm: Normalizer, stats: _StepStats) -> int:
        """One optimizer step over this rank's share ``local_idx`` of a global minibatch (normalised by ``norm``,
        the minibatch's global counts), accumulated over micro-batches; gradients are summed across ranks.
        Under FSDP2 every forward is a collective: ranks with fewer micro-batches than the busiest one add padding
        forwards of loss weight 0 (``_padding_forward``) so that all ranks issue the same collectives."""
        cfg, lc = self.cfg, self.cfg.loss
        micro = cfg.optim.micro_batch_size or max(1, local_idx.numel())
        need_kl = lc.kl_coef > 0
        self.optimizer.zero_grad(set_to_none=True)
        nfe = 0
        splits = [(i, a) for i, a in zip(torch.split(local_idx, micro), torch.split(adv, micro)) if i.numel()]
        n_calls = len(splits)
        if self.fsdp is not None:
            n_calls = int(self.dist.all_reduce_(torch.tensor([len(splits)]), "max"))
        for call in range(n_calls):
            if call >= len(splits):
                self._padding_forward(rollout, need_kl)
                continue
            idx, a = splits[call]
            with _oom_hint("training", "lower optim.micro_batch_size (sequences per forward/backward) or enable "
                                       "gradient checkpointing in the domain config"):
                out = self.domain.log_probs(rollout, idx, need_kl)
            nfe += out.nfe
            mask = rollout.mask[idx].to(out.logp.device)
            logp_old = rollout.logp_old[idx].to(out.logp)
            if torch.isnan(logp_old).any():  # deferred: this is the first forward, before any update
                logp_old = torch.where(torch.isnan(logp_old), out.logp.detach(), logp_old)
                rollout.logp_old[idx] = logp_old.to(rollout.logp_old)
            pg, st = clipped_surrogate(out.logp, logp_old, a.to(out.logp), mask, lc.clip_low, lc.clip_high,
                                       lc.dual_clip, lc.ratio_level)
            loss = aggregate(pg, mask, lc.aggregation, norm)
            stats.add("loss/policy", float(loss.detach()), 0.0)
            if need_kl:
                if out.kl is not None:
                    kl = out.kl
                elif out.ref_logp is not None:
                    kl = KL_ESTIMATORS["k3" if lc.kl_estimator == "domain" else lc.kl_estimator](out.logp, out.ref_logp)
                else:
                    raise ConfigError(f"loss.kl_coef > 0 but domain {cfg.domain!r} returned neither kl nor ref_logp")
                kl_loss = aggregate(kl, mask, lc.aggregation, norm)
                loss = loss + lc.kl_coef * kl_loss
                stats.add("loss/kl", float(kl_loss.detach()), 0.0)
            loss.backward()
            m = mask.bool()
            n_steps = float(m.sum())
            stats.add("ratio/mean", float(st["ratio"][m].sum()), n_steps)
            stats.add("clip_frac", float(st["clipped"][m].sum()), n_steps)
            stats.add("approx_kl", float((0.5 * st["log_ratio"][m] ** 2).sum()), n_steps)
            if m.any():
                stats.max("ratio/max", float(st["ratio"][m].max()))
            if out.entropy is not None:
                stats.add("entropy", float(out.entropy.detach()[m].sum()), n_steps)
        # the micro-batch losses summed (over ranks too) are the minibatch loss: count one per optimizer step
        for k in ("loss/policy", "loss/kl"):
            stats.add(k, 0.0, 1.0)
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
            return nfe
        self.nonfinite_steps = 0
        stats.add("grad_norm", float(grad_norm), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        after = getattr(self.domain, "after_optimizer_step", None)
        if after:
            after()
        return nfe

    def _padding_forward(self, rollout: Rollout | None, need_kl: bool) -> None:
        """FSDP2: forward + backward on one of this rank's own sequences (the first with trained steps, e.g. not a
        tree root) with loss weight 0, which adds exactly zero to every gradient, only to take part in the same
        all-gathers and reduce-scatters as the other ranks."""
        if rollout is None or len(rollout) == 0:
            raise RuntimeError("FSDP2 padding forward: this process holds no sequence (see _setup_fsdp)")
        self.padding_forwards += 1
        trained = torch.nonzero(rollout.mask.any(dim=1)).flatten()
        row = trained[:1] if trained.numel() else torch.zeros(1, dtype=torch.long)
        out = self.domain.log_probs(rollout, row, need_kl)
        zero = out.logp.float().nan_to_num(0.0, 0.0, 0.0).sum() * 0.0
        if out.kl is not None:
            zero = zero + out.kl.float().nan_to_num(0.0, 0.0, 0.0).sum() * 0.0
        zero.backward()

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
        if not self.dist.is_main:
            return None
        return save_checkpoint(self.run_dir / "checkpoints", iteration, model_state, opt_state, self.state(iteration),
                               self.cfg.checkpoint.keep_last)

    def resume(self) -> bool:
        """Restore the newest valid checkpoint of ``run_dir``; False when there is none."""
        found = load_latest_checkpoint(self.run_dir / "checkpoints", self.log) if self.run_dir else None
        if found is None:
            return False
        path, model_state, opt_state, state = found
        if self.fsdp is not None:  # full tensors -> this rank's shards, laid out like the live parameters
            from .distributed import shard_like, shard_optimizer_state

            current = self.domain.state_dict()
            model_state = {k: shard_like(v, current[k]) if k in current else v for k, v in sorted(model_state.items())}
            if opt_state is not None:
                opt_state = shard_optimizer_state(opt_state, self.optimizer)
        self.domain.load_state_dict(model_state)
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
        self.log(f"resumed from {path} at iteration {self.start_iteration}")
        return True

    def _evaluate(self, it: int) -> dict[str, float]:
        with self._gathered():  # FSDP2: every rank gathers once, then only the main process runs forwards
            if not self.dist.is_main:  # evaluation runs on the main process only
                return {}
            t = time.perf_counter()
            with torch.no_grad():
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
        if resume and self.resume():
            logger.truncate_after(self.start_iteration)
        elif self.run_dir and main:
            logger.truncate_after(-1)
        old_handler = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):  # finish the current iteration, checkpoint, exit cleanly
            self._stop_requested = True

        try:
            signal.signal(signal.SIGTERM, on_sigterm)
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
        bar = _progress(cfg.logging.progress and main, self.start_iteration, cfg.iterations)
        try:
            for it in range(self.start_iteration, cfg.iterations):
                metrics = self.iteration(it)
                step = it + 1
                last = step == cfg.iterations
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
                    self.log(f"SIGTERM: checkpoint saved at iteration {step}; resume with --resume {self.run_dir}")
                    break
        finally:
            if bar is not None:
                bar.close()
            logger.close()
            try:
                signal.signal(signal.SIGTERM, old_handler)
            except (ValueError, TypeError):
                pass
        self.dist.barrier()
        if self.dist.enabled:
            self.log(self._memory_line())
        if not self._stop_requested:
            self._finish()
        return self.history

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
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, desc="grove", unit="it", dynamic_ncols=True)
