"""Which groups to train on: filters over sampled groups and samplers over group keys.

Filters (after a rollout):
- ``zero_std`` — DAPO dynamic sampling (Yu et al. 2025): drop groups whose rewards are all equal (no signal).
- ``band`` — SimpleVLA-RL / RLinf: keep groups whose mean success lies in [lo, hi].
The trainer filters, refills and trims by *key* (a key may own several groups, e.g. E-GRPO's one per consolidated
step): a drawn key is kept while any of its groups is, dropped keys are replaced by drawing more keys, at most
``max_refill_rounds`` times, and the first ``groups_per_iteration`` kept keys are trained with all their kept groups.

Key samplers (before a rollout), all with JSON-serialisable state for checkpoints. ``update(keys, successes,
counts, iteration)`` is called once per iteration with every key drawn in it once (successes and counts summed over
all its groups and refill rounds):
- ``UniformSampler`` — keys drawn uniformly without replacement within an iteration.
- ``VADESampler`` — per-key Beta(α, β) posterior on the success probability; Thompson-sample p̂ and take the
  keys with the largest information proxy p̂(1−p̂); pseudo-counts decay toward the prior on two time scales.
- ``HistorySkipSampler`` — RIPT-VLA / GRESO: skip keys whose last ``window`` groups were all-success or
  all-fail, re-admitting them after ``readmit_after`` iterations.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def group_keep_mask(
    rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int, mode: str, band: Sequence[float] = (0.1, 0.9),
    atol: float = 1e-8,
) -> torch.Tensor:
    """Per-group keep flags. NaN rewards are ignored; a group with < 2 finite rewards is dropped by any filter."""
    keep = torch.ones(num_groups, dtype=torch.bool)
    if mode == "none":
        return keep
    for g in range(num_groups):
        vals = rewards[(group_ids == g) & torch.isfinite(rewards)]
        if vals.numel() < 2:
            keep[g] = False
        elif mode == "zero_std":
            keep[g] = bool((vals.max() - vals.min()).abs() > atol)
        elif mode == "band":
            m = float(vals.mean())
            keep[g] = band[0] <= m <= band[1]
        else:
            raise ValueError(f"unknown group filter {mode!r}")
    return keep


def group_success(rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> tuple[list[float], list[int]]:
    """Per-group (sum of rewards clipped to [0, 1], count of finite rewards): success counts for Beta updates."""
    succ, cnt = [], []
    for g in range(num_groups):
        vals = rewards[(group_ids == g) & torch.isfinite(rewards)].clamp(0, 1)
        succ.append(float(vals.sum()))
        cnt.append(int(vals.numel()))
    return succ, cnt


class UniformSampler:
    def __init__(self, **_: Any) -> None:
        pass

    def select(self, keys: Sequence[int], n: int, generator: torch.Generator) -> list[int]:
        keys = list(keys)
        out: list[int] = []
        while len(out) < n:  # cycle through fresh permutations when n > len(keys)
            perm = torch.randperm(len(keys), generator=generator).tolist()
            out += [keys[i] for i in perm[: n - len(out)]]
        return out

    def update(self, keys: Sequence[int], successes: Sequence[float], counts: Sequence[int], iteration: int) -> None:
        pass

    def iteration_metrics(self, keys: Sequence[int], group_keys: Sequence[int], successes: Sequence[float],
                          counts: Sequence[int]) -> dict[str, float]:
        """What the sampler reports of an iteration: ``keys`` drawn first, and the first round's groups (their
        keys, summed successes and counts). ``selection/skipped``: the keys held out of this draw (history)."""
        skipped = self.num_skipped()
        return {} if skipped is None else {"selection/skipped": skipped}

    def num_skipped(self) -> int | None:
        """Keys held out of the last draw; ``None``: this sampler holds none out by design."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class VADESampler(UniformSampler):
    """VADE prompt selection: Beta posterior per key, Thompson sampling, information proxy p̂(1−p̂).

    Posterior for key k: α_k = α0 + w·a_fast + (1−w)·a_slow, β_k likewise; after each iteration every key's
    pseudo-counts decay (a ← λ·a) with λ_fast < λ_slow, so old evidence fades toward the prior Beta(α0, β0) as
    the policy changes; observed successes s and failures c−s of the drawn keys are then added.
    """

    def __init__(self, prior=(1.0, 1.0), decay_fast=0.7, decay_slow=0.95, fast_weight=0.5, **_: Any) -> None:
        self.prior = tuple(float(x) for x in prior)
        self.decay = (float(decay_fast), float(decay_slow))
        self.w = float(fast_weight)
        self.counts: dict[str, list[float]] = {}  # key -> [a_fast, b_fast, a_slow, b_slow]

    def posterior(self, key: int) -> tuple[float, float]:
        af, bf, as_, bs = self.counts.get(str(key), [0.0, 0.0, 0.0, 0.0])
        a = self.prior[0] + self.w * af + (1 - self.w) * as_
        b = self.prior[1] + self.w * bf + (1 - self.w) * bs
        return a, b

    def select(self, keys: Sequence[int], n: int, generator: torch.Generator) -> list[int]:
        keys = list(keys)
        ab = torch.tensor([self.posterior(k) for k in keys], dtype=torch.float64)
        # Thompson sample p ~ Beta(a, b) via two Gammas drawn from the trainer's generator (reproducible)
        ga = _gamma(ab[:, 0], generator)
        gb = _gamma(ab[:, 1], generator)
        p = ga / (ga + gb)
        score = p * (1 - p)
        order = torch.argsort(score, descending=True, stable=True).tolist()
        out = [keys[i] for i in order[:n]]
        while len(out) < n:
            out += [keys[i] for i in order[: n - len(out)]]
        return out

    def update(self, keys: Sequence[int], successes: Sequence[float], counts: Sequence[int], iteration: int) -> None:
        lf, ls = self.decay
        for c in self.counts.values():
            c[0] *= lf
            c[1] *= lf
            c[2] *= ls
            c[3] *= ls
        for k, s, n in zip(keys, successes, counts):
            c = self.counts.setdefault(str(k), [0.0, 0.0, 0.0, 0.0])
            c[0] += s
            c[1] += n - s
            c[2] += s
            c[3] += n - s

    def state_dict(self) -> dict:
        return {"counts": {k: list(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {k: [float(x) for x in v] for k, v in state.get("counts", {}).items()}


def _gamma(shape: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gamma(shape, 1) samples from ``generator`` (Marsaglia–Tsang; shape < 1 boosted by U^{1/shape})."""
    boost = shape < 1
    d = torch.where(boost, shape + 1, shape) - 1.0 / 3.0
    c = 1.0 / torch.sqrt(9.0 * d)
    out = torch.empty_like(shape)
    todo = torch.ones_like(shape, dtype=torch.bool)
    for _ in range(100):
        if not todo.any():
            break
        x = torch.randn(shape.shape, generator=generator, dtype=shape.dtype)
        u = torch.rand(shape.shape, generator=generator, dtype=shape.dtype)
        v = (1 + c * x) ** 3
        ok = (v > 0) & (torch.log(u.clamp(min=1e-300)) < 0.5 * x**2 + d - d * v + d * torch.log(v.clamp(min=1e-300)))
        take = ok & todo
        out[take] = (d * v)[take]
        todo &= ~ok
    out[todo] = d[todo]
    u = torch.rand(shape.shape, generator=generator, dtype=shape.dtype)
    return torch.where(boost, out * u ** (1.0 / shape), out)


class HistorySkipSampler(UniformSampler):
    """Skip keys whose last ``window`` groups were all-success or all-fail (RIPT-VLA / GRESO)."""

    def __init__(self, window: int = 2, readmit_after: int = 5, **_: Any) -> None:
        self.window = int(window)
        self.readmit_after = int(readmit_after)
        self.history: dict[str, list[int]] = {}  # key -> recent outcomes: 1 all-success, -1 all-fail, 0 mixed
        self.skipped_at: dict[str, int] = {}
        self.iteration = 0

    def _skipped(self, key: int) -> bool:
        k = str(key)
        since = self.skipped_at.get(k)
        if since is not None and self.iteration - since >= self.readmit_after:
            self.skipped_at.pop(k)
            self.history[k] = []
            return False
        return since is not None

    def select(self, keys: Sequence[int], n: int, generator: torch.Generator) -> list[int]:
        active = [k for k in keys if not self._skipped(k)]
        return super().select(active or list(keys), n, generator)

    def update(self, keys: Sequence[int], successes: Sequence[float], counts: Sequence[int], iteration: int) -> None:
        self.iteration = iteration + 1
        for k, s, n in zip(keys, successes, counts):
            h = self.history.setdefault(str(k), [])
            h.append(1 if n and s >= n else (-1 if s <= 0 else 0))
            del h[: -self.window]
            if len(h) == self.window and (all(x == 1 for x in h) or all(x == -1 for x in h)):
                self.skipped_at.setdefault(str(k), self.iteration)

    def num_skipped(self) -> int:
        """Keys held out now (after a ``select``: the keys that draw could not pick)."""
        return len(self.skipped_at)

    def state_dict(self) -> dict:
        return {"history": self.history, "skipped_at": self.skipped_at, "iteration": self.iteration}

    def load_state_dict(self, state: dict) -> None:
        self.history = {k: list(v) for k, v in state.get("history", {}).items()}
        self.skipped_at = {k: int(v) for k, v in state.get("skipped_at", {}).items()}
        self.iteration = int(state.get("iteration", 0))


def make_sampler(cfg) -> UniformSampler:
    """Build the key sampler named by a ``SelectionConfig``."""
    if cfg.sampler == "uniform":
        return UniformSampler()
    if cfg.sampler == "vade":
        return VADESampler(cfg.vade_prior, cfg.vade_decay_fast, cfg.vade_decay_slow, cfg.vade_fast_weight)
    if cfg.sampler == "history":
        return HistorySkipSampler(cfg.history_window, cfg.history_readmit_after)
    raise ValueError(f"unknown sampler {cfg.sampler!r}")


class StratifiedSampler:
    """Per-stratum keys over the strata ``stratum(key)`` names (a domain wraps the configured sampler in it through
    its ``key_sampler`` hook; robotics: the task of a reset state, ``robotics.balance``), each stratum's share drawn by the wrapped sampler from that stratum's keys
    (so history skipping and VADE still apply within a stratum); every stratum's keys also pass through the wrapped
    sampler's ``update``.

    ``by_need=False`` (balance by equal): the ``n`` keys are split as evenly as possible; when n is not
    a multiple of the number of strata, the strata that get one key more are drawn at random.
    ``by_need=True`` (balance by need, prioritised task sampling as in multi-task curricula): every stratum keeps
    ``need_floor`` keys (1: its outcomes stay observed) and the other n − floor·S go in proportion to its need
    1 − p̂_s, p̂_s an exponential average (weight ``need_decay`` on the past) of the stratum's success rate per
    iteration; largest remainders round the shares, ties go to the lower stratum name. A stratum not yet observed
    counts need 1; when every stratum is solved (all needs 0) the split is even. So rollouts a solved task would
    waste on all-success groups go to the tasks that still fail; with ``need_floor=0`` a stratum whose average
    reaches 1 gets none at all (and, unobserved, keeps its average)."""

    def __init__(self, inner: UniformSampler, stratum, by_need: bool = False, need_decay: float = 0.7,
                 need_floor: int = 1) -> None:
        self.inner, self.stratum = inner, stratum
        self.by_need, self.need_decay, self.need_floor = bool(by_need), float(need_decay), int(need_floor)
        self.success_rate: dict[str, float] = {}  # str(stratum) -> p̂_s

    def shares(self, names: Sequence[Any], n: int, generator: torch.Generator) -> list[int]:
        """Keys per stratum (in the order of ``names``), summing to ``n``."""
        s, floor = len(names), self.need_floor
        if not self.by_need or n < s * floor:
            base, extra = divmod(n, s)
            lucky = set(torch.randperm(s, generator=generator)[:extra].tolist())
            return [base + (1 if i in lucky else 0) for i in range(s)]
        need = [1.0 - self.success_rate.get(str(name), 0.0) for name in names]
        total, rest = sum(need), n - s * floor
        if total <= 0:
            need, total = [1.0] * s, float(s)
        quota = [rest * w / total for w in need]
        out = [floor + int(q) for q in quota]
        by_remainder = sorted(range(s), key=lambda i: (-(quota[i] - int(quota[i])), i))
        for i in by_remainder[: n - sum(out)]:
            out[i] += 1
        return out

    def select(self, keys: Sequence[int], n: int, generator: torch.Generator) -> list[int]:
        groups: dict[Any, list[int]] = {}
        for k in keys:
            groups.setdefault(self.stratum(k), []).append(k)
        names = sorted(groups)
        out: list[int] = []
        for name, m in zip(names, self.shares(names, n, generator)):
            if m:
                out += self.inner.select(groups[name], m, generator)
        return out

    def update(self, keys: Sequence[int], successes: Sequence[float], counts: Sequence[int], iteration: int) -> None:
        self.inner.update(keys, successes, counts, iteration)
        if not self.by_need:
            return
        for name, rate in self.rates(keys, successes, counts).items():
            old = self.success_rate.get(name)
            self.success_rate[name] = rate if old is None else self.need_decay * old + (1 - self.need_decay) * rate

    def rates(self, keys: Sequence[int], successes: Sequence[float], counts: Sequence[int]) -> dict[str, float]:
        """Each stratum's success rate over the given keys' groups (strata with no counted episode left out)."""
        per: dict[str, list[float]] = {}
        for k, succ, cnt in zip(keys, successes, counts):
            acc = per.setdefault(str(self.stratum(k)), [0.0, 0.0])
            acc[0] += float(succ)
            acc[1] += float(cnt)
        return {name: succ / cnt for name, (succ, cnt) in sorted(per.items()) if cnt > 0}

    def iteration_metrics(self, keys: Sequence[int], group_keys: Sequence[int], successes: Sequence[float],
                          counts: Sequence[int]) -> dict[str, float]:
        """The wrapped sampler's metrics, plus ``selection/keys/<stratum>`` (by need: where the keys went) and
        ``selection/success/<stratum>`` (each stratum's success over the first round's groups: per-task curves)."""
        out = {}
        if self.by_need:
            for k in keys:
                name = f"selection/keys/{self.stratum(k)}"
                out[name] = out.get(name, 0) + 1
        out.update({f"selection/success/{name}": r for name, r in self.rates(group_keys, successes, counts).items()})
        out.update(self.inner.iteration_metrics(keys, group_keys, successes, counts))
        return out

    def num_skipped(self) -> int | None:
        """The wrapped sampler's held-out keys (``None`` when it holds none out by design)."""
        return self.inner.num_skipped()

    def state_dict(self) -> dict:
        state = self.inner.state_dict()
        return {**state, "stratum_success_rate": dict(self.success_rate)} if self.by_need else state

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        self.success_rate = {k: float(v) for k, v in state.pop("stratum_success_rate", {}).items()}
        self.inner.load_state_dict(state)
