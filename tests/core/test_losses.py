import math

import torch

from shared_rl.losses import Normalizer, aggregate, clipped_surrogate, gaussian_mean_kl, kl_k1, kl_k3


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


def test_micro_batch_split_gives_same_gradient():
    torch.manual_seed(0)
    n, T = 6, 5
    w = torch.randn(T, requires_grad=True)
    feats = torch.randn(n, T)
    logp_old = (feats * w.detach()).detach() + 0.05 * torch.randn(n, T)
    adv = torch.randn(n)
    mask = torch.rand(n, T) > 0.3
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        norm = Normalizer.from_mask(mask)
        w.grad = None
        loss, _ = clipped_surrogate(feats * w, logp_old, adv, mask)
        aggregate(loss, mask, mode, norm).backward()
        full = w.grad.clone()
        w.grad = None
        for idx in (torch.arange(0, 2), torch.arange(2, 5), torch.arange(5, 6)):
            loss, _ = clipped_surrogate(feats[idx] * w, logp_old[idx], adv[idx], mask[idx])
            aggregate(loss, mask[idx], mode, norm).backward()
        assert torch.allclose(w.grad, full, atol=1e-6), mode


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert torch.allclose(kl_k1(logp, ref), torch.tensor([1.0]))
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([math.exp(-1) + 1 - 1]))
    assert kl_k3(ref, ref).item() == 0.0
    mean = torch.tensor([[1.0, 3.0]])
    assert torch.allclose(gaussian_mean_kl(mean, torch.zeros(1, 2), torch.tensor(2.0)), torch.tensor([(1 / 8 + 9 / 8) / 2]))
