"""loss.entropy: the entropy bonus (fixed and adaptive coefficient) and the high-entropy token mask, on the toy
domain (whose per-step entropy carries grad) and by hand."""

import pytest
import torch

from shared_rl.config import ConfigError, EntropyConfig
from shared_rl.domain import StepLogProbs
from shared_rl.losses import EntropyCoefficient, Normalizer, entropy_bonus, high_entropy_mask
from shared_rl.trainer import Trainer

from tests.core.test_trainer import quiet, toy_cfg


def test_high_entropy_mask_hand_computed():
    h = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 0.5, 0.0]])
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)  # trained entropies 1, 2, 3, 4, 5
    # the 0.6 quantile of [1, 2, 3, 4, 5] (linear) is 1 + 0.6 * 4 = 3.4: keeps 4 and 5; masked steps never kept
    assert high_entropy_mask(h, m, 0.4).tolist() == [[False, False, False, False], [True, True, False, False]]
    assert high_entropy_mask(h, m, 0.0).tolist() == [[False] * 4, [False, True, False, False]]  # the highest only
    assert torch.equal(high_entropy_mask(h, m, 1.0), m)


def test_entropy_bonus_is_the_mean_over_the_steps_trained():
    h = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(entropy_bonus(h, m, Normalizer.from_mask(m))) == pytest.approx((1 + 2 + 4) / 3)
    # two micro-batches' shares with the minibatch's normaliser sum to the whole
    norm = Normalizer.from_mask(m)
    assert float(entropy_bonus(h[:1], m[:1], norm) + entropy_bonus(h[1:], m[1:], norm)) == pytest.approx(7 / 3)


def test_adaptive_coefficient_by_hand():
    c = EntropyCoefficient(EntropyConfig(coef=0.01, target=1.0, coef_step=0.005, coef_max=0.02))
    assert c.applied() == 0.0  # nothing measured yet: the entropy counts as infinite, above the target (TRL)
    c.update(0.5)   # at or below the target: up
    assert (c.coef, c.applied()) == (pytest.approx(0.015), pytest.approx(0.015))
    c.update(0.9)
    c.update(1.0)   # capped at coef_max
    assert c.coef == pytest.approx(0.02)
    c.update(2.0)   # above: down, and not applied next step
    assert (c.coef, c.applied()) == (pytest.approx(0.015), 0.0)
    state = c.state()
    other = EntropyCoefficient(c.cfg)
    other.load(state)
    assert (other.coef, other.last_entropy) == (c.coef, 2.0)
    fixed = EntropyCoefficient(EntropyConfig(coef=0.3))
    fixed.update(0.0)
    assert (fixed.coef, fixed.applied(), fixed.adaptive) == (0.3, 0.3, False)


def test_trainer_loss_subtracts_coef_times_mean_entropy():
    tr = Trainer(toy_cfg(**{"loss.entropy": {"coef": 0.5}, "optim.minibatches_per_epoch": 1}), None, log=quiet)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    ent = torch.tensor([[1.2, 0.4], [0.8, 2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = StepLogProbs(logp=logp, entropy=ent)
    adv = torch.tensor([1.0, -1.0])
    parts = tr.loss(out, logp.detach(), adv, mask, Normalizer.from_mask(mask))
    assert float(parts.entropy_bonus.detach()) == pytest.approx((1.2 + 0.4 + 0.8) / 3)
    assert float(parts.total.detach()) == pytest.approx(float(parts.policy.detach()) - 0.5 * (1.2 + 0.4 + 0.8) / 3)
    parts.total.backward()
    assert ent.grad.flatten().tolist() == pytest.approx([-0.5 / 3, -0.5 / 3, -0.5 / 3, 0.0])


def test_top_quantile_trains_only_the_high_entropy_steps():
    tr = Trainer(toy_cfg(**{"loss.entropy": {"top_quantile": 0.5}}), None, log=quiet)
    logp = torch.zeros(2, 2, requires_grad=True)
    ent = torch.tensor([[0.1, 3.0], [2.0, 0.2]])
    mask = torch.ones(2, 2)
    parts = tr.loss(StepLogProbs(logp=logp, entropy=ent), logp.detach(), torch.tensor([1.0, 1.0]), mask,
                    Normalizer.from_mask(mask))
    parts.total.backward()
    assert parts.entropy_bonus is None  # the mask alone adds no bonus
    assert (logp.grad != 0).tolist() == [[False, True], [True, False]]
    assert parts.kept.tolist() == [[False, True], [True, False]]


def test_bonus_keeps_entropy_up_and_micro_batches_do_not_change_it():
    def run(coef, micro=0):
        tr = Trainer(toy_cfg(**{"loss.entropy": {"coef": coef}, "iterations": 6, "optim.micro_batch_size": micro}),
                     None, log=quiet)
        hist = [tr.iteration(it) for it in range(6)]
        return tr.domain.state_dict()["logits"], hist

    (plain, h0), (bonus, h1), (split, _) = run(0.0), run(0.5), run(0.5, micro=1)
    assert h1[-1]["entropy"] > h0[-1]["entropy"] + 0.2
    assert "loss/entropy_bonus" not in h0[-1] and h1[-1]["entropy_coef"] == 0.5
    assert h1[-1]["loss/entropy_bonus"] == pytest.approx(h1[-1]["entropy"], rel=0.2)
    assert torch.allclose(bonus, split, atol=1e-6) and not torch.allclose(bonus, plain, atol=1e-3)


def test_adaptive_coefficient_steps_once_per_optimizer_step_and_resumes_exactly(tmp_path):
    over = {"loss.entropy": {"coef": 0.01, "target": 100.0, "coef_step": 0.005}, "iterations": 4,
            "checkpoint.every": 2, "checkpoint.keep_last": 3}
    full = Trainer(toy_cfg(**over), tmp_path / "full", log=quiet)
    full.fit()
    steps = 4 * full.optim.steps_per_iteration
    assert full.optim.entropy.coef == pytest.approx(0.01 + 0.005 * steps)  # always below target: up every step
    part = Trainer(toy_cfg(**{**over, "iterations": 2}), tmp_path / "part", log=quiet)
    part.fit()
    resumed = Trainer(toy_cfg(**over), tmp_path / "part", log=quiet)
    assert resumed.resume()
    assert resumed.optim.entropy.coef == pytest.approx(0.01 + 0.005 * steps / 2)
    resumed.fit(resume=False)
    assert resumed.optim.entropy.coef == full.optim.entropy.coef
    assert torch.equal(resumed.domain.state_dict()["logits"], full.domain.state_dict()["logits"])


def test_a_domain_whose_entropy_has_no_gradient_is_refused(monkeypatch):
    tr = Trainer(toy_cfg(**{"loss.entropy": {"coef": 0.1}}), None, log=quiet)
    real = tr.domain.log_probs

    def detached(*a, **k):
        out = real(*a, **k)
        out.entropy = out.entropy.detach()
        return out

    monkeypatch.setattr(tr.domain, "log_probs", detached)
    with pytest.raises(ConfigError, match="entropy carries no gradient"):
        tr.iteration(0)
    monkeypatch.setattr(tr.domain, "log_probs", lambda *a, **k: StepLogProbs(logp=real(*a, **k).logp))
    with pytest.raises(ConfigError, match="needs the per-step entropy"):
        tr.iteration(0)


@pytest.mark.parametrize("bad, match", [({"top_quantile": 1.5}, "top_quantile must be in"),
                                        ({"coef_min": 0.5, "coef_max": 0.1}, "coef_min <= coef_max"),
                                        ({"coef": -1.0}, "coef must be >= 0")])
def test_bad_entropy_settings_are_one_line(bad, match):
    with pytest.raises(ConfigError, match=match):
        toy_cfg(**{"loss.entropy": bad})
