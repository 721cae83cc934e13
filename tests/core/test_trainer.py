import json

import pytest
import torch

from shared_rl.checkpoint import list_checkpoints
from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import NonFiniteError, Trainer


def toy_cfg(**over):
    data = {
        "domain": "toy", "seed": 3, "iterations": 12,
        "rollout": {"groups_per_iteration": 4, "group_size": 6},
        "loss": {"clip_low": 0.2},
        "optim": {"lr": 0.2, "minibatches_per_epoch": 2, "inner_epochs": 2},
        "logging": {"progress": False},
        "toy": {"num_contexts": 6, "num_actions": 4, "horizon": 3},
    }
    for k, v in over.items():
        sec, _, key = k.partition(".")
        if key:
            data.setdefault(sec, {})[key] = v
        else:
            data[sec] = v
    return load_train_config(data)


def quiet(*_):
    pass


def test_toy_policy_learns():
    tr = Trainer(toy_cfg(iterations=25), None, log=quiet)
    hist = tr.fit()
    assert hist[0]["eval/expected_reward"] == pytest.approx(0.25)
    assert hist[-1]["eval/expected_reward"] > 0.7
    assert hist[-1]["reward/mean"] > hist[1]["reward/mean"] + 0.3


def test_first_inner_step_ratio_is_one():
    tr = Trainer(toy_cfg(**{"optim.minibatches_per_epoch": 1, "optim.inner_epochs": 1}), None, log=quiet)
    m = tr.iteration(0)
    assert m["ratio/mean"] == pytest.approx(1.0, abs=1e-7) and m["ratio/max"] == pytest.approx(1.0, abs=1e-7)
    assert m["clip_frac"] == 0.0


def test_micro_batching_does_not_change_the_update():
    states = []
    for micro in (0, 5, 1):
        tr = Trainer(toy_cfg(**{"optim.micro_batch_size": micro, "iterations": 3}), None, log=quiet)
        for it in range(3):
            tr.iteration(it)
        states.append(tr.domain.state_dict()["logits"])
    assert torch.allclose(states[0], states[1], atol=1e-6) and torch.allclose(states[0], states[2], atol=1e-6)


def test_resume_equals_uninterrupted_bitwise(tmp_path):
    cfg = toy_cfg(**{"checkpoint.every": 4, "checkpoint.keep_last": 5, "selection.sampler": "vade"})
    full = Trainer(cfg, tmp_path / "full", log=quiet)
    full.fit()
    part = Trainer(cfg, tmp_path / "part", log=quiet)
    real_iteration = part.iteration

    def dies_at_10(it):  # as if killed during iteration 10, after the checkpoint at 8 and the record of 9
        if it == 9:
            raise KeyboardInterrupt
        return real_iteration(it)

    part.iteration = dies_at_10
    with pytest.raises(KeyboardInterrupt):
        part.fit()
    resumed = Trainer(toy_cfg(**{"checkpoint.every": 4, "checkpoint.keep_last": 5, "selection.sampler": "vade"}),
                      tmp_path / "part", log=quiet)
    resumed.fit(resume=True)
    assert resumed.start_iteration == 8
    assert torch.equal(full.domain.state_dict()["logits"], resumed.domain.state_dict()["logits"])
    a = [json.loads(l) for l in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "samples_per_s"}
    assert [drop(r) for r in a] == [drop(r) for r in b]


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path):
    cfg = toy_cfg(**{"checkpoint.every": 4, "checkpoint.keep_last": 3, "iterations": 8})
    Trainer(cfg, tmp_path, log=quiet).fit()
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["step_000004", "step_000008"]
    with open(ckpts[-1] / "model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\x00")
    logs = []
    tr = Trainer(cfg, tmp_path, log=logs.append)
    with pytest.warns(UserWarning, match="checksum"):
        assert tr.resume()
    assert tr.start_iteration == 4 and any("unusable" in l for l in logs)


def test_tree_rollouts_train_with_tree_estimator():
    cfg = toy_cfg(**{"toy.tree_branch": 2, "toy.tree_depth": 3, "advantage.estimator": "depth_zscore",
                     "iterations": 20})
    tr = Trainer(cfg, None, log=quiet)
    m = tr.iteration(0)
    assert m["nfe/rollout"] == 4 * (2 + 4 + 8)  # unique nodes: each prefix computed once
    hist = tr.fit()
    assert hist[-1]["eval/expected_reward"] > 0.6


def test_dynamic_sampling_refills_groups():
    cfg = toy_cfg(**{"selection.filter": "zero_std", "selection.max_refill_rounds": 3,
                     "toy.horizon": 1, "rollout": {"groups_per_iteration": 4, "group_size": 2}})
    tr = Trainer(cfg, None, log=quiet)
    m = tr.iteration(0)
    assert m["groups/drawn"] > 4 and m["groups/kept"] <= 4


def test_nonfinite_gradients_skip_then_stop(monkeypatch):
    tr = Trainer(toy_cfg(**{"max_nonfinite_steps": 2}), None, log=quiet)
    real = tr.domain.log_probs

    def poisoned(rollout, idx, need_kl):
        out = real(rollout, idx, need_kl)
        out.logp = out.logp * float("nan")
        return out

    monkeypatch.setattr(tr.domain, "log_probs", poisoned)
    before = tr.domain.state_dict()["logits"].clone()
    with pytest.raises(NonFiniteError, match="max_nonfinite_steps"):
        tr.iteration(0)
    assert torch.equal(before, tr.domain.state_dict()["logits"])  # skipped steps change nothing


def test_kl_term_is_logged_and_pulls_toward_reference():
    cfg = toy_cfg(**{"loss.kl_coef": 1.0, "loss.kl_estimator": "k3", "optim.minibatches_per_epoch": 1, "optim.inner_epochs": 1})
    m = Trainer(cfg, None, log=quiet).iteration(0)
    assert "loss/kl" in m and m["loss/kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at start


@pytest.mark.parametrize("minibatches", [1, 3])
def test_deferred_behaviour_logp_equals_recomputed(minibatches):
    results = []
    for deferred in (False, True):
        cfg = toy_cfg(**{"toy.deferred_logp": deferred, "optim.minibatches_per_epoch": minibatches,
                         "optim.inner_epochs": 2, "iterations": 3})
        tr = Trainer(cfg, None, log=quiet)
        ms = [tr.iteration(it) for it in range(3)]
        results.append((tr.domain.state_dict()["logits"], ms))
    (a, ma), (b, mb) = results
    assert torch.allclose(a, b, atol=1e-6)
    for x, y in zip(ma, mb):
        assert x["ratio/mean"] == pytest.approx(y["ratio/mean"], abs=1e-6)
        assert x["clip_frac"] == pytest.approx(y["clip_frac"], abs=1e-9)


def test_a_registered_policy_loss_is_picked_by_name_from_the_config():
    from shared_rl.losses import POLICY_LOSSES, clipped_loss, register_policy_loss

    calls = []

    @register_policy_loss("test_halved_clipped")
    def halved(logp, logp_old, advantages, mask, cfg, settings, terms=None):
        """Half the clipped surrogate: L = ½·L_clipped (same stats)."""
        calls.append(tuple(logp.shape))
        loss, stats = clipped_loss(logp, logp_old, advantages, mask, cfg, settings)
        return 0.5 * loss, stats

    try:
        over = {"optim.minibatches_per_epoch": 1, "optim.inner_epochs": 1, "optim.grad_clip": None}
        base = Trainer(toy_cfg(**over), None, log=quiet).iteration(0)
        m = Trainer(toy_cfg(**over, **{"loss.policy_loss": "test_halved_clipped"}), None, log=quiet).iteration(0)
        assert calls and m["loss/policy"] == pytest.approx(0.5 * base["loss/policy"], rel=1e-6)
        assert m["grad_norm"] == pytest.approx(0.5 * base["grad_norm"], rel=1e-6)
    finally:
        POLICY_LOSSES.pop("test_halved_clipped", None)
    with pytest.raises(ConfigError, match="did you mean 'test_halved_clipped'|is unknown"):
        toy_cfg(**{"loss.policy_loss": "test_halved_clipped"})


@pytest.mark.parametrize("name", ["gspo", "cispo", "sapo"])
def test_every_registered_loss_trains_the_toy(name):
    tr = Trainer(toy_cfg(**{"iterations": 25, "loss.policy_loss": name}), None, log=quiet)
    hist = tr.fit()
    assert hist[-1]["eval/expected_reward"] > 0.6, name


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_backward_by_step_gives_the_same_update(aggregation):
    """optim.backward_steps: 1 runs one forward + backward per trained step column (one step's graph alive at a
    time); the summed chunks are the whole micro-batch's loss, so the update is the same."""
    over = {"optim.minibatches_per_epoch": 2, "optim.inner_epochs": 2, "loss.aggregation": aggregation,
            "loss.kl_coef": 0.1, "loss.kl_estimator": "k3", "toy.init_scale": 1.0}
    runs = {}
    for per in (0, 1, 3):
        tr = Trainer(toy_cfg(**over, **{"optim.backward_steps": per}), None, log=quiet)
        runs[per] = ([tr.iteration(it) for it in range(3)], tr.domain.logits.detach().clone())
    for per in (1, 3):
        for a, b in zip(runs[0][0], runs[per][0]):
            for k in ("loss/policy", "loss/kl", "grad_norm", "clip_frac", "ratio/mean", "entropy"):
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-8), (per, k)
        assert torch.allclose(runs[per][1], runs[0][1], atol=1e-6), per


def test_backward_by_step_is_refused_where_it_cannot_hold():
    with pytest.raises(ConfigError, match="optim.backward_steps=1: loss.policy_loss 'gspo' needs all"):
        Trainer(toy_cfg(**{"optim.backward_steps": 1, "loss.policy_loss": "gspo"}), None, log=quiet)
    with pytest.raises(ConfigError, match="loss.policy_loss 'cispo' needs all"):  # its sequence ratio
        Trainer(toy_cfg(**{"optim.backward_steps": 1, "loss.policy_loss": {"name": "cispo", "level": "sequence"}}),
                None, log=quiet)
    Trainer(toy_cfg(**{"optim.backward_steps": 1, "loss.policy_loss": "cispo"}), None, log=quiet)  # per step: fine
    with pytest.raises(ConfigError, match="top_quantile ranks"):
        Trainer(toy_cfg(**{"optim.backward_steps": 1, "loss.entropy": {"top_quantile": 0.5}}), None, log=quiet)
    with pytest.raises(ConfigError, match="off_policy_mask reads"):
        Trainer(toy_cfg(**{"optim.backward_steps": 1, "loss.off_policy_mask": 0.5}), None, log=quiet)


def test_gradient_noise_stats_hand_computed():
    from shared_rl.trainer import gradient_noise_stats

    # halves of 2 and 1 sequences of a 3-sequence mean loss: their contributions g1 = (1, 0), g2 = (0.5, 0.5), so the
    # halves' mean gradients are G1 = 3/2 g1 = (1.5, 0), G2 = 3 g2 = (1.5, 1.5)
    st = gradient_noise_stats(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), 2, 1)
    dot = 1.5 * 1.5  # G1 . G2
    assert st["grad/signal_sq"] == pytest.approx(dot)
    assert st["grad/noise_trace"] == pytest.approx((2 * (2.25 - dot) + 1 * (4.5 - dot)) / 2)
    assert st["grad/half_cosine"] == pytest.approx(dot / (1.5 * (4.5 ** 0.5)))
    assert gradient_noise_stats(torch.ones(2), torch.ones(2), 3, 0) == {}


def test_gradient_noise_scale_leaves_the_update_alone_and_is_logged():
    states, metrics = [], []
    for on in (False, True):
        tr = Trainer(toy_cfg(**{"logging.grad_noise_scale": on, "iterations": 3}), None, log=quiet)
        metrics.append([tr.iteration(it) for it in range(3)])
        states.append(tr.domain.state_dict()["logits"])
    assert torch.allclose(states[0], states[1], atol=1e-6)
    assert "grad/noise_scale" not in metrics[0][0]
    logged = [m for m in metrics[1] if "grad/signal_sq" in m]
    assert len(logged) == 3 and all(-1 <= m["grad/half_cosine"] <= 1 for m in logged)
    for m in logged:
        if m["grad/signal_sq"] > 0:
            assert m["grad/noise_scale"] == pytest.approx(m["grad/noise_trace"] / m["grad/signal_sq"])
    with pytest.raises(ConfigError, match="grad_noise_scale"):
        toy_cfg(**{"logging.grad_noise_scale": True, "distributed.strategy": "fsdp2"})


def test_gradient_noise_scale_snapshots_the_first_half(monkeypatch):
    """The first half's gradient is the gradient after exactly the first ceil(n/2) sequences' backward passes."""
    import shared_rl.trainer as trainer_mod

    tr = Trainer(toy_cfg(**{"logging.grad_noise_scale": True, "optim.micro_batch_size": 1,
                            "optim.inner_epochs": 1, "optim.minibatches_per_epoch": 1}), None, log=quiet)
    seen, calls = [], []
    real_stats, real_log_probs = trainer_mod.gradient_noise_stats, tr.domain.log_probs
    monkeypatch.setattr(trainer_mod, "gradient_noise_stats", lambda *a: seen.append(a) or real_stats(*a))
    monkeypatch.setattr(tr.domain, "log_probs", lambda *a, **k: calls.append(tr._flat_grads()) or real_log_probs(*a, **k))
    tr.iteration(0)
    (first, second, n1, n2), = seen
    assert n1 + n2 == len(calls) and n1 == (len(calls) + 1) // 2
    assert torch.allclose(first, calls[int(n1)]) and not torch.allclose(first, torch.zeros_like(first))
