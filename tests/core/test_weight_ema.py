"""optim.ema_decay: evaluation and export use an EMA of the trained weights; rollouts and updates the live ones."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from shared_rl.cli import main
from shared_rl.config import ConfigError, load_train_config
from shared_rl.toy import ToyDomain
from shared_rl.trainer import WeightEMA


def test_weight_average_hand_computed_and_swap_restores_the_live_weights():
    w = torch.nn.Parameter(torch.tensor([0.0]))
    ema = WeightEMA([w], decay=0.5)
    expected = []
    for value, d in ((1.0, 0.1), (3.0, 2 / 11), (5.0, 0.25)):  # d_t = min(0.5, (1 + t) / (10 + t))
        with torch.no_grad():
            w.fill_(value)
        ema.update()
        expected.append(d * (expected[-1] if expected else 0.0) + (1 - d) * value)
    assert expected == pytest.approx([0.9, 2.6181818, 4.4045454])
    assert float(ema.shadow[0]) == pytest.approx(expected[-1])
    with ema.swapped():
        assert float(w.detach()) == pytest.approx(expected[-1])
    assert float(w.detach()) == 5.0  # the live weight, bitwise
    for _ in range(20):
        ema.update()  # from step 10 on the decay is the configured 0.5
    assert float(ema.shadow[0]) == pytest.approx(5.0, abs=1e-5)


CFG = {"domain": "toy", "seed": 2, "iterations": 4, "logging": {"progress": False},
       "checkpoint": {"every": 1, "keep_last": 2}, "eval": {"every": 1},
       "rollout": {"groups_per_iteration": 4, "group_size": 4}, "optim": {"lr": 0.3},
       "toy": {"num_contexts": 6, "init_scale": 2.0}}


def _records(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "resume/")) and k != "samples_per_s"} for r in rows]


def test_evaluation_and_export_use_the_average_and_resume_is_exact(tmp_path, monkeypatch):
    saved = {}
    monkeypatch.setattr(ToyDomain, "save_pretrained",
                        lambda self, out: saved.__setitem__(str(out.parent / "final"), self.logits.detach().clone()), raising=False)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CFG))
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "live")]) == 0
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "ema"), "optim.ema_decay=0.8"]) == 0
    live, ema = _records(tmp_path / "live"), _records(tmp_path / "ema")
    train = lambda recs: [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in recs]  # noqa: E731
    assert train(live) == train(ema)  # the same rollouts and updates: the average never touches the live weights
    evals = lambda recs: [r["eval/expected_reward"] for r in recs if "eval/expected_reward" in r]  # noqa: E731
    assert evals(live)[0] == evals(ema)[0] and evals(live)[1:] != evals(ema)[1:]
    # the checkpoint keeps both; the exported policy is the average, and so is what evaluation saw at the end
    ckpt = load_file(str(tmp_path / "ema" / "checkpoints" / "step_000004" / "model.safetensors"))
    final = saved[str(tmp_path / "ema" / "final")]
    assert torch.equal(final, ckpt["_ema/0"]) and not torch.equal(final, ckpt["logits"])
    assert torch.equal(saved[str(tmp_path / "live" / "final")],
                       load_file(str(tmp_path / "live" / "checkpoints" / "step_000004" / "model.safetensors"))["logits"])
    # stopped after 2 iterations and resumed: the same records, evaluations included
    assert main(["train", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "cut"), "optim.ema_decay=0.8",
                 "iterations=2"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "iterations=4"]) == 0
    assert _records(tmp_path / "cut")[-1] == ema[-1]
    assert torch.equal(saved[str(tmp_path / "cut" / "final")], final)


def test_ema_decay_is_validated():
    with pytest.raises(ConfigError, match="ema_decay must be in"):
        load_train_config({"domain": "toy", "optim": {"ema_decay": 1.0}})
