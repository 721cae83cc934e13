"""The trainer's cross-process plumbing, kept out of the training loop so that ``Trainer.iteration`` reads as the
algorithm.

- ``global_view``: every rank's rollout part without payload (rewards, masks, log-probs, tree structure, group
  keys), in (round, call, position) order, so that filters, refills, advantages and minibatches are decided on the
  same global batch whatever the number of processes.
- ``gather_reward_names``: the reward names, checked to agree on every rank that sampled something.
- ``local_index``: global sequence -> this rank's sequence (or -1).
- ``StepStats`` / ``reduce_stats``: per-optimizer-step statistics summed (maxima maxed) over ranks.
- ``padding_forward``: the FSDP2 weight-0 forward that keeps collectives paired on ranks with fewer micro-batches.

Only tensors cross processes (no pickle): names travel as UTF-8 JSON bytes in a uint8 tensor.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from .distributed import Dist
from .rollout import Rollout


def any_rank(dist: Dist, flag: bool) -> bool:
    """True on every rank when ``flag`` is True on any rank."""
    return bool(dist.all_reduce_(torch.tensor([1.0 if flag else 0.0]), "max")) if dist.enabled else flag


def gather_reward_names(dist: Dist, names: list[str] | None) -> list[str]:
    """The reward names of the ranks that sampled something (``names`` None on the others), which must agree as
    sets; returned in the order of the lowest such rank (the domain's own order, as in a single process)."""
    if not dist.enabled:
        return list(names or [])
    data = json.dumps(list(names)).encode("utf-8") if names is not None else b""
    sizes = dist.gather_cat(torch.tensor([len(data)], dtype=torch.long)).tolist()
    if not any(sizes):
        return []
    blob = dist.gather_cat(torch.tensor(list(data), dtype=torch.uint8)).tolist()
    per_rank, off = [], 0
    for size in sizes:
        if size:
            per_rank.append(json.loads(bytes(blob[off: off + size]).decode("utf-8")))
        off += size
    if any(sorted(p) != sorted(per_rank[0]) for p in per_rank):
        raise RuntimeError(f"processes returned different reward names {per_rank}; every process must compute the "
                           f"same rewards")
    return per_rank[0]


def global_view(dist: Dist, local: Rollout | None) -> Rollout:
    """Rewards, masks, behaviour log-probs, tree structure and group keys of every rank's sequences, sorted by
    (round, call, position) of ``Rollout.origin``; no payload. With one process it is ``local`` without payload."""
    if not dist.enabled:
        assert local is not None
        return Rollout(local.keys, local.group_ids, local.rewards, local.logp_old, local.mask, local.parent, {},
                       local.nfe, {}, logp_deferred=local.logp_deferred, origin=local.origin,
                       fusion_logit=local.fusion_logit)
    names = gather_reward_names(dist, list(local.rewards) if local is not None else None)
    # ranks pad their steps to the longest rollout (LLM completions differ in length across ranks)
    T = int(dist.all_reduce_(torch.tensor([local.num_steps if local is not None else 0]), "max"))
    n = len(local) if local is not None else 0

    def pad_t(x: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((n, T), fill, dtype=x.dtype)
        out[:, : x.shape[1]] = x
        return out

    if local is not None:
        origin = local.origin
        # a parent's position inside its rollout call (the call's sequences are one block of the gathered data)
        ppos = (torch.where(local.parent >= 0, origin[local.parent.clamp(min=0), 3], local.parent)
                if local.parent is not None else torch.full((n,), -1, dtype=torch.long))
        key = torch.tensor(local.keys, dtype=torch.long)[local.group_ids]
        rewards = torch.stack([local.rewards[k].float() for k in names], 1) if names else torch.zeros(n, 0)
        logp, mask = pad_t(local.logp_old.float(), 0.0), pad_t(local.mask, False)
        fusion = local.fusion_logit.float() if local.fusion_logit is not None else torch.full((n,), float("nan"))
    else:
        fusion = torch.zeros(0)
        origin, ppos = torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        key = torch.zeros(0, dtype=torch.long)
        rewards, logp, mask = torch.zeros(0, len(names)), torch.zeros(0, T), torch.zeros(0, T, dtype=torch.bool)
    g_origin, g_key = dist.gather_cat(origin), dist.gather_cat(key)
    g_rewards, g_logp = dist.gather_cat(rewards), dist.gather_cat(logp)
    g_mask = dist.gather_cat(mask.to(torch.uint8)).bool()
    g_ppos = dist.gather_cat(ppos)
    g_fusion = dist.gather_cat(fusion)
    g_nfe = dist.all_reduce_(torch.tensor([float(local.nfe if local is not None else 0)]))
    # sort by (round, call, position); rebuild group ids, keys and parents
    perm = torch.argsort((g_origin[:, 0] * 100_000 + g_origin[:, 1]) * 10_000_000 + g_origin[:, 3])
    g_origin, g_key, g_rewards, g_logp, g_mask, g_ppos, g_fusion = (
        x[perm] for x in (g_origin, g_key, g_rewards, g_logp, g_mask, g_ppos, g_fusion))
    group_of: dict[tuple[int, int, int], int] = {}
    keys, gids = [], []
    for (rnd, c, gid, _pos, _draw), k in zip(g_origin.tolist(), g_key.tolist()):
        if (rnd, c, gid) not in group_of:
            group_of[(rnd, c, gid)] = len(keys)
            keys.append(k)
        gids.append(group_of[(rnd, c, gid)])
    parent = None
    if bool((g_ppos >= 0).any()):
        where = {(r, c, p): i for i, (r, c, _g, p, _d) in enumerate(g_origin.tolist())}
        parent = torch.tensor([where[(r, c, int(pp))] if pp >= 0 else -1
                               for (r, c, _g, _p, _d), pp in zip(g_origin.tolist(), g_ppos.tolist())], dtype=torch.long)
    fused = parent is not None and bool(torch.isfinite(g_fusion).all()) and g_fusion.numel() > 0
    return Rollout(keys, torch.tensor(gids, dtype=torch.long), {k: g_rewards[:, i] for i, k in enumerate(names)},
                   g_logp, g_mask, parent, {}, int(g_nfe), {}, origin=g_origin,
                   fusion_logit=g_fusion if fused else None)


def local_index(view: Rollout, local: Rollout | None) -> torch.Tensor:
    """``[len(view)]`` long: the index in this rank's ``local`` rollout of each global sequence, -1 for sequences
    another rank sampled (matched by ``origin``: round, call, group, position)."""
    to_local = torch.full((len(view),), -1, dtype=torch.long)
    if local is not None:
        pos = {tuple(o): i for i, o in enumerate(local.origin[:, :4].tolist())}
        for gi, o in enumerate(view.origin[:, :4].tolist()):
            to_local[gi] = pos.get(tuple(o), -1)
    return to_local


@dataclass
class StepStats:
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


# grad_norm and the grad/ noise statistics are computed from gradients summed over ranks: the same on every rank
SUM_STATS = ("loss/policy", "loss/kl", "loss/entropy_bonus", "ratio/mean", "clip_frac", "approx_kl", "entropy",
             "entropy_coef", "off_policy_dropped", "grad_norm", "nonfinite_steps", "grad/signal_sq", "grad/noise_trace",
             "grad/half_cosine")
PER_STEP_STATS = ("loss/policy", "loss/kl", "loss/entropy_bonus")  # counted once per optimizer step on every rank


def reduce_stats(dist: Dist, stats: StepStats) -> dict[str, float]:
    """Merge per-rank step statistics (sums and counts added, maxima maxed) and return their means / maxima."""
    if dist.enabled:
        buf = torch.tensor([[stats.sums.get(k, 0.0), stats.counts.get(k, 0.0)] for k in SUM_STATS],
                           dtype=torch.float64)
        dist.all_reduce_(buf)
        for i, k in enumerate(SUM_STATS):  # per-optimizer-step counts were added once per rank
            if k in PER_STEP_STATS:
                buf[i, 1] /= dist.world
        mx = torch.tensor([stats.maxes.get("ratio/max", -math.inf)], dtype=torch.float64)
        dist.all_reduce_(mx, "max")
        # grad_norm is computed after the sum over ranks: identical everywhere, so average, don't add
        stats = StepStats({k: float(buf[i, 0]) for i, k in enumerate(SUM_STATS) if buf[i, 1] > 0},
                          {k: float(buf[i, 1]) for i, k in enumerate(SUM_STATS) if buf[i, 1] > 0},
                          {"ratio/max": float(mx)} if math.isfinite(float(mx)) else {})
    return stats.result()


def padding_forward(domain, rollout: Rollout | None, need_kl: bool) -> None:
    """FSDP2: forward + backward on one of this rank's own sequences (the first with trained steps, e.g. not a
    tree root) with loss weight 0, which adds exactly zero to every gradient, only to take part in the same
    all-gathers and reduce-scatters as the other ranks."""
    if rollout is None or len(rollout) == 0:
        raise RuntimeError("FSDP2 padding forward: this process holds no sequence (see shared_rl.sharding.setup_fsdp)")
    trained = torch.nonzero(rollout.mask.any(dim=1)).flatten()
    row = trained[:1] if trained.numel() else torch.zeros(1, dtype=torch.long)
    out = domain.log_probs(rollout, row, need_kl)
    zero = out.logp.float().nan_to_num(0.0, 0.0, 0.0).sum() * 0.0
    if out.kl is not None:
        zero = zero + out.kl.float().nan_to_num(0.0, 0.0, 0.0).sum() * 0.0
    zero.backward()
