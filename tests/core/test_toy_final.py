"""The toy run writes final/ like every run: its trained logit table (safetensors) and config."""
import torch

from shared_rl.api import train
from shared_rl.toy import ToyDomain


def test_the_toy_run_exports_its_trained_logits_to_final(tmp_path):
    trainer = train("configs/toy.yaml", overrides={"iterations": 2, "logging": {"progress": False}},
                    run_dir=tmp_path / "run", log=lambda *_: None)
    logits, config = ToyDomain.load_pretrained(tmp_path / "run" / "final")
    assert torch.equal(logits, trainer.domain.logits.detach())
    assert logits.shape == (8, 4) and logits.abs().sum() > 0  # trained away from the uniform start
    assert config["domain"] == "toy" and config["num_actions"] == 4 and config["targets"] == [0, 1, 2, 3] * 2
