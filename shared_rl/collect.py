"""Collecting one iteration's groups: rollout rounds spread over processes, dynamic sampling with refill by key,
the key sampler's once-per-iteration update, and the reward metrics of what was sampled.

``Collector.collect(it, gen)`` is step 1–4 of ``Trainer.iteration``. Every rollout call draws from its own
generator seeded by (seed, iteration, round, call), so what is sampled does not depend on the process count.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ConfigError, ResourceError
from .gather import global_view
from .rollout import Rollout
from .selection import group_keep_mask, group_success


def iteration_seed(seed: int, iteration: int) -> int:
    return (seed * 1_000_003 + iteration * 7_919 + 17) % (2**63 - 1)


@contextlib.contextmanager
def oom_hint(stage: str, advice: str):
    """Turn an out-of-memory error into a ResourceError that says which setting to change."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise ResourceError(f"out of memory during {stage}: {advice}") from e


def group_draws(rollout: Rollout) -> torch.Tensor:
    """``[G]`` the draw (requested key, numbered over the iteration's rounds; ``Rollout.origin``) of each group."""
    draws = torch.full((len(rollout.keys),), -1, dtype=torch.long)
    draws[rollout.group_ids] = rollout.origin[:, 4]
    return draws


def _num_draws(views: list[Rollout]) -> int:
    """How many distinct draws (requested keys) own at least one group of ``views``."""
    return len(set(torch.cat([group_draws(v) for v in views]).tolist())) if views else 0


def weighted_reward(rewards: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor | None:
    """Σ_k w_k r_k over the named rewards (missing weights are 1), None without rewards."""
    total = None
    for name, r in rewards.items():
        total = weights.get(name, 1.0) * r if total is None else total + weights.get(name, 1.0) * r
    return total


@dataclass
class Collected:
    """What one iteration collected: this rank's rollout with its payload (None when it sampled nothing), the kept
    global view (no payload), every round's global view, and the metrics of selection and rewards."""

    local: Rollout | None
    view: Rollout
    drawn: list[Rollout]
    metrics: dict[str, Any] = field(default_factory=dict)


class Collector:
    def __init__(self, cfg, domain, dist, sampler, reward_weights: dict[str, float], gathered) -> None:
        self.cfg, self.domain, self.dist, self.sampler = cfg, domain, dist, sampler
        self.reward_weights = reward_weights
        self.gathered = gathered  # FSDP2: a context with the shards gathered (ranks sample different amounts)

    def groups_per_call(self, n_groups: int) -> int:
        """Groups per rollout call: ``rollout.groups_per_call``, else an even share of ``n_groups`` per process."""
        return self.cfg.rollout.groups_per_call or -(-n_groups // self.dist.world)

    def collect(self, it: int, gen: torch.Generator) -> Collected:
        """Select keys, sample them (rewards included), filter and refill by key, update the key sampler once."""
        cfg = self.cfg
        t0 = time.perf_counter()
        pool = list(self.domain.train_keys())
        keys = self.sampler.select(pool, cfg.rollout.groups_per_iteration, gen)
        local, view = self.rollout_round(keys, it, 0, first_draw=0)
        metrics = self.reward_metrics(view)
        succ, cnt = group_success(self.filter_reward(view), view.group_ids, len(view.keys))
        metrics.update(self.sampler.iteration_metrics(keys, view.keys, succ, cnt))
        drawn = [view]
        if cfg.selection.filter != "none":
            local, view, drawn = self.filter_and_refill(local, view, len(keys), pool, it, gen)
        self.update_sampler(drawn, it)
        metrics.update({
            "groups/drawn": sum(len(v.keys) for v in drawn), "groups/kept": len(view.keys),
            "nfe/rollout": sum(v.nfe for v in drawn),
            "time/rollout": time.perf_counter() - t0,
        })
        if local is not None:
            metrics.update({k: v for k, v in local.info.items() if isinstance(v, (int, float))})
        return Collected(local, view, drawn, metrics)

    def rollout_round(self, keys: list[int], it: int, rnd: int, first_draw: int) -> tuple[Rollout | None, Rollout]:
        """Sample ``keys`` in calls of ``rollout.groups_per_call`` keys spread over ranks. Key ``j`` of this round is
        draw ``first_draw + j``. Returns (this rank's rollout with payload, the global view without payload)."""
        per_call = self.groups_per_call(len(keys))
        chunks = [keys[i: i + per_call] for i in range(0, len(keys), per_call)]
        parts = []
        with self.gathered():  # FSDP2: ranks sample different numbers of chunks and tokens
            for c, chunk in enumerate(chunks):
                if c % self.dist.world == self.dist.rank:
                    parts.append(self.sample_chunk(chunk, it, rnd, c, first_draw + c * per_call))
        local = Rollout.cat(parts) if parts else None
        return local, global_view(self.dist, local)

    def sample_chunk(self, chunk: list[int], it: int, rnd: int, c: int, first_draw: int) -> Rollout:
        """One ``Domain.rollout`` call, stamped with ``Rollout.origin`` (round, call, group, position, draw)."""
        chunk_seed = iteration_seed(self.cfg.seed, it) + 1_000_003 * (rnd + 1) + 7919 * c
        g = torch.Generator().manual_seed(chunk_seed)
        torch.manual_seed(chunk_seed)  # for domains that also draw from the global RNG: same on any layout
        with torch.no_grad(), oom_hint("rollout", "lower rollout.groups_per_call (groups per rollout call) or "
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

    def filter_and_refill(self, local: Rollout | None, view: Rollout, n_drawn: int, pool: list[int], it: int,
                          gen: torch.Generator) -> tuple[Rollout | None, Rollout, list[Rollout]]:
        """Dynamic sampling (DAPO, Yu et al. 2025) by key, where a key may own several groups: drop the groups
        without signal (``selection.filter``); a drawn key is kept while any of its groups is; draw
        (groups_per_iteration − kept keys) more keys, at most ``selection.max_refill_rounds`` times; then keep
        every kept group of the first groups_per_iteration kept keys (in draw order).
        Returns (this rank's rollout of all rounds, the kept global view, the global view of each round)."""
        n_keys, max_rounds = self.cfg.rollout.groups_per_iteration, self.cfg.selection.max_refill_rounds
        drawn, kept = [view], [self.filtered(view)]
        rounds = 0
        while _num_draws(kept) < n_keys and rounds < max_rounds:
            rounds += 1
            more = self.sampler.select(pool, n_keys - _num_draws(kept), gen)
            more_local, more_view = self.rollout_round(more, it, rounds, first_draw=n_drawn)
            n_drawn += len(more)
            if more_local is not None:
                local = more_local if local is None else Rollout.cat([local, more_local])
            drawn.append(more_view)
            kept.append(self.filtered(more_view))
        view = Rollout.cat(kept)
        draws = group_draws(view)
        first = torch.unique(draws)  # sorted: draw order
        if first.numel() > n_keys:
            view = view.select_groups(torch.isin(draws, first[:n_keys]))
        return local, view, drawn

    def update_sampler(self, drawn: list[Rollout], it: int) -> None:
        """One key-sampler update per iteration: every drawn key once, its successes and counts summed over all its
        groups and rounds (VADE's decay and the history window then advance once per iteration)."""
        successes: dict[Any, float] = {}
        counts: dict[Any, int] = {}
        for part in drawn:
            succ, cnt = group_success(self.filter_reward(part), part.group_ids, len(part.keys))
            for k, s, n in zip(part.keys, succ, cnt):
                successes[k] = successes[k] + s if k in successes else s
                counts[k] = counts[k] + n if k in counts else n
        self.sampler.update(list(successes), list(successes.values()), [counts[k] for k in successes], it)

    def filter_reward(self, rollout: Rollout) -> torch.Tensor:
        name = self.cfg.selection.band_reward or next(iter(rollout.rewards))
        if name not in rollout.rewards:
            raise ConfigError(f"selection.band_reward {name!r} is not a reward; rewards are {sorted(rollout.rewards)}")
        return rollout.rewards[name]

    def filtered(self, rollout: Rollout) -> Rollout:
        s = self.cfg.selection
        if len(rollout.rewards) > 1 and s.filter == "zero_std":
            r = weighted_reward(rollout.rewards, self.reward_weights)
        else:
            r = self.filter_reward(rollout)
        keep = group_keep_mask(r, rollout.group_ids, len(rollout.keys), s.filter, s.band)
        return rollout.select_groups(keep)

    def reward_metrics(self, rollout: Rollout) -> dict[str, float]:
        """``reward/<name>/mean``, ``reward/mean`` / ``reward/std`` of the weighted sum, ``frac_zero_std`` and
        ``reward/nan_count`` (leaves whose reward failed)."""
        m: dict[str, float] = {}
        for name, r in rollout.rewards.items():
            ok = torch.isfinite(r)
            m[f"reward/{name}/mean"] = float(r[ok].mean()) if ok.any() else float("nan")
        total = weighted_reward(rollout.rewards, self.reward_weights)
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
