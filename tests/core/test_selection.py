import torch

from shared_rl.selection import HistorySkipSampler, UniformSampler, VADESampler, group_keep_mask, group_success


def test_zero_std_and_band_filters():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 3])
    assert group_keep_mask(r, g, 4, "zero_std").tolist() == [False, True, False, True]
    assert group_keep_mask(r, g, 4, "band", (0.1, 0.6)).tolist() == [False, True, False, False]
    assert group_keep_mask(r, g, 4, "none").tolist() == [True] * 4
    succ, cnt = group_success(r, g, 4)
    assert succ == [2.0, 1.0, 0.0, 3.0] and cnt == [2, 2, 2, 4]


def test_uniform_sampler_is_deterministic_and_covers_more_than_pool():
    s = UniformSampler()
    a = s.select(range(5), 7, torch.Generator().manual_seed(1))
    b = s.select(range(5), 7, torch.Generator().manual_seed(1))
    assert a == b and len(a) == 7 and set(a) == set(range(5))


def test_vade_prefers_uncertain_keys_and_decays():
    s = VADESampler(prior=(1, 1), decay_fast=0.5, decay_slow=0.9, fast_weight=0.5)
    # key 0 always solved, key 1 never, key 2 half
    for it in range(10):
        s.update([0, 1, 2], [8.0, 0.0, 4.0], [8, 8, 8], it)
    a, b = s.posterior(2)
    assert abs(a / (a + b) - 0.5) < 1e-9
    picks = [s.select([0, 1, 2], 1, torch.Generator().manual_seed(i))[0] for i in range(50)]
    assert picks.count(2) > 40  # p(1-p) is largest for the 50% key
    state = s.state_dict()
    s2 = VADESampler(prior=(1, 1), decay_fast=0.5, decay_slow=0.9, fast_weight=0.5)
    s2.load_state_dict(state)
    assert s2.posterior(0) == s.posterior(0)
    # decay toward the prior: with no new evidence for key 0 its pseudo-counts shrink
    before = sum(s.posterior(0))
    s.update([], [], [], 11)
    assert sum(s.posterior(0)) < before


def test_history_skip_and_readmit():
    s = HistorySkipSampler(window=2, readmit_after=3)
    s.update([0, 1], [4.0, 2.0], [4, 4], 0)
    s.update([0, 1], [4.0, 1.0], [4, 4], 1)
    assert s.num_skipped() == 1
    assert 0 not in s.select([0, 1], 4, torch.Generator().manual_seed(0))
    s.update([1], [2.0], [4], 4)  # iteration advances past readmit_after
    assert 0 in s.select([0, 1], 4, torch.Generator().manual_seed(0))
