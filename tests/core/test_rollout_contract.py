"""The Rollout contract the trainer relies on: explicit groups (a key may own several, as in E-GRPO), deferred
behaviour log-probs as a flag, the trainer's bookkeeping outside the payload, and the rollout-structure hook."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from shared_rl import registry
from shared_rl.config import ConfigError, load_train_config
from shared_rl.domain import DomainBase, DomainConfig, StepLogProbs
from shared_rl.llm.domain import LLMConfig
from shared_rl.rollout import Rollout
from shared_rl.trainer import Trainer


@dataclass
class MultiGroupConfig(DomainConfig):
    num_keys: int = 6
    groups_per_key: int = 3
    set_key_index: bool = True


class MultiGroupDomain(DomainBase):
    """A bandit whose rollout returns ``groups_per_key`` groups per requested key, key-major like E-GRPO (one group
    per (prompt, consolidated step)), so ``Rollout.keys`` repeats every key. Group j of key k has reward
    ``10k + j`` (+0.1 on odd members when it has signal): keys with k % 3 == 0 have no group with signal (the
    zero_std filter drops the whole key), the others lose only their group j = 0."""

    config_class = MultiGroupConfig

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.table = torch.nn.Parameter(torch.zeros(cfg.num_keys, 3))

    def train_keys(self):
        return list(range(self.cfg.num_keys))

    def rollout(self, keys, group_size, generator, iteration):
        J = self.cfg.groups_per_key
        group_keys = [k for k in keys for _ in range(J)]
        gid = torch.arange(len(group_keys)).repeat_interleave(group_size)
        ctx = torch.tensor(group_keys, dtype=torch.long)[gid]
        j = (torch.arange(len(group_keys)) % J)[gid]
        member = torch.arange(len(gid)) % group_size
        probs = torch.softmax(self.table.detach()[ctx], -1)
        actions = torch.multinomial(probs, 1, generator=generator)
        logp = torch.log(probs.gather(1, actions))
        signal = (ctx % 3 != 0) & (j != 0)
        reward = 10.0 * ctx + j + torch.where(signal, 0.1 * (member % 2), torch.zeros(len(gid)))
        extra = {"key_index": torch.arange(len(keys)).repeat_interleave(J)} if self.cfg.set_key_index else {}
        return Rollout(keys=group_keys, group_ids=gid, rewards={"score": reward.float()}, logp_old=logp,
                       mask=torch.ones_like(logp, dtype=torch.bool), payload={"ctx": ctx, "actions": actions},
                       nfe=len(gid), **extra)

    def log_probs(self, rollout, idx, need_kl):
        assert set(rollout.payload) == {"ctx", "actions"}  # the trainer's bookkeeping is not in the payload
        p = rollout.index_payload(idx)
        return StepLogProbs(logp=torch.log_softmax(self.table[p["ctx"]], -1).gather(1, p["actions"]), nfe=len(idx))

    def parameters(self):
        return [self.table]

    def state_dict(self):
        return {"table": self.table.detach().clone()}

    def load_state_dict(self, state):
        with torch.no_grad():
            self.table.copy_(state["table"])


def _multi_trainer(monkeypatch, groups_per_iteration=4, sampler="vade", **domain):
    monkeypatch.setattr(registry, "resolve_domain", lambda name: MultiGroupDomain)
    monkeypatch.setattr("shared_rl.trainer.resolve_domain", lambda name: MultiGroupDomain)
    cfg = load_train_config({
        "domain": "multi", "seed": 0, "iterations": 2, "device": "cpu",
        "rollout": {"groups_per_iteration": groups_per_iteration, "group_size": 4},
        "selection": {"filter": "zero_std", "sampler": sampler, "max_refill_rounds": 3},
        "optim": {"lr": 0.1}, "logging": {"progress": False}, "eval": {"at_start": False},
        "multi": domain,
    })
    tr = Trainer(cfg, None, log=lambda *_: None)
    selects, updates, trained = [], [], []
    real_select, real_update = tr.sampler.select, tr.sampler.update

    def select(keys, n, gen):
        out = real_select(keys, n, gen)
        selects[-1].append((n, list(out)))
        return out

    def update(keys, successes, counts, it):
        updates[-1].append((list(keys), list(successes), list(counts)))
        return real_update(keys, successes, counts, it)

    real_estimator = tr.estimator

    def combine(inputs, cfg):  # the groups that reach the advantages (after filter and trim)
        r, group_ids = inputs.rewards["score"], inputs.group_ids
        groups = []
        for g in torch.unique(group_ids).tolist():
            low = float(r[group_ids == g].min())
            key = int(low // 10)
            groups.append((key, round(low - 10 * key)))
        trained[-1].append(sorted(groups))
        return real_estimator(inputs, cfg)

    monkeypatch.setattr(tr.sampler, "select", select)
    monkeypatch.setattr(tr.sampler, "update", update)
    monkeypatch.setattr(tr, "estimator", combine)

    def run(it):
        selects.append([])
        updates.append([])
        trained.append([])
        return tr.iteration(it)

    return tr, run, selects, updates, trained


def test_filter_refill_and_trim_count_keys_that_own_several_groups(monkeypatch):
    # distinct keys per rollout call: the trainer matches groups to requested keys by value (no key_index)
    tr, run, selects, updates, trained = _multi_trainer(monkeypatch, set_key_index=False)
    J, G, n_keys = 3, 4, 4
    refilled = False
    for it in range(2):
        before = {k: list(v) for k, v in tr.sampler.counts.items()}
        m = run(it)
        rounds = selects[it]
        draws = [k for _, keys in rounds for k in keys]
        # refill asks for (groups_per_iteration - kept keys) more keys
        kept_so_far = 0
        for r, (n, keys) in enumerate(rounds):
            assert n == (n_keys if r == 0 else n_keys - kept_so_far)
            kept_so_far += sum(k % 3 != 0 for k in keys)
        refilled |= len(rounds) > 1
        # trim: every kept group (j = 1, 2) of the first groups_per_iteration kept keys survives
        first_kept = [k for k in draws if k % 3 != 0][:n_keys]
        assert trained[it] == [sorted((k, j) for k in first_kept for j in (1, 2))]
        assert m["groups/kept"] == 2 * len(first_kept) and m["groups/drawn"] == J * len(draws)
        # the key sampler: one update per iteration, each drawn key once with all its groups and rounds
        assert len(updates[it]) == 1
        keys, successes, counts = updates[it][0]
        assert sorted(keys) == sorted(set(draws))
        assert counts == [J * G * draws.count(k) for k in keys]
        if it == 0:  # no earlier evidence: a single update adds the counts once, with no extra decay
            assert not before
            for k, n in zip(keys, counts):
                af, bf, as_, bs = tr.sampler.counts[str(k)]
                assert af + bf == pytest.approx(n) and as_ + bs == pytest.approx(n)
    assert refilled, "the seed should make at least one iteration refill"


def test_a_key_requested_twice_in_one_call_needs_key_index(monkeypatch):
    # 2 keys, 3 per iteration: the uniform sampler repeats a key inside one rollout call
    tr, run, selects, _, trained = _multi_trainer(monkeypatch, groups_per_iteration=3, sampler="uniform",
                                                  num_keys=2, set_key_index=True)
    m = run(0)
    draws = [k for _, keys in selects[0] for k in keys]
    assert len(draws) > len(set(draws))
    first_kept = [k for k in draws if k % 3 != 0][:3]
    assert m["groups/kept"] == 2 * len(first_kept)
    assert trained[0] == [sorted((k, j) for k in first_kept for j in (1, 2))]
    tr, run, *_ = _multi_trainer(monkeypatch, groups_per_iteration=3, sampler="uniform", num_keys=2,
                                 set_key_index=False)
    with pytest.raises(ValueError, match="must set Rollout.key_index"):
        run(0)


def _rollout(keys, group_ids, **kw):
    n = len(group_ids)
    return Rollout(keys=keys, group_ids=torch.tensor(group_ids), rewards={"r": torch.zeros(n)},
                   logp_old=kw.pop("logp_old", torch.zeros(n, 2)), mask=torch.ones(n, 2, dtype=torch.bool), **kw)


def test_resolve_key_index():
    assert _rollout([5, 5, 7, 7], [0, 1, 2, 3]).resolve_key_index([5, 7]).tolist() == [0, 0, 1, 1]
    assert _rollout([5, 5], [0, 1]).resolve_key_index([5, 5]).tolist() == [0, 1]  # one group per requested key
    explicit = _rollout([5, 5, 5, 5], [0, 1, 2, 3], key_index=torch.tensor([0, 0, 1, 1]))
    assert explicit.resolve_key_index([5, 5]).tolist() == [0, 0, 1, 1]
    assert explicit.take(torch.tensor([2, 3])).key_index.tolist() == [1, 1]
    with pytest.raises(ValueError, match="must set Rollout.key_index"):
        _rollout([5, 5, 5, 5], [0, 1, 2, 3]).resolve_key_index([5, 5])
    with pytest.raises(ValueError, match="not requested"):
        _rollout([5, 9], [0, 1]).resolve_key_index([5, 7])
    with pytest.raises(ValueError, match="one entry per group"):
        _rollout([5], [0, 1])


def test_logp_deferred_is_an_explicit_flag():
    nan = float("nan")
    legacy = _rollout([1, 2], [0, 1], logp_old=torch.tensor([[nan, 0.0], [-1.0, -2.0]]))
    assert legacy.logp_deferred.tolist() == [[True, False], [False, False]]  # NaN without the flag: deferred
    flagged = _rollout([1, 2], [0, 1], logp_deferred=torch.tensor([[True, True], [False, False]]))
    both = Rollout.cat([flagged, flagged.take(torch.tensor([1]))])
    assert both.logp_deferred.tolist() == [[True, True], [False, False], [False, False]]
    with pytest.raises(ValueError, match="logp_deferred must be a bool tensor"):
        _rollout([1], [0], logp_deferred=torch.zeros(1, 2))


def test_tree_estimator_needs_tree_rollouts():
    with pytest.raises(ConfigError, match="'depth_zscore' needs tree rollouts; this config's toy rollouts are flat"):
        load_train_config({"domain": "toy", "advantage": {"estimator": "depth_zscore"}})
    load_train_config({"domain": "toy", "advantage": {"estimator": "depth_zscore"}, "toy": {"tree_branch": 2}})
    with pytest.raises(ConfigError, match="'treerl' needs tree rollouts; this config's llm rollouts are flat"):
        load_train_config({"domain": "llm", "advantage": {"estimator": "treerl"}})
    cfg = load_train_config({"domain": "llm", "advantage": {"estimator": "treerl"}, "llm": {"tree": {"enabled": True}}})
    assert cfg.domain_config.rollout_structure(cfg) == "tree" and LLMConfig().rollout_structure(cfg) == "flat"


def test_cat_combines_info_as_each_key_declares():
    """Counts of a call add up, rates are the sample-weighted mean over calls (NaN calls left out), running totals
    are the newest call's; a key nobody declares is summed (the contract before info_reduce)."""
    reduce = {"rate": "mean", "total": "last", "spearman": "mean"}
    a = _rollout([1], [0, 0], info={"steps": 10, "rate": 0.5, "total": 100.0, "spearman": float("nan"), "tag": "a"},
                 info_reduce=reduce)
    b = _rollout([2, 3], [0, 0, 1, 1, 1, 1], info={"steps": 4, "rate": 0.2, "total": 104.0, "spearman": 0.3,
                                                   "tag": "b"}, info_reduce=reduce)
    both = Rollout.cat([a, b])
    assert both.info["steps"] == 14 and isinstance(both.info["steps"], int)
    assert both.info["rate"] == pytest.approx((0.5 * 2 + 0.2 * 6) / 8)
    assert both.info["total"] == 104.0 and both.info["spearman"] == pytest.approx(0.3) and both.info["tag"] == "b"
    assert both.info_reduce == reduce
    again = Rollout.cat([both, a])  # the declaration travels with the concatenation (refill rounds)
    assert again.info["total"] == 100.0 and again.info["steps"] == 24
    all_nan = Rollout.cat([a, a])
    assert np.isnan(all_nan.info["spearman"])
    with pytest.raises(ValueError, match="info_reduce"):
        Rollout.cat([_rollout([1], [0], info={"x": 1.0}, info_reduce={"x": "median"}), a])
