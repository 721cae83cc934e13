"""Offline Diffusion-DPO from stored pairs (``visgen.objective: {name: dpo, pairs: FILE}``, ``visgen.offline_dpo``): a
tiny pair file written in tmp_path feeds the online method's ``dpo`` objective and loss — each group one stored pair,
chosen and rejected sharing each slot's noise and timestep, the preference ranking them; the first step's loss is
log 2 (policy = reference); the pair-file formats and their one-line errors; the recipes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config, load_yaml
from shared_rl.trainer import Trainer
from visgen.offline_dpo import PREFERENCE, read_pairs, write_shapes_pairs

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
QUIET = {"logging": {"progress": False}, "eval": {"at_start": False, "every": 0}, "checkpoint": {"every": 0}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory) -> Path:
    return write_shapes_pairs(tmp_path_factory.mktemp("pairs"), count=3)


def _cfg(tiny_dir, pairs, group_size=2, **objective):
    return load_train_config({
        "domain": "visgen", "seed": 1, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": group_size},
        "advantage": {"estimator": "grpo"}, "loss": {"kl_coef": 0.0},
        "optim": {"lr": 1e-2, "minibatches_per_epoch": 1}, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "objective": {"name": "dpo", "pairs": str(pairs), "beta": 2.0, "timesteps_per_sample": 2,
                                 **objective},
                   "rewards": [{"name": "shapes_soft"}], "eval": TINY_EVAL, "num_threads": 1},
    })


def test_pair_files_read_and_refuse_in_one_line(tmp_path, pair_file):
    pairs = read_pairs(pair_file)
    assert len(pairs) == 3 and all(Path(p.chosen).is_file() and Path(p.rejected).is_file() for p in pairs)
    # Pick-a-Pic's columns: label_0 1 -> image 0 chosen, 0 -> image 1, 0.5 a tie (dropped)
    rows = [{"caption": "a red square", "jpg_0": "0000_chosen.png", "jpg_1": "0000_rejected.png", "label_0": 1.0},
            {"caption": "a red square", "jpg_0": "0000_chosen.png", "jpg_1": "0000_rejected.png", "label_0": 0.0},
            {"caption": "a tie", "jpg_0": "0000_chosen.png", "jpg_1": "0000_rejected.png", "label_0": 0.5}]
    pick = pair_file.parent / "pick.jsonl"
    pick.write_text("\n".join(json.dumps(r) for r in rows))
    got = read_pairs(pick)
    assert [Path(p.chosen).name for p in got] == ["0000_chosen.png", "0000_rejected.png"]
    bad = tmp_path / "bad.jsonl"
    for text, message in [('{"prompt": "x"}', "need prompt, chosen, rejected"),
                          ('{"prompt": "x", "chosen": "no.png", "rejected": "no.png"}', "does not exist"),
                          ("not json", "is not valid JSON")]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message) as info:
            read_pairs(bad)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        read_pairs(tmp_path / "missing.jsonl")


def test_stored_pairs_feed_the_dpo_loss(tiny_dir, pair_file):
    """Each group is one pair: chosen (preference 1) and rejected (0) share every slot's noise and noise level, both
    rows train every slot, nothing is sampled; the first iteration's loss is log 2 and nfe/train = 2 pairs × 2 rows
    × 2 slots × (policy + reference)."""
    tr = Trainer(_cfg(tiny_dir, pair_file), None, log=lambda *_: None)
    dom = tr.domain
    assert len(dom.train_keys()) == 3 and dom.train_prompts == [p.prompt for p in read_pairs(pair_file)]
    ro = dom.rollout([0, 2], 2, torch.Generator().manual_seed(0), 0)
    assert ro.rewards[PREFERENCE].tolist() == [1.0, 0.0, 1.0, 0.0] and ro.nfe == 0
    p = ro.payload
    for g in (0, 1):
        a, b = 2 * g, 2 * g + 1
        assert torch.equal(p["obj_noise"][a], p["obj_noise"][b]) and torch.equal(p["obj_sigma"][a], p["obj_sigma"][b])
        assert not torch.equal(p["x0"][a], p["x0"][b])  # two different images
    assert ro.mask[:, :2].all()
    m = tr.iteration(0)
    assert m["loss/policy"] == pytest.approx(math.log(2), abs=1e-5)
    assert m["nfe/train"] == 2 * 2 * 2 * 2 and m["nfe/rollout"] == 0
    m = tr.iteration(1)
    assert math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0


def test_group_size_other_than_two_is_one_line(tiny_dir, pair_file):
    with pytest.raises(ConfigError, match="group_size: 2") as info:
        _cfg(tiny_dir, pair_file, group_size=3)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["shapes_dpo_offline", "sd35_dpo_offline"])
def test_recipes_parse_and_run_on_the_tiny_pipeline(name, tiny_dir, pair_file):
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    recipe = load_train_config(load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml"))
    assert recipe.policy_loss_choice().name == "dpo" and recipe.rollout.group_size == 2
    assert recipe.domain_config.training_objective().settings.pairs
    data.update(device="cpu", iterations=1, **QUIET)
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 2}
    data["visgen"].update(model=str(tiny_dir), dtype="float32", num_inference_steps=3, rewards=[{"name": "shapes_soft"}],
                          eval=TINY_EVAL, task="shapes", num_threads=1, gradient_checkpointing=False)
    data["visgen"]["objective"].update(pairs=str(pair_file), timesteps_per_sample=1)
    for key in ("train_prompts", "eval_prompts", "resolution", "max_sequence_length", "rollout_micro_batch"):
        data["visgen"].pop(key, None)
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    m = tr.iteration(0)
    assert m["loss/policy"] == pytest.approx(math.log(2), abs=1e-5)
