"""Per-stratum key balance (a domain's ``key_sampler`` hook wrapping ``StratifiedSampler``; robotics: its tasks,
``robotics.balance``): every stratum gets its share of keys per iteration."""
from collections import Counter

import pytest
import torch

from shared_rl.selection import HistorySkipSampler, StratifiedSampler, UniformSampler


def test_stratified_sampler_balances_and_keeps_the_inner_rule():
    keys = list(range(100))  # stratum = key % 5, but 60 keys are in stratum 0 (unbalanced pool)
    stratum = lambda k: 0 if k < 60 else k % 4 + 1  # noqa: E731
    s = StratifiedSampler(UniformSampler(), stratum)
    g = torch.Generator().manual_seed(0)
    for n in (10, 5, 15):
        got = s.select(keys, n, g)
        assert len(got) == n and len(set(got)) == n
        assert set(Counter(stratum(k) for k in got).values()) == {n // 5}
    counts = Counter(len([k for k in s.select(keys, 7, g) if stratum(k) == 0]) for _ in range(200))
    assert set(counts) == {1, 2}, counts  # 7 = 5 x 1 + 2: the extra keys go to random strata
    # the wrapped sampler still decides within a stratum: all-fail keys are skipped
    inner = HistorySkipSampler(window=1, readmit_after=100)
    s = StratifiedSampler(inner, stratum)
    s.update([60, 61], [0.0, 0.0], [8, 8], 0)
    for _ in range(20):
        assert not {60, 61} & set(s.select(keys, 10, g))
    assert s.state_dict() == inner.state_dict()
    assert s.num_skipped() == 2 and StratifiedSampler(UniformSampler(), stratum).num_skipped() is None


def test_balance_is_the_domains_setting_not_the_cores():
    from shared_rl.config import ConfigError, load_train_config

    for key in ("balance", "balance_by", "need_decay", "need_floor"):
        with pytest.raises(ConfigError, match=f"selection.{key}' was replaced: per-stratum key balance is the domain"):
            load_train_config({"domain": "toy", "selection": {key: 1}})


def test_need_weighted_strata_hand_computed_and_resumable():
    """balance_by: need — one key per stratum, the rest in proportion to 1 − EMA(success), largest remainders."""
    keys = list(range(50))
    stratum = lambda k: f"t{k % 5}"  # noqa: E731
    s = StratifiedSampler(UniformSampler(), stratum, by_need=True, need_decay=0.5)
    g = torch.Generator().manual_seed(0)
    names = [f"t{i}" for i in range(5)]
    assert s.shares(names, 10, g) == [2, 2, 2, 2, 2]  # nothing observed: every need is 1
    # t0..t3 solved (8/8), t4 fails (0/8): needs 0, 0, 0, 0, 1 -> t4 takes all 5 spare keys
    s.update([0, 1, 2, 3, 4], [8.0, 8.0, 8.0, 8.0, 0.0], [8] * 5, 0)
    assert s.shares(names, 10, g) == [1, 1, 1, 1, 6]
    got = Counter(stratum(k) for k in s.select(keys, 10, g))
    assert got == {"t0": 1, "t1": 1, "t2": 1, "t3": 1, "t4": 6}
    # EMA with decay 0.5: t0 then 0/8 -> p̂ = 0.5; t4 then 8/8 -> 0.5; needs 0.5, 0, 0, 0, 0.5 -> 5 spare = 2.5 + 2.5,
    # equal remainders: the tie goes to the lower name
    s.update([0, 4], [0.0, 8.0], [8, 8], 1)
    assert s.success_rate == {"t0": 0.5, "t1": 1.0, "t2": 1.0, "t3": 1.0, "t4": 0.5}
    assert s.shares(names, 10, g) == [4, 1, 1, 1, 3]
    assert s.shares(names, 3, g).count(1) == 3  # fewer keys than strata: the equal rule
    again = StratifiedSampler(UniformSampler(), stratum, by_need=True, need_decay=0.5)
    again.load_state_dict(s.state_dict())
    assert again.success_rate == s.success_rate
    s.update([0, 4], [8.0, 8.0], [8, 8], 2)  # 0.5 * 0.5 + 0.5 * 1 = 0.75 each: needs 0.25, 0, 0, 0, 0.25
    assert s.shares(names, 10, g) == [4, 1, 1, 1, 3]
    last = StratifiedSampler(UniformSampler(), stratum, by_need=True, need_decay=0.0)  # p̂ = this iteration's rate
    last.update([0, 1, 2, 3, 4], [8.0, 8.0, 8.0, 8.0, 8.0], [8] * 5, 0)
    assert last.shares(names, 10, g) == [2, 2, 2, 2, 2]  # all solved: even split


def test_need_floor_zero_gives_solved_strata_nothing_hand_computed():
    """need_floor=0: the whole budget goes by need, so a stratum at p̂ = 1 gets no keys (floor 1 kept one each)."""
    keys = list(range(50))
    stratum = lambda k: f"t{k % 5}"  # noqa: E731
    s = StratifiedSampler(UniformSampler(), stratum, by_need=True, need_decay=0.5, need_floor=0)
    g = torch.Generator().manual_seed(0)
    names = [f"t{i}" for i in range(5)]
    assert s.shares(names, 10, g) == [2, 2, 2, 2, 2]  # nothing observed: every need is 1
    # t0..t2 solved (8/8), t3 at 6/8, t4 at 0/8: needs 0, 0, 0, 0.25, 1 -> 10 x 0.2 = 2, 10 x 0.8 = 8
    s.update([0, 1, 2, 3, 4], [8.0, 8.0, 8.0, 6.0, 0.0], [8] * 5, 0)
    assert s.shares(names, 10, g) == [0, 0, 0, 2, 8]
    got = Counter(stratum(k) for k in s.select(keys, 10, g))
    assert got == {"t3": 2, "t4": 8}
    # t3 now 8/8 -> p̂ 0.5·0.75 + 0.5 = 0.875, need 0.125; t4 4/8 -> 0.25, need 0.75: quotas 10/7 and 60/7
    # = 1.43 and 8.57 -> 1 + 8, the spare key to the larger remainder (t4)
    s.update([3, 4], [8.0, 4.0], [8, 8], 1)
    assert s.shares(names, 10, g) == [0, 0, 0, 1, 9]
    floor1 = StratifiedSampler(UniformSampler(), stratum, by_need=True, need_decay=0.5)
    floor1.load_state_dict(s.state_dict())
    # the default keeps one key each: 5 spare by need 0.125 / 0.75 -> 0.71 / 4.29 -> 1 + 0 and 1 + 4, the last spare to
    # the larger remainder (t3)
    assert floor1.shares(names, 10, g) == [1, 1, 1, 2, 5]


def test_need_weighted_run_logs_its_shares_and_resumes_exactly(tmp_path, monkeypatch):
    """A toy run whose contexts fall in two strata: the need-weighted shares are logged per stratum, sum to
    groups_per_iteration, and a run stopped after 2 iterations and resumed equals the uninterrupted one."""
    import json

    import yaml

    from shared_rl.cli import main
    from shared_rl.toy import ToyDomain

    monkeypatch.setattr(ToyDomain, "key_sampler", lambda self, inner: StratifiedSampler(
        inner, lambda k: f"s{k % 3}", by_need=True, need_decay=0.0))
    cfg = {"domain": "toy", "seed": 1, "iterations": 4, "logging": {"progress": False},
           "checkpoint": {"every": 1, "keep_last": 2}, "rollout": {"groups_per_iteration": 12, "group_size": 4},
           "optim": {"lr": 0.5}, "toy": {"num_contexts": 9, "init_scale": 3.0}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))

    def records(run):
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"}
                for r in rows if "loss/policy" in r]

    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "full")]) == 0
    full = records(tmp_path / "full")
    shares = [tuple(r[f"selection/keys/s{i}"] for i in range(3)) for r in full]
    assert all(sum(x) == 12 for x in shares) and shares[0] == (4, 4, 4) and len(set(shares)) > 1, shares
    # each stratum's logged rollout success is the rate the need weighting used (need_decay 0: only the last one)
    names = [f"s{i}" for i in range(3)]
    for before, after in zip(full, full[1:]):
        rates = {n: before[f"selection/success/{n}"] for n in names}
        assert all(0.0 <= v <= 1.0 for v in rates.values())
        check = StratifiedSampler(UniformSampler(), lambda k: k, by_need=True, need_decay=0.0)
        check.success_rate = rates
        assert tuple(check.shares(names, 12, torch.Generator())) == tuple(after[f"selection/keys/{n}"] for n in names)
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "cut"), "iterations=2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "iterations=4"]) == 0
    assert records(tmp_path / "cut")[-1] == full[-1]


def test_history_sampler_logs_the_keys_it_held_out():
    """``selection/skipped``: the keys the history sampler held out of an iteration's draw, i.e. the count its update
    left after the previous iteration (no key is re-admitted within 100 iterations); a sampler that skips nothing by
    design logs nothing."""
    from shared_rl.config import load_train_config
    from shared_rl.trainer import Trainer

    base = {"domain": "toy", "seed": 0, "iterations": 4, "logging": {"progress": False},
            "rollout": {"groups_per_iteration": 6, "group_size": 4}, "toy": {"num_contexts": 12, "init_scale": 4.0}}
    trainer = Trainer(load_train_config({**base, "selection": {
        "sampler": "history", "history_window": 1, "history_readmit_after": 100}}), None, log=lambda s: None)
    held_out = [0]
    for it in range(4):
        got = trainer.iteration(it)
        assert got["selection/skipped"] == held_out[-1]
        held_out.append(trainer.sampler.num_skipped())
    assert held_out[-1] > 0 and held_out == sorted(held_out), held_out
    plain = Trainer(load_train_config(base), None, log=lambda s: None)
    assert "selection/skipped" not in plain.iteration(0)
