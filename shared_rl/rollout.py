"""The data one iteration produces: N sequences of T steps in G groups, optionally arranged as trees.

A *sequence* is the unit that carries one advantage: a denoising trajectory (visgen, flat GRPO), one tree edge
(visgen BranchGRPO/TreeGRPO: a segment of denoising steps), a completion (LLM: steps are tokens) or an episode
(robotics: steps are action-chunk denoising steps). Every step has a behaviour log-prob ``logp_old[n, t]`` and
``mask[n, t]`` says whether that step is trained. Rewards live on the sequences that end in an outcome
(leaves); internal tree edges carry NaN rewards and get their value from the leaves below (``tree_values``).

*Groups* are explicit: ``group_ids[n]`` says which group a sequence is in and ``keys[g]`` which key (prompt,
reset state) group g was sampled for. A requested key usually owns one group, but may own several (E-GRPO: one
group per (prompt, consolidated step)); ``key_index`` then says which requested key each group belongs to.

``payload`` holds whatever the domain needs to recompute log-probs (latents, token ids, observations): a dict of
tensors / lists / numpy arrays whose first dimension is N. The trainer only ever indexes it and concatenates it,
so refilling groups (dynamic sampling) and minibatching work for every domain without domain code. The trainer's
own bookkeeping (``origin``) is a field of its own, never a payload key.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _index(value: Any, idx: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[idx.to(value.device)]
    if isinstance(value, np.ndarray):
        return value[idx.cpu().numpy()]
    if isinstance(value, (list, tuple)):
        return [value[i] for i in idx.tolist()]
    if isinstance(value, dict):
        return {k: _index(v, idx) for k, v in value.items()}
    raise TypeError(f"payload entries must be tensors, arrays, lists or dicts of those, got {type(value).__name__}")


def _cat(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values, 0)
    if isinstance(first, np.ndarray):
        return np.concatenate(values, 0)
    if isinstance(first, (list, tuple)):
        return [x for v in values for x in v]
    if isinstance(first, dict):
        return {k: _cat([v[k] for v in values]) for k in first}
    raise TypeError(f"cannot concatenate payload entries of type {type(first).__name__}")


INFO_REDUCTIONS = ("sum", "mean", "last")


def combine_info(parts: list["Rollout"], reduce: dict[str, str]) -> dict[str, Any]:
    """The info of concatenated rollouts: each numeric key combined as ``reduce`` says (``Rollout.info_reduce``;
    sum when unnamed), other values the last part's."""
    out: dict[str, Any] = {}
    for k in dict.fromkeys(k for p in parts for k in p.info):
        vals = [(p.info[k], len(p)) for p in parts if k in p.info]
        how = reduce.get(k, "sum")
        if how not in INFO_REDUCTIONS:
            raise ValueError(f"Rollout.info_reduce[{k!r}] is {how!r}; choose one of {INFO_REDUCTIONS}")
        numeric = [(float(v), n) for v, n in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numeric) != len(vals):
            out[k] = vals[-1][0]
        elif how == "last":
            out[k] = vals[-1][0]
        elif how == "mean":
            finite = [(v, n) for v, n in numeric if math.isfinite(v)]
            out[k] = sum(v * n for v, n in finite) / sum(n for _, n in finite) if finite else float("nan")
        else:
            out[k] = sum(v for v, _ in vals)
    return out


@dataclass
class Rollout:
    """Sequences sampled in one call of ``Domain.rollout``.

    Attributes:
        keys: ``[G]`` the key of each group (prompt id, reset-state id); ``group_ids`` index into it. One entry per
            *group*, so a key that owns several groups appears several times.
        group_ids: ``[N]`` long, which group each sequence belongs to (0..G-1).
        rewards: name -> ``[N]`` float rewards; NaN where a sequence has no outcome (internal tree edge) or the
            reward failed (the trainer masks and counts those).
        logp_old: ``[N, T]`` float32 behaviour log-probs of each step (0 where not stochastic); placeholders where
            ``logp_deferred``.
        mask: ``[N, T]`` bool, steps that are trained.
        parent: ``[N]`` long parent sequence index (-1 for roots) when the sequences form trees, else None.
            For a tree rollout, sequence i is the edge into node i; a root node has an all-False mask.
        payload: domain data indexed along dim 0.
        nfe: model forward evaluations spent producing this rollout (one per sample per model call).
        info: extra scalar metrics. ``cat`` (rollout calls, refill rounds) combines a numeric value as
            ``info_reduce`` says, summing by default (counts of this call: env steps, episodes, seconds).
        info_reduce: info key -> how ``cat`` combines it: ``"mean"`` (a rate or score of the call's samples: the
            mean over calls weighted by their sequences, NaN calls left out), ``"last"`` (a running total the
            domain keeps: the newest call's value); keys not named are summed.
        logp_deferred: ``[N, T]`` bool, steps whose behaviour log-prob is *deferred*: the rollout was sampled by
            the current weights and the trainer takes ``logp_old`` from its first forward before any update (one
            forward saved, ratio exactly 1), or computes it up front when an iteration has several minibatches.
            The ``logp_old`` values there are placeholders (NaN by convention, so an unfilled one cannot pass
            unnoticed). None (the default) = nothing deferred, except that NaN steps of ``logp_old`` are read as
            deferred (the contract before this field existed; set the field instead).
        key_index: ``[G]`` long, for a rollout returned by ``Domain.rollout(keys, ...)``: the position in that
            ``keys`` argument of the key each group was sampled for. Needed only when a key owns several groups
            and the same key may be requested twice in one call; otherwise None and the trainer infers it
            (``resolve_key_index``). ``cat`` of several rollouts drops it (positions into different requests).
        fusion_logit: ``[N]`` float, tree rollouts only: per-node logits of a softmax-weighted value fusion
            (BranchGRPO's log-prob-weighted reward fusion; ``advantages.tree_values``), None = the leaf mean.
        origin: ``[N, 5]`` long, set by the trainer, never by a domain: (refill round, rollout call, group in
            that call, position in that call, draw) of each sequence, where *draw* numbers the keys requested in
            one iteration (all rounds); the trainer counts, filters, refills and trims by draw.
    """

    keys: list[int]
    group_ids: torch.Tensor
    rewards: dict[str, torch.Tensor]
    logp_old: torch.Tensor
    mask: torch.Tensor
    parent: torch.Tensor | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    nfe: int = 0
    info: dict[str, float] = field(default_factory=dict)
    info_reduce: dict[str, str] = field(default_factory=dict)
    logp_deferred: torch.Tensor | None = None
    key_index: torch.Tensor | None = None
    origin: torch.Tensor | None = None
    fusion_logit: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.group_ids.shape[0]
        if self.logp_old.shape[0] != n or self.mask.shape != self.logp_old.shape:
            raise ValueError(
                f"rollout shapes disagree: group_ids {tuple(self.group_ids.shape)}, logp_old "
                f"{tuple(self.logp_old.shape)}, mask {tuple(self.mask.shape)}"
            )
        for name, r in self.rewards.items():
            if r.shape != (n,):
                raise ValueError(f"reward {name!r} has shape {tuple(r.shape)}, expected ({n},)")
        if self.parent is not None and self.parent.shape != (n,):
            raise ValueError(f"parent has shape {tuple(self.parent.shape)}, expected ({n},)")
        if n and int(self.group_ids.max()) >= len(self.keys):
            raise ValueError(f"group id {int(self.group_ids.max())} but only {len(self.keys)} keys: keys needs one "
                             f"entry per group (repeat a key that owns several groups)")
        if self.logp_deferred is None:
            self.logp_deferred = torch.isnan(self.logp_old)
        elif self.logp_deferred.shape != self.logp_old.shape or self.logp_deferred.dtype != torch.bool:
            raise ValueError(f"logp_deferred must be a bool tensor shaped like logp_old {tuple(self.logp_old.shape)}, "
                             f"got {self.logp_deferred.dtype} {tuple(self.logp_deferred.shape)}")
        if self.key_index is not None and tuple(self.key_index.shape) != (len(self.keys),):
            raise ValueError(f"key_index has shape {tuple(self.key_index.shape)}, expected ({len(self.keys)},): one "
                             f"entry per group")
        if self.fusion_logit is not None and (self.parent is None or tuple(self.fusion_logit.shape) != (n,)):
            raise ValueError(f"fusion_logit must be [N] = ({n},) on a tree rollout (parent set), got "
                             f"{tuple(self.fusion_logit.shape)}{'' if self.parent is not None else ' without parent'}")
        if self.origin is not None and tuple(self.origin.shape) != (n, 5):
            raise ValueError(f"origin has shape {tuple(self.origin.shape)}, expected ({n}, 5)")

    def __len__(self) -> int:
        return int(self.group_ids.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.logp_old.shape[1])

    @property
    def num_groups(self) -> int:
        return len(self.keys)

    def resolve_key_index(self, requested: list[int]) -> torch.Tensor:
        """``[G]`` the position in ``requested`` (the ``keys`` argument of the ``Domain.rollout`` call that returned
        this rollout) of each group's key: ``key_index`` when the domain set it; else group g <-> position g when
        the domain returned one group per requested key in order; else matched by value, which needs every
        requested key to be distinct."""
        if self.key_index is not None:
            idx = self.key_index.long()
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(requested)):
                raise ValueError(f"key_index out of range for {len(requested)} requested keys")
            return idx
        if list(self.keys) == list(requested):
            return torch.arange(len(self.keys))
        pos = {k: i for i, k in enumerate(requested)}
        if len(pos) != len(requested):
            raise ValueError(f"the rollout has {len(self.keys)} groups for {len(requested)} requested keys with "
                             f"repeats, so its groups cannot be matched to the requests; the domain must set "
                             f"Rollout.key_index")
        missing = sorted({k for k in self.keys if k not in pos})
        if missing:
            raise ValueError(f"the rollout has groups for keys {missing} that were not requested")
        return torch.tensor([pos[k] for k in self.keys], dtype=torch.long)

    def select_groups(self, keep: torch.Tensor) -> "Rollout":
        """Keep the groups where ``keep[g]`` is True (whole trees stay whole); group ids are renumbered."""
        return self.take(torch.nonzero(keep.bool()[self.group_ids]).flatten())

    def take(self, idx: torch.Tensor) -> "Rollout":
        """The sequences ``idx`` (in that order), which must hold whole groups; groups are renumbered in order of
        first appearance and parents are remapped."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        old_gid = self.group_ids[idx]
        uniq, first = [], set()
        for g in old_gid.tolist():
            if g not in first:
                first.add(g)
                uniq.append(g)
        gmap = torch.full((len(self.keys),), -1, dtype=torch.long)
        gmap[torch.tensor(uniq, dtype=torch.long)] = torch.arange(len(uniq))
        parent = None
        if self.parent is not None:
            remap = torch.full((len(self),), -1, dtype=torch.long)
            remap[idx] = torch.arange(idx.numel())
            old_parent = self.parent[idx]
            parent = torch.where(old_parent >= 0, remap[old_parent.clamp(min=0)], old_parent)
            if bool(((old_parent >= 0) & (parent < 0)).any()):
                raise ValueError("take() would cut a tree: a kept node's parent was dropped")
        return Rollout(
            keys=[self.keys[g] for g in uniq],
            group_ids=gmap[old_gid],
            rewards={k: v[idx] for k, v in self.rewards.items()},
            logp_old=self.logp_old[idx],
            mask=self.mask[idx],
            parent=parent,
            payload=_index(self.payload, idx),
            nfe=self.nfe,
            info=dict(self.info),
            info_reduce=dict(self.info_reduce),
            logp_deferred=self.logp_deferred[idx],
            key_index=self.key_index[torch.tensor(uniq, dtype=torch.long)] if self.key_index is not None else None,
            origin=self.origin[idx] if self.origin is not None else None,
            fusion_logit=self.fusion_logit[idx] if self.fusion_logit is not None else None,
        )

    def index_payload(self, idx: torch.Tensor) -> dict[str, Any]:
        """The payload rows ``idx`` (what ``Domain.log_probs`` reads for a micro-batch)."""
        return _index(self.payload, idx)

    @staticmethod
    def cat(parts: list["Rollout"]) -> "Rollout":
        """Concatenate rollouts (refill rounds); group ids and parents are offset, nfe and counts summed."""
        if len(parts) == 1:
            return parts[0]
        steps = {p.num_steps for p in parts}
        if len(steps) != 1:
            raise ValueError(f"cannot concatenate rollouts with different step counts {sorted(steps)}")
        keys, gids, parents, info = [], [], [], {}
        g_off = n_off = 0
        for p in parts:
            keys += list(p.keys)
            gids.append(p.group_ids + g_off)
            if p.parent is not None:
                parents.append(torch.where(p.parent >= 0, p.parent + n_off, p.parent))
            g_off += len(p.keys)
            n_off += len(p)
        reduce = {k: how for p in parts for k, how in p.info_reduce.items()}
        info = combine_info(parts, reduce)
        if parents and len(parents) != len(parts):
            raise ValueError("cannot concatenate tree and flat rollouts")
        fused = [p.fusion_logit for p in parts if p.fusion_logit is not None]
        if fused and len(fused) != len(parts):
            raise ValueError("cannot concatenate rollouts with and without fusion_logit")
        return Rollout(
            keys=keys,
            group_ids=torch.cat(gids),
            rewards={k: torch.cat([p.rewards[k] for p in parts]) for k in parts[0].rewards},
            logp_old=torch.cat([p.logp_old for p in parts]),
            mask=torch.cat([p.mask for p in parts]),
            parent=torch.cat(parents) if parents else None,
            payload=_cat([p.payload for p in parts]),
            nfe=sum(p.nfe for p in parts),
            info=info,
            info_reduce=reduce,
            logp_deferred=torch.cat([p.logp_deferred for p in parts]),
            origin=torch.cat([p.origin for p in parts]) if all(p.origin is not None for p in parts) else None,
            fusion_logit=torch.cat(fused) if fused else None,
        )
