import math

import pytest
import torch

from shared_rl.config import ConfigError, LossConfig, apply_overrides, from_dict, to_dict
from shared_rl.losses import (KL_ESTIMATORS, POLICY_LOSSES, CispoSettings, GuardSettings, Normalizer, SapoSettings, aggregate, clipped_surrogate,
                              get_policy_loss, kl_k1, kl_k3, kl_per_step)


def test_clipped_surrogate_hand_computed():
    logp_old = torch.zeros(1, 4)
    # ratios e^x: 1.5, 0.5, 1.1, 0.7 ; advantages +1, +1, -1, -1 ; clip 0.2 (high 0.28)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.7]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, st = clipped_surrogate(logp, logp_old, adv, torch.ones(1, 4), 0.2, 0.28)
    # A>0: -min(r, clip(r)) -> r=1.5 -> -1.28 ; r=0.5 -> -0.5 (unclipped smaller)
    # A<0: -min(-r, -clip(r)) = max(r, clip(r)) -> r=1.1 -> 1.1 ; r=0.7 -> 0.8
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.5, 1.1, 0.8]]), atol=1e-6)
    assert st["clipped"].tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.log(torch.tensor([[10.0]]))
    loss, _ = clipped_surrogate(logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), 0.2, dual_clip=3.0)
    assert torch.allclose(loss, torch.tensor([[3.0]]))  # min(10, 3·1)


def test_ratio_is_one_gives_minus_advantage_gradient():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, st = clipped_surrogate(logp, torch.zeros(2, 3), torch.tensor([2.0, -1.0]), torch.ones(2, 3))
    assert torch.all(st["ratio"] == 1)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2.0] * 3, [1.0] * 3]))


def test_gspo_sequence_ratio():
    logp_old = torch.zeros(1, 3)
    logp = torch.tensor([[0.3, -0.1, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, st = clipped_surrogate(logp, logp_old, torch.tensor([1.0]), mask, 0.5, ratio_level="sequence")
    s = math.exp((0.3 - 0.1) / 2)  # length-normalised over the 2 masked steps
    assert torch.allclose(st["ratio"][0, :2], torch.tensor([s, s]))
    assert torch.allclose(loss, torch.tensor([[-s, -s, 0.0]]), atol=1e-6)


def test_aggregations_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    n = Normalizer.from_mask(m, max_steps=4)
    assert torch.isclose(aggregate(x, m, "token-mean", n), torch.tensor(10 / 4))
    assert torch.isclose(aggregate(x, m, "seq-mean-token-mean", n), torch.tensor((2.0 + 4.0) / 2))
    assert torch.isclose(aggregate(x, m, "seq-mean-token-sum-norm", n), torch.tensor((6 / 4 + 4 / 4) / 2))


@pytest.mark.parametrize("name", ["clipped", "gspo", "cispo", "sapo"])
def test_micro_batch_split_gives_same_gradient(name):
    torch.manual_seed(0)
    n, T = 6, 5
    w = torch.randn(T, requires_grad=True)
    feats = torch.randn(n, T)
    # ratios far enough from 1 that every loss clips / gates some steps (and not all)
    logp_old = (feats * w.detach()).detach() + 1.2 * torch.randn(n, T)
    adv = torch.randn(n)
    mask = torch.rand(n, T) > 0.3
    cfg, fn = LossConfig(clip_low=0.2, clip_high=0.28), POLICY_LOSSES[name]
    _, st = fn(feats * w, logp_old, adv, mask, cfg, fn.settings_class())
    assert 0 < float(st["clipped"][mask].mean()) < 1, name
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        norm = Normalizer.from_mask(mask)
        w.grad = None
        loss, _ = fn(feats * w, logp_old, adv, mask, cfg, fn.settings_class())
        aggregate(loss, mask, mode, norm).backward()
        full = w.grad.clone()
        w.grad = None
        for idx in (torch.arange(0, 2), torch.arange(2, 5), torch.arange(5, 6)):
            loss, _ = fn(feats[idx] * w, logp_old[idx], adv[idx], mask[idx], cfg, fn.settings_class())
            aggregate(loss, mask[idx], mode, norm).backward()
        assert torch.allclose(w.grad, full, atol=1e-6), (name, mode)


def test_registry_entries_share_one_signature_and_match_the_surrogate():
    assert {"clipped", "gspo", "cispo", "sapo"} <= set(POLICY_LOSSES)
    torch.manual_seed(1)
    logp, logp_old = torch.randn(3, 4), torch.randn(3, 4)
    adv, mask = torch.randn(3), torch.rand(3, 4) > 0.2
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    for name, level in (("clipped", "step"), ("gspo", "sequence")):
        got, st = POLICY_LOSSES[name](logp, logp_old, adv, mask, cfg, POLICY_LOSSES[name].settings_class())
        want, st_want = clipped_surrogate(logp, logp_old, adv, mask, 0.2, 0.28, 3.0, level)
        assert torch.equal(got, want) and all(torch.equal(st[k], st_want[k]) for k in st_want)
    from shared_rl.domain import StepLogProbs

    # likelihood-free / domain-informed losses also take the domain's terms (objective values, step stds)
    terms = StepLogProbs(logp=logp, objective_pos=torch.rand(3, 4), objective_neg=torch.rand(3, 4),
                         step_std=torch.rand(3, 4) + 0.1, old_kl=torch.rand(3, 4) * 2e-5)  # flow_dppo's mask KL
    for name, fn in POLICY_LOSSES.items():
        loss, st = fn(logp, logp_old, adv, mask, cfg, fn.settings_class(), terms=terms)
        assert loss.shape == (3, 4) and bool((loss[~mask] == 0).all()), name
        assert {"ratio", "clipped", "log_ratio"} <= set(st), name
    with pytest.raises(KeyError, match="did you mean 'sapo'"):
        get_policy_loss("sappo")


def test_cispo_hand_computed():
    # ratios 1.5, 0.9 (A = +1) and 0.5, 1.1 (A = -1); clip [0.8, 1.2]: weights sg(clip(ρ)) = 1.2, 0.9, 0.8, 1.1
    # L = -w·A·logp:  -1.2·ln1.5 = -0.486558,  -0.9·ln0.9 = +0.094824,  +0.8·ln0.5 = -0.554518,  +1.1·ln1.1 = +0.104841
    # dL/dlogp = -w·A (the weight is a constant): -1.2, -0.9, +0.8, +1.1
    logp = torch.log(torch.tensor([[1.5, 0.9], [0.5, 1.1]])).requires_grad_()
    loss, st = POLICY_LOSSES["cispo"](logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                                      LossConfig(clip_low=0.2), CispoSettings())
    assert torch.allclose(loss, torch.tensor([[-0.486558, 0.094824], [-0.554518, 0.104841]]), atol=1e-5)
    assert st["clipped"].tolist() == [[1.0, 0.0], [1.0, 0.0]]
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.2, -0.9], [0.8, 1.1]]), atol=1e-6)
    # TRL's cispo: an absolute cap (its epsilon_high, here 0.2) and no lower cap (clip_low 1): every weight is 0.2
    logp.grad = None
    loss, st = POLICY_LOSSES["cispo"](logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                                      LossConfig(clip_low=1.0), CispoSettings(max_weight=0.2))
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.2, -0.2], [0.2, 0.2]]), atol=1e-6)
    # the sequence ratio: row 0 exp((ln1.5 + ln0.9)/2) = 1.161895 (inside [0.8, 1.2]); row 1 exp((ln0.5 + ln1.1)/2)
    # = 0.741620, clipped to 0.8; each weight on both of its row's steps
    logp.grad = None
    loss, st = POLICY_LOSSES["cispo"](logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                                      LossConfig(clip_low=0.2), CispoSettings(level="sequence"))
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.161895, -1.161895], [0.8, 0.8]]), atol=1e-5)
    assert st["clipped"].tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_sapo_hand_computed():
    # f(ρ) = σ(τ(ρ-1))·4/τ, L = -f(ρ)·A; τ = 1 for A = +1, 1.05 for A = -1; ratios 1, 2 and 1, 4
    # A=+1: ρ=1 -> -σ(0)·4 = -2;            ρ=2 -> -σ(1)·4 = -0.731059·4 = -2.924234
    # A=-1: ρ=1 -> +σ(0)·4/1.05 = 1.904762; ρ=4 -> +σ(3.15)·4/1.05 = 0.958909·3.809524 = 3.652985
    # dL/dlogp = -A·f'(ρ)·ρ with f'(ρ) = 4σ(1-σ): ρ=1 -> -A (the unclipped surrogate's -A·ρ);
    #   ρ=2: -4·0.731059·0.268941·2 = -1.572895;  ρ=4: +4·0.958909·0.041091·4 = +0.630445
    # gate weights 4σ(1-σ): 1, 0.786448, 1, 0.157611 -> only the last is below 1/2 ("clipped")
    logp = torch.log(torch.tensor([[1.0, 2.0], [1.0, 4.0]])).requires_grad_()
    loss, st = POLICY_LOSSES["sapo"](logp, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                                     LossConfig(), SapoSettings(tau_pos=1.0, tau_neg=1.05))
    assert torch.allclose(loss, torch.tensor([[-2.0, -2.924234], [1.904762, 3.652985]]), atol=1e-5)
    assert st["clipped"].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.572895], [1.0, 0.630445]]), atol=1e-5)


def test_every_loss_has_the_unclipped_gradient_at_ratio_one():
    logp = torch.zeros(2, 3, requires_grad=True)
    for name in ("clipped", "gspo", "cispo", "sapo"):
        logp.grad = None
        loss, st = POLICY_LOSSES[name](logp, torch.zeros(2, 3), torch.tensor([2.0, -1.0]), torch.ones(2, 3),
                                       LossConfig(), POLICY_LOSSES[name].settings_class())
        assert torch.all(st["ratio"] == 1) and not st["clipped"].any(), name
        loss.sum().backward()
        want = torch.tensor([[-2.0] * 3, [1.0] * 3])  # gspo: 3 steps x (1/3 of the mean's gradient each)
        assert torch.allclose(logp.grad, want), name


def test_loss_config_checks_the_registry_names():
    with pytest.raises(ConfigError, match="policy_loss 'cipso' is unknown \\(did you mean 'cispo'\\?\\)"):
        from_dict(LossConfig, {"policy_loss": "cipso"}, "loss")
    with pytest.raises(ConfigError, match="kl_estimator 'k4' is unknown"):
        LossConfig(kl_estimator="k4").check("loss")


def test_each_loss_owns_its_settings():
    cfg = from_dict(LossConfig, {"policy_loss": {"name": "sapo", "tau_neg": 2.0}}, "loss")
    assert cfg.policy_loss.name == "sapo" and cfg.policy_loss.settings == SapoSettings(tau_pos=1.0, tau_neg=2.0)
    assert to_dict(cfg)["policy_loss"] == {"name": "sapo", "tau_pos": 1.0, "tau_neg": 2.0}  # round-trips
    assert from_dict(LossConfig, to_dict(cfg), "loss").policy_loss == cfg.policy_loss
    assert to_dict(from_dict(LossConfig, {"policy_loss": "clipped"}))["policy_loss"] == "clipped"  # no settings: the name
    with pytest.raises(ConfigError, match="loss.policy_loss.tau_neg must be > 0"):
        from_dict(LossConfig, {"policy_loss": {"name": "sapo", "tau_neg": 0.0}}, "loss")
    with pytest.raises(ConfigError, match="unknown config key 'loss.policy_loss.tau_pos'"):
        from_dict(LossConfig, {"policy_loss": {"name": "clipped", "tau_pos": 1.0}}, "loss")  # clipped has none
    with pytest.raises(ConfigError, match="config key 'loss.sapo_tau_neg' was replaced: policy_loss: {name: sapo"):
        from_dict(LossConfig, {"sapo_tau_neg": 1.0}, "loss")
    # a setting of a loss given by name can be overridden on the command line
    over = apply_overrides({"loss": {"policy_loss": "sapo"}}, ["loss.policy_loss.tau_pos=3"])
    assert from_dict(LossConfig, over["loss"], "loss").policy_loss.settings.tau_pos == 3.0


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert torch.allclose(kl_k1(logp, ref), torch.tensor([1.0]))
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([math.exp(-1) + 1 - 1]))
    assert kl_k3(ref, ref).item() == 0.0
    assert set(KL_ESTIMATORS) == {"k1", "k3", "domain"}
    own = torch.tensor([0.25])
    assert kl_per_step("k1", logp, ref, None) is not None and kl_per_step("k1", logp, ref, None).item() == 1.0
    assert kl_per_step("domain", logp, ref, None).item() == kl_k3(logp, ref).item()  # no own KL: k3
    for name in ("domain", "k1", "k3"):  # a domain's own (exact) KL is used whatever the estimator
        assert kl_per_step(name, logp, None, own) is own
    with pytest.raises(ConfigError, match="neither its own kl nor ref_logp"):
        kl_per_step("k3", logp, None, None)
    # the domain-side Flow-GRPO KL (one copy, shared_rl.flow_kernels): ||mu - mu_ref||^2 / (2 std^2), mean over elements
    from shared_rl.flow_kernels import sde_mean_kl

    mean = torch.tensor([[1.0, 3.0]])
    assert torch.allclose(sde_mean_kl(mean, torch.zeros(1, 2), torch.tensor([2.0])), torch.tensor([(1 / 8 + 9 / 8) / 2]))


def test_gspo_clamps_the_sequence_log_ratio_as_verl():
    # one token, log-ratio 12, A = -1: verl's loss is e^10 = 22026.47 with no gradient (unclamped: e^12 = 162754.8)
    logp = torch.tensor([[12.0]], requires_grad=True)
    loss, st = POLICY_LOSSES["gspo"](logp, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), LossConfig(),
                                     POLICY_LOSSES["gspo"].settings_class())
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-6)
    loss.sum().backward()
    assert logp.grad.item() == 0.0
    # below the bound nothing changes
    small, _ = POLICY_LOSSES["gspo"](torch.tensor([[0.5]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                                     LossConfig(clip_low=10.0), POLICY_LOSSES["gspo"].settings_class())
    assert small.item() == pytest.approx(math.exp(0.5))


def _guard_step_grads(settings):
    """GRPO-Guard on 2 rows x 2 steps with sigma = (0.5, 0.05), mean shift 1e-3, A = +1 / -1: each step's gradient.
    logp_t(theta) = mean_d[-(sigma_t*eps - theta)^2 / (2 sigma_t^2)] + const, the mean-reduced Gaussian step log-prob
    with the new mean shifted by theta; the rows' noise is the same at both steps."""
    from shared_rl.domain import StepLogProbs
    from shared_rl.losses import guard_loss

    eps = torch.tensor([[1.0, -0.5, 0.3, 0.8], [-0.7, 0.2, 1.1, -0.4]])  # row means 0.4, 0.05
    sigma = torch.tensor([0.5, 0.05])
    theta = torch.tensor(1e-3, requires_grad=True)

    def logp(th):
        return torch.stack([(-(s * eps - th) ** 2 / (2 * s * s)).mean(1) for s in sigma], 1)  # [2 rows, 2 steps]

    old = logp(torch.tensor(0.0)).detach()
    terms = StepLogProbs(logp=old, step_std=sigma.expand(2, 2).clone())
    grads = []
    for j in range(2):
        theta.grad = None
        loss, _ = guard_loss(logp(theta), old, torch.tensor([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool),
                             LossConfig(clip_low=0.2), settings, terms=terms)
        loss[:, j].sum().backward()
        grads.append(abs(theta.grad.item()))
    return grads


def test_grpo_guard_equalises_the_step_gradients_as_the_reference():
    # sigma-scaled log-ratio: d/dtheta = mean(eps) - theta/sigma per row; rows (+1, -1):
    #   step 0: -(0.4 - 0.002) + (0.05 - 0.002) = -0.350;  step 1: -(0.4 - 0.02) + (0.05 - 0.02) = -0.350
    g = _guard_step_grads(GuardSettings())
    assert g[0] == pytest.approx(0.350, abs=2e-3) and g[1] == pytest.approx(0.350, abs=2e-3)
    assert 0.8 <= g[0] / g[1] <= 1.25
    # step_weight: flow_grpo restores Flow-GRPO's 1/sigma gradients: the low-noise step pulls ~10x harder
    g = _guard_step_grads(GuardSettings(step_weight="flow_grpo"))
    assert g[1] / g[0] == pytest.approx(10.0, rel=0.01)
    with pytest.raises(ConfigError, match="step_weight must be balanced or flow_grpo"):
        from_dict(LossConfig, {"policy_loss": {"name": "guard", "step_weight": "equal"}}, "loss")


def test_off_policy_sequence_mask_hand_computed():
    """DeepSeek-V3.2 eq. 9: drop a sequence only when its advantage is negative AND its mean KL(behaviour || policy)
    over its trained steps exceeds the threshold."""
    from shared_rl.losses import off_policy_sequence_mask

    behaviour = torch.zeros(4, 3)
    logp = torch.tensor([[-1.5, -1.5, -9.0],   # mean KL over the 2 trained steps 1.5 (the masked -9 is not read)
                         [-0.3, -0.3, -0.3],   # 0.3
                         [-1.5, -1.5, -1.5],   # 1.5
                         [-1.0, -1.0, -1.0]])  # 1.0: at the threshold, kept
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0, -1.0, -0.5])
    keep = off_policy_sequence_mask(adv, logp, behaviour, mask, 1.0)
    assert keep.flatten().tolist() == [1.0, 1.0, 0.0, 1.0]
    assert keep.shape == (4, 1)


def test_trainer_drops_far_off_policy_negative_sequences():
    from shared_rl.domain import StepLogProbs
    from shared_rl.trainer import Trainer
    from tests.core.test_trainer import quiet, toy_cfg

    tr = Trainer(toy_cfg(**{"loss.off_policy_mask": 0.5}), None, log=quiet)
    logp = torch.zeros(3, 2, requires_grad=True)
    old = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])  # rows 1, 2: mean KL 1.0 > 0.5
    mask = torch.ones(3, 2)
    parts = tr.loss(StepLogProbs(logp=logp), old, torch.tensor([-1.0, -1.0, 1.0]), mask, Normalizer.from_mask(mask))
    parts.total.backward()
    assert (logp.grad.abs().sum(1) > 0).tolist() == [True, False, True]  # only row 1 (negative and far) dropped
    assert parts.stats["off_policy_dropped"][:, 0].tolist() == [0.0, 1.0, 0.0]
