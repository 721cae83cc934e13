"""Video through the one engine and the shared trainer: a tiny Wan pipeline saved like an asset trains one iteration
with every kind of method (flat Flow-GRPO, DanceGRPO, BranchGRPO, TreeGRPO, E-GRPO, DiffusionNFT, AWM) unchanged,
with ratio exactly 1 where log-probs are recomputed; the text-embedding cache hits and changes nothing; the memory
settings apply; the end-of-run writes before/after clips."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer
from visgen.pipelines import as_adapter
from visgen.pipelines.cache import configure_prompt_cache, prompt_cache
from visgen.tasks import video as vtask

from . import tiny_families as tf

torch.set_num_threads(1)
STEPS = 4


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    """A tiny Wan (5 frames at 16x16, latents [4, 2, 2, 2]) saved with a grove.json, plus video prompt files."""
    path = tmp_path_factory.mktemp("video") / "tiny-wan"
    pipe = tf.build_wan()
    pipe.save_pretrained(path, safe_serialization=True)
    (path / "grove.json").write_text(json.dumps({"num_frames": 5, "resolution": 16, "max_sequence_length": 8,
                                                 "fps": 4}))
    vtask.write_prompt_files(path)
    return path


def make_cfg(wan_dir: Path, method=None, extra=None, **over):
    data = {
        "domain": "visgen", "seed": 0, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "loss": {"clip_low": 1e-3},
        "optim": {"lr": 1e-2, "minibatches_per_epoch": 1, "inner_epochs": 1},
        "logging": {"progress": False},
        "visgen": {"model": str(wan_dir), "task": "file",
                   "train_prompts": str(wan_dir / "video_shapes_train.jsonl"),
                   "eval_prompts": str(wan_dir / "video_shapes_eval.jsonl"),
                   "num_inference_steps": STEPS, "lora": {"rank": 4, "alpha": 8},
                   "method": method or {"name": "flow_grpo", "train_fraction": 0.5},
                   "rewards": [{"name": "video_motion"}, {"name": "video_shapes"}],
                   "eval": {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 1, "grid_samples": 2}},
    }
    for key, value in (extra or {}).items():
        data.setdefault(key, {}).update(value)
    data["visgen"].update(over)
    return load_train_config(data)


@pytest.mark.parametrize("method, advantage", [
    ({"name": "flow_grpo", "train_fraction": 0.5}, "grpo"),
    ({"name": "dance_grpo", "train_fraction": 0.5}, "grpo"),
    ({"name": "branch_grpo", "split_steps": [0, 1], "factor": [2]}, "depth_zscore"),
    ({"name": "tree_grpo", "branch": [2, 2], "window_start": 0}, "tree_leaf_zscore"),
])
def test_video_methods_train_with_exact_ratio(wan_dir, method, advantage):
    cfg = make_cfg(wan_dir, method, {"advantage": {"estimator": advantage, "weights": {"video_shapes": 0.0}}},
                   kernel="dance" if method["name"] == "dance_grpo" else "sde")
    m = Trainer(cfg, None, log=quiet).iteration(0)
    assert m["ratio/mean"] == 1.0 and m["ratio/max"] == 1.0, m
    assert m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["loss/policy"]))
    assert m["reward/mean"] > 0  # motion of random clips


def test_video_egrpo_trains(wan_dir):
    cfg = make_cfg(wan_dir, {"name": "egrpo"}, {"rollout": {"group_size": 2},
                                                 "advantage": {"estimator": "depth_zscore",
                                                               "multi_reward": "normalize_then_sum"}})
    m = Trainer(cfg, None, log=quiet).iteration(0)
    assert m["ratio/mean"] == 1.0 and m["grad_norm"] > 0


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_video_likelihood_free_objectives_train(wan_dir, objective):
    cfg = make_cfg(wan_dir, {"name": "ode"}, {}, objective={"name": objective, "timesteps_per_sample": 2})
    m = Trainer(cfg, None, log=quiet).iteration(0)
    assert m["grad_norm"] > 0 and torch.isfinite(torch.tensor(m["loss/policy"]))


def test_prompt_cache_hits_and_changes_nothing(wan_dir):
    results = {}
    for enabled in (False, True):
        cfg = make_cfg(wan_dir, memory={"prompt_cache": enabled})
        trainer = Trainer(cfg, None, log=quiet)
        dom = trainer.domain
        cache = prompt_cache(dom.pipe)
        cache.reset_stats()
        first = dom.rollout([0, 1], 4, torch.Generator().manual_seed(5), 0)
        second = dom.rollout([1, 2], 4, torch.Generator().manual_seed(6), 1)
        results[enabled] = (first, second)
        stats = cache.stats()
        if enabled:
            assert stats["misses"] == 3 and stats["hits"] == 1, stats  # prompt 1 is served from the cache
            assert len(cache) == 3
        else:
            assert stats["hits"] == 0 and len(cache) == 0
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a.logp_old, b.logp_old)
        assert torch.equal(a.payload["latents"], b.payload["latents"])
        assert all(torch.equal(a.rewards[k], b.rewards[k]) for k in a.rewards)


def test_prompt_cache_is_invalidated_by_a_text_encoder_update():
    pipe = tf.build_wan()
    pipe.text_encoder.requires_grad_(False)  # grove training freezes every non-trained module (FlowPolicy)
    adapter = as_adapter(pipe)
    cache = configure_prompt_cache(pipe, enabled=True, clear=True)
    cache.reset_stats()
    before = adapter.encode_prompts(["a red square"], **tf.WAN_CALL).tensors["prompt_embeds"]
    adapter.encode_prompts(["a red square"], **tf.WAN_CALL)
    assert cache.stats()["hits"] == 1
    with torch.no_grad():
        for p in pipe.text_encoder.parameters():
            p.mul_(1.5)  # an in-place update bumps the parameters' version counters
    after = adapter.encode_prompts(["a red square"], **tf.WAN_CALL).tensors["prompt_embeds"]
    assert cache.stats()["misses"] == 2 and not torch.equal(before, after)
    pipe.text_encoder.requires_grad_(True)  # a trained text encoder bypasses the cache
    adapter.encode_prompts(["a red square"], **tf.WAN_CALL)
    assert cache.stats()["bypassed"] == 1


def test_memory_settings_apply_and_are_checked(wan_dir):
    cfg = make_cfg(wan_dir, memory={"vae_slicing": True, "decode_frame_chunk": 1, "offload_text_encoders": True,
                                    "offload_rewards": True})
    dom = Trainer(cfg, None, log=quiet).domain
    assert dom.pipe.vae.use_slicing and dom.adapter.decode_frame_chunk == 1
    assert dom.memory["offload_text_encoders"] and next(dom.pipe.text_encoder.parameters()).device.type == "cpu"
    ro = dom.rollout([0], 2, torch.Generator().manual_seed(0), 0)
    assert ro.logp_old.shape[0] == 2
    with pytest.raises(ConfigError, match="decode_frame_chunk must be >= 0"):
        make_cfg(wan_dir, memory={"decode_frame_chunk": -1})
    with pytest.raises(ConfigError, match="vae_tile_size must be >= 0"):
        make_cfg(wan_dir, memory={"vae_tile_size": -8})
    with pytest.raises(ConfigError, match="unknown config key 'visgen.memory.context_parallel'"):
        make_cfg(wan_dir, memory={"context_parallel": {"ulysses_degree": 2}})  # a sampling API, not a training key


def test_video_run_writes_before_after_clips(wan_dir, tmp_path):
    cfg = make_cfg(wan_dir)
    trainer = Trainer(cfg, tmp_path, log=quiet)
    trainer.fit() if hasattr(trainer, "fit") else trainer.train()
    gif = tmp_path / "samples_before_after.gif"
    assert gif.is_file() and gif.stat().st_size > 0
    import imageio.v3 as iio

    frames = iio.imread(gif)
    assert frames.shape[0] == 5  # one GIF frame per video frame
    assert "row 0:" in (tmp_path / "samples_before_after.txt").read_text()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "eval/video_shapes" in rows[0] and "eval/video_motion" in rows[0]


def test_num_frames_is_for_video_pipelines(tiny_dir):
    cfg = load_train_config({"domain": "visgen", "iterations": 1, "logging": {"progress": False},
                             "visgen": {"model": str(tiny_dir), "num_frames": 9}})
    with pytest.raises(ConfigError, match="num_frames is for video pipelines"):
        Trainer(cfg, None, log=quiet)


def test_lora_export_of_a_pipeline_without_a_lora_loader(tmp_path):
    """HunyuanVideo 1.5's pipeline has no save_lora_weights in diffusers 0.42: the transformer's own PEFT export is
    written, and ``transformer.load_lora_adapter(dir, prefix=None)`` loads it back with the trained weights."""
    from visgen.policy import FlowPolicy

    pipe = tf.build_hunyuan_video15()
    assert not hasattr(type(pipe), "save_lora_weights")
    policy = FlowPolicy(pipe, "lora")
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    policy.save_pretrained(tmp_path)
    fresh = tf.build_hunyuan_video15()
    assert (tmp_path / "pytorch_lora_weights.safetensors").is_file()
    fresh.transformer.load_lora_adapter(str(tmp_path), adapter_name="default", use_safetensors=True, prefix=None)
    trained = {n: p for n, p in pipe.transformer.named_parameters() if "lora" in n}
    loaded = {n: p for n, p in fresh.transformer.named_parameters() if "lora" in n}
    assert trained.keys() == loaded.keys() and trained
    assert all(torch.equal(trained[n], loaded[n]) for n in trained)
