"""``shared_rl/reference.py`` (one screen, no layers) and ``Trainer`` compute the same run: same metrics, same weights.
So the reference is an honest description of what the trainer's layers do for a flat GRPO run in one process."""
import pytest
import torch

from shared_rl.config import load_train_config, load_yaml
from shared_rl.reference import train
from shared_rl.trainer import Trainer

KEYS = ("reward/mean", "loss/policy", "grad_norm", "clip_frac")


@pytest.mark.parametrize("over", [{}, {"optim.inner_epochs": 2, "optim.minibatches_per_epoch": 4,
                                       "loss.clip_high": "null", "optim.lr": 0.3}])
def test_reference_iteration_equals_the_trainer(tmp_path, over):
    from shared_rl.config import apply_overrides

    data = apply_overrides(load_yaml("configs/toy.yaml"), ["iterations=6", "logging.progress=false",
                                                           *[f"{k}={v}" for k, v in over.items()]])
    ref_domain, ref = train(load_train_config(data), log=lambda *_: None)
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    got = [tr.iteration(it) for it in range(6)]
    for it, (a, b) in enumerate(zip(ref, got)):
        for k in KEYS:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (it, k, a[k], b[k])
    assert torch.equal(ref_domain.logits.detach(), tr.domain.logits.detach())  # the same weights, bit for bit
    if over:  # several epochs at a high rate: the clip acts, so the comparison covers the clipped branch too
        assert any(r["clip_frac"] > 0 for r in ref)
