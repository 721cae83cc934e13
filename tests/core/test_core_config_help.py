"""Every setting of the trainer's rollout / advantage / loss sections and of TrainConfig itself carries a one-line
help text (``field(metadata={"help": ...})``, TRL GRPOConfig style), which ``grove config show`` prints."""
import dataclasses

import pytest

from shared_rl.config import AdvantageConfig, LossConfig, RolloutConfig, TrainConfig


@pytest.mark.parametrize("cls", [RolloutConfig, AdvantageConfig, LossConfig, TrainConfig])
def test_every_field_has_one_line_of_help(cls):
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help", "")
        assert text and "\n" not in text, f"{cls.__name__}.{f.name} has no one-line help"
