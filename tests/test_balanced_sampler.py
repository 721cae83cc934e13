"""selection.balance: every stratum (robotics: task) gets the same number of keys per iteration."""
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


def test_balance_needs_the_domain_hook():
    from shared_rl.config import ConfigError, load_train_config
    from shared_rl.trainer import Trainer

    cfg = load_train_config({"domain": "toy", "iterations": 1, "selection": {"balance": True},
                             "logging": {"progress": False}})
    with pytest.raises(ConfigError, match="key_stratum"):
        Trainer(cfg, None, log=lambda s: None)
