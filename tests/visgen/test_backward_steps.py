"""optim.backward_steps on the visgen domain: a forward + backward per trained denoising step (one step's graph
alive at a time, as the official Flow-GRPO trainer) gives the update of the all-steps backward."""
import pytest
import torch

from shared_rl.config import load_train_config
from shared_rl.trainer import Trainer


def _cfg(tiny_dir, backward_steps, **loss):
    return load_train_config({
        "domain": "visgen", "seed": 1, "iterations": 1, "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"weights": {"shapes_strict": 0.0}}, "loss": {"clip_low": 1e-3, **loss},
        "optim": {"lr": 1e-2, "inner_epochs": 2, "backward_steps": backward_steps},
        "logging": {"progress": False}, "eval": {"at_start": False},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "method": {"name": "flow_grpo", "train_fraction": 0.75},
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}},
    })


@pytest.mark.parametrize("loss", [{}, {"kl_coef": 0.05}, {"policy_loss": "guard"}])
def test_backward_per_step_gives_the_same_update(tiny_dir, loss):
    got = {}
    for per in (0, 1):
        tr = Trainer(_cfg(tiny_dir, per, **loss), None, log=lambda *_: None)
        m = tr.iteration(0)
        got[per] = (m, {k: v.clone() for k, v in tr.domain.state_dict().items()})
    (a, wa), (b, wb) = got[0], got[1]
    assert a["nfe/train"] == b["nfe/train"]  # the same forwards, grouped by step
    for k in ("loss/policy", "grad_norm", "ratio/mean", "clip_frac") + (("loss/kl",) if loss.get("kl_coef") else ()):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-8), k  # guard centres: its loss is a near-0 sum
    # the second epoch ran off-policy, so the comparison covers ratios != 1 (GRPO-Guard centres the log-ratio, so
    # its mean ratio is 1 at every epoch: the max tells)
    assert a["ratio/max"] != 1.0
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-7), k
