"""The visgen training domain through the shared trainer: exact ratio 1, NFE counts, KL, LoRA export, EMA state,
configs, evaluation and end-of-run outputs, and the reward-model rewards (PickScore, HPS) on tiny models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import visgen
from shared_rl.config import ConfigError, load_train_config, load_yaml
from shared_rl.trainer import Trainer
from visgen import tiny
from visgen.domain import VisgenConfig, VisgenDomain

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def quiet(*_):
    pass


def make_cfg(tiny_dir: Path, **over):
    """A small visgen run: 2 prompts x 4 samples, 4 denoising steps; ``over`` sets dotted keys."""
    data = {
        "domain": "visgen", "seed": 1, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"weights": {"shapes_strict": 0.0}},
        "loss": {"clip_low": 1e-3},
        "optim": {"lr": 1e-2, "minibatches_per_epoch": 1, "inner_epochs": 1},
        "logging": {"progress": False},
        "visgen": {"model": str(tiny_dir), "num_inference_steps": STEPS, "lora": {"rank": 4, "alpha": 8},
                   "eval": {"max_prompts": 4, "samples_per_prompt": 1, "grid_prompts": 2, "grid_samples": 2}},
    }
    for key, value in over.items():
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return load_train_config(data)


# ------------------------------------------------------------------------------------------ ratio, nfe, layout
@pytest.mark.parametrize("micro, guidance, per_call", [(0, 1.0, 0), (3, 2.0, 1)])
def test_first_inner_step_ratio_is_exactly_one_and_nfe_counts(tiny_dir, micro, guidance, per_call):
    """One minibatch, one epoch, the whole minibatch per forward: the recomputed log-probs equal the rollout's bit
    for bit even with rollout micro-batches of 3, CFG (2 forwards per step) and one group per rollout call."""
    cfg = make_cfg(tiny_dir, **{"visgen.rollout_micro_batch": micro, "visgen.guidance_scale": guidance,
                                "rollout.groups_per_call": per_call,
                                "visgen.method": {"name": "flow_grpo", "train_fraction": 0.5}})
    tr = Trainer(cfg, None, log=quiet)
    m = tr.iteration(0)
    assert m["ratio/mean"] == 1.0 and m["ratio/max"] == 1.0 and m["clip_frac"] == 0.0
    assert m["grad_norm"] > 0
    n, cfg_factor = 2 * 4, 2 if guidance > 1 else 1
    assert m["nfe/rollout"] == n * STEPS * cfg_factor
    assert m["nfe/train"] == n * 2 * cfg_factor  # train_fraction 0.5 of 4 steps = the first 2 steps


def test_log_probs_on_any_subset_match_rollout(tiny_dir):
    """DanceGRPO plan (random trained steps per sample): any subset in any order recomputes the stored log-probs
    on its trained steps (to float rounding: other batch layouts) and returns 0 elsewhere."""
    cfg = make_cfg(tiny_dir, **{"visgen.kernel": "dance", "visgen.method": {"name": "dance_grpo", "train_fraction": 0.5}})
    dom = VisgenDomain(cfg.domain_config, _ctx())
    ro = dom.rollout([0, 3], 4, torch.Generator().manual_seed(0), 0)
    assert ro.mask.sum(1).tolist() == [2] * 8 and not ro.mask[:, -1].any()
    assert len({tuple(r) for r in ro.mask.tolist()}) > 1  # per-sample subsets
    idx = torch.tensor([6, 1, 4])
    out = dom.log_probs(ro, idx, need_kl=False)
    mask = ro.mask[idx]
    assert out.logp.shape == (3, STEPS) and out.logp.requires_grad
    assert torch.allclose(out.logp[mask], ro.logp_old[idx][mask], atol=1e-5, rtol=0)
    assert (out.logp[~mask] == 0).all()
    assert out.nfe == int(mask.sum())


def _ctx():
    from shared_rl.domain import RunContext

    return RunContext(run_dir=None, device=torch.device("cpu"), seed=0, log=quiet)


# ------------------------------------------------------------------------------------------ KL
@pytest.mark.parametrize("kl_type", ["mean", "velocity"])
def test_kl_is_zero_at_start_and_positive_after_an_update(tiny_dir, kl_type):
    cfg = make_cfg(tiny_dir, **{"loss.kl_coef": 0.5, "visgen.kl_type": kl_type, "optim.lr": 5e-2})
    tr = Trainer(cfg, None, log=quiet)
    m = tr.iteration(0)
    assert m["loss/kl"] == 0.0  # LoRA B = 0: adapter on and off give the same velocity
    assert m["nfe/train"] == 8 * (STEPS - 1) * 2  # policy + reference forwards
    ro = tr.domain.rollout([1, 2], 4, torch.Generator().manual_seed(5), 1)
    out = tr.domain.log_probs(ro, torch.arange(8), need_kl=True)
    assert out.kl is not None and out.kl.requires_grad
    assert (out.kl[ro.mask] > 0).all() and (out.kl[~ro.mask] == 0).all()
    # the adapter is switched back on after the reference forwards: log-probs still match the rollout
    assert torch.allclose(out.logp[ro.mask], ro.logp_old[ro.mask], atol=1e-5, rtol=0)
    assert all(p.requires_grad for p in tr.domain.parameters())


# ------------------------------------------------------------------------------------------ LoRA export, EMA state
def test_lora_save_and_diffusers_load_round_trip(tiny_dir, tmp_path):
    """Random LoRA weights (alpha != rank, so a lost scaling would show) -> save_pretrained -> a fresh stock
    pipeline's ``load_lora_weights`` gives the same ODE samples as the domain's adapted pipeline."""
    from visgen.tiny import load_shapes_asset

    dom = VisgenDomain(make_cfg(tiny_dir).domain_config, _ctx())
    g = torch.Generator().manual_seed(0)
    state = {k: 0.3 * torch.randn(v.shape, generator=g) for k, v in dom.state_dict().items()}
    dom.load_state_dict(state)
    assert all(torch.equal(dom.state_dict()[k], v) for k, v in state.items())
    dom.save_pretrained(tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()

    def ode(pipe):
        return visgen.sample(pipe, ["a red circle", "two blue squares"], STEPS, 1.0, torch.Generator().manual_seed(3),
                             "ode", max_sequence_length=1, height=16, width=16).final_latents

    fresh = load_shapes_asset(tiny_dir)
    base = ode(fresh)
    fresh.load_lora_weights(tmp_path / "lora")
    trained = ode(dom.pipe)
    assert not torch.allclose(base, trained, atol=1e-3)
    assert torch.allclose(ode(fresh), trained, atol=1e-5)


def test_ema_state_round_trip_and_eval_swap(tiny_dir):
    cfg = make_cfg(tiny_dir, **{"visgen.ema": {"enabled": True, "decay": 0.5}, "optim.lr": 5e-2})
    tr = Trainer(cfg, None, log=quiet)
    tr.iteration(0)
    dom = tr.domain
    state = dom.state_dict()
    names = [k for k in state if not k.startswith("ema.")]
    assert names and all(f"ema.{k}" in state for k in names)
    live = {n: p.detach().clone() for n, p in dom.policy._named_trainable()}
    # after one step from B = 0: ema = 0.5 * start + 0.5 * live
    lora_b = next(n for n in names if "lora_B" in n)
    assert torch.allclose(state[f"ema.{lora_b}"], 0.5 * live[lora_b])
    with dom.policy.ema_weights():
        inside = dict(dom.policy._named_trainable())[lora_b].detach().clone()
    assert torch.equal(inside, state[f"ema.{lora_b}"])
    assert torch.equal(dict(dom.policy._named_trainable())[lora_b], live[lora_b])  # restored
    other = VisgenDomain(cfg.domain_config, _ctx())
    other.load_state_dict(state)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="state mismatch"):
        VisgenDomain(make_cfg(tiny_dir).domain_config, _ctx()).load_state_dict(state)


# ------------------------------------------------------------------------------------------ configs
def test_recipe_configs_parse_without_loading_models():
    paths = sorted(p for p in (REPO / "configs" / "visgen").glob("*.yaml") if not p.name.endswith("pretrain.yaml"))
    names = {p.stem for p in paths}
    assert {"shapes_grpo", "shapes_dance", "shapes_fast", "shapes_mix", "shapes_compressibility",
            "sd35_pickscore", "flux_hps"} <= names
    for path in paths:
        cfg = load_train_config(load_yaml(path))
        assert cfg.domain == "visgen" and isinstance(cfg.domain_config, VisgenConfig), path


def test_checking_a_config_never_changes_it():
    """Loading (which runs every config hook) leaves the visgen section as the YAML wrote it, and checking it again
    changes nothing: derived values (branch pruning's estimator, the trained outputs, the objective's loss and
    sampler) are computed on demand. The pruning recipe once had its prune_estimator written into visgen.method."""
    import dataclasses

    from shared_rl.config import from_dict

    for name in ("shapes_branch_prune", "shapes_nft", "shapes_grpo", "words_ocr_grpo"):
        data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
        cfg = load_train_config(data)
        vis = cfg.domain_config
        written = dataclasses.asdict(from_dict(VisgenConfig, data["visgen"], "visgen"))
        assert dataclasses.asdict(vis) == written, name
        vis.check("visgen")
        vis.check_with(cfg)
        vis.preflight(cfg)
        derived = (vis.policy_loss(cfg), vis.rollout_structure(cfg), vis.trained_outputs(cfg),
                   vis.rollout_method(train_cfg=cfg), cfg.policy_loss_choice(), vis.kernel_settings())
        assert dataclasses.asdict(vis) == written, name
    # what the trainer's sections decide is derived: pruning ranks by the training estimator, not stored
    prune = load_train_config(load_yaml(REPO / "configs" / "visgen" / "shapes_branch_prune.yaml"))
    assert "prune_estimator" not in prune.domain_config.method
    estimator = prune.domain_config.rollout_method(train_cfg=prune).settings.prune_estimator
    assert estimator == prune.advantage.estimator.name and prune.domain_config.rollout_method().settings.prune_estimator is None
    assert derived[2] == ["ocr"]  # words_ocr_grpo trains on its OCR output only


@pytest.mark.parametrize("over, message", [
    ({"visgen.kernal": "sde"}, "did you mean 'kernel'"),
    ({"visgen.kernel": "euler"}, "not one of"),
    ({"visgen.sampler": "sde"}, "replaced: the SDE kernel is visgen.kernel"),
    ({"visgen.plan": {"name": "flow_grpo"}}, "replaced: use visgen.method"),
    ({"visgen.method": {"name": "mix_grpo", "window_size": 6}}, "does not fit"),
    ({"visgen.method": {"name": "ode"}}, "trains nothing"),
    ({"visgen.method": {"name": "branch_grpo", "split_steps": [0, 1, 2]}}, "set rollout.group_size: 8"),
    ({"visgen.shared_noise": True, "visgen.method": {"name": "tree_grpo"}, "rollout.group_size": 16,
      "advantage.estimator": "tree_leaf_zscore"}, "shared_noise is for flat methods"),
    ({"visgen.num_inference_steps": 1}, "num_inference_steps must be >= 2"),
    ({"visgen.rewards": [{"name": "aesthetics_v9"}]}, "unknown reward"),
    ({"visgen.lora": {"rank": 0}}, "rank must be >= 1"),
    ({"loss.kl_coef": 0.1, "loss.kl_estimator": "k3"}, "kl_estimator: domain"),
    ({"visgen.task": "file"}, "train_prompts must name a prompt file"),
])
def test_bad_domain_config_is_one_actionable_line(tiny_dir, over, message):
    with pytest.raises(ConfigError, match=message) as info:
        make_cfg(tiny_dir, **over)
    assert "\n" not in str(info.value)


def test_missing_model_path_is_a_config_error(tmp_path):
    cfg = VisgenConfig(model=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="model path .* does not exist"):
        VisgenDomain(cfg, _ctx())
    cfg = VisgenConfig(model="assets/shapes-sd3-tiny-missing")
    with pytest.raises(ConfigError, match="does not exist.*visgen.pretrain"):
        VisgenDomain(cfg, _ctx())


# ------------------------------------------------------------------------------------------ evaluation, outputs
def test_fit_evaluates_exports_and_writes_grid(tiny_dir, tmp_path):
    cfg = make_cfg(tiny_dir, **{"iterations": 2})
    tr = Trainer(cfg, tmp_path / "run", log=quiet)
    first = tr.domain.evaluate(0)
    assert first == tr.domain.evaluate(0)  # ODE sampling with fixed seeds
    assert {"eval/score", "eval/strict"} <= set(first) and 0 <= first["eval/strict"] <= 1
    hist = tr.fit()
    assert "eval/score" in hist[0] and "eval/score" in hist[-1]
    run = tmp_path / "run"
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
    assert json.loads((run / "final" / "grove_export.json").read_text())["train_mode"] == "lora"
    assert (run / "samples_before_after.png").is_file()
    summary = (run / "visgen_summary.txt").read_text()
    assert "eval/strict" in summary and "lora" in summary
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["reward/shapes_strict/mean"] is not None and "time/reward" in records[-1]


def test_full_finetuning_with_reference_copy(tiny_dir):
    cfg = make_cfg(tiny_dir, **{"visgen.train_mode": "full", "loss.kl_coef": 0.1, "optim.lr": 1e-3})
    tr = Trainer(cfg, None, log=quiet)
    n_params = sum(p.numel() for p in tr.domain.parameters())
    assert n_params == sum(p.numel() for p in tr.domain.pipe.transformer.parameters())
    m = tr.iteration(0)
    assert m["ratio/mean"] == 1.0 and m["loss/kl"] == 0.0
    ro = tr.domain.rollout([0, 1], 4, torch.Generator().manual_seed(1), 1)
    assert (tr.domain.log_probs(ro, torch.arange(8), True).kl[ro.mask] > 0).all()


# ------------------------------------------------------------------------------------------ reward models
def _tiny_clip_dir(tmp_path: Path) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from visgen.tasks.shapes import vocabulary

    tok = tiny.build_tokenizer(vocabulary())
    text = dict(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(tmp_path / "clip")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(tmp_path / "clip")
    return tmp_path / "clip"


def test_pickscore_reward_on_a_tiny_clip(tmp_path):
    from transformers import AutoProcessor, CLIPModel

    from visgen.rewards import RewardInputError, get_reward

    path = _tiny_clip_dir(tmp_path)
    reward = get_reward("pickscore", model=str(path), processor=None, device="cpu", scale=0.5)
    images = torch.rand(3, 3, 24, 40, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle", "two blue squares", "a green triangle on the left"]
    score = reward(images, prompts)["pickscore"]
    # by hand: CLIP's logits_per_image diagonal = exp(logit_scale) * cosine, times the scale, on the anchors' input
    # (uint8 PIL image, bicubic shorter side 32, centre crop floored like transformers; test_rewards_models.py)
    model, proc = CLIPModel.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)
    inputs = proc(text=prompts, padding=True, return_tensors="pt")
    import numpy as np
    from PIL import Image

    pils = [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()).resize((53, 32), Image.BICUBIC)
            for x in images]
    crops = [torch.from_numpy(np.asarray(im.crop((10, 0, 42, 32))).copy()).permute(2, 0, 1) / 255.0 for im in pils]
    mean, std = torch.tensor(proc.image_processor.image_mean), torch.tensor(proc.image_processor.image_std)
    inputs["pixel_values"] = (torch.stack(crops) - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    with torch.no_grad():
        logits = model(**inputs).logits_per_image
    assert torch.allclose(score, 0.5 * logits.diagonal(), atol=1e-5)
    images[1, 0, 0, 0] = float("nan")
    again = reward(images, prompts)["pickscore"]
    assert torch.isnan(again[1]) and torch.allclose(again[[0, 2]], score[[0, 2]], atol=1e-5)
    with pytest.raises(RewardInputError, match="cannot load"):
        get_reward("pickscore", model=str(tmp_path / "missing"), processor=None)


def test_hps_reward_on_a_tiny_open_clip(tmp_path):
    from visgen.rewards import RewardInputError, get_reward

    open_clip = pytest.importorskip("open_clip", reason="the hps reward needs open_clip_torch")
    config = {"embed_dim": 8, "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "patch_size": 8, "head_width": 8},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}
    (tmp_path / "hps-tiny.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "hps-tiny.json")
    torch.manual_seed(0)
    model = open_clip.create_model("hps-tiny").eval()
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "hps.pt")
    reward = get_reward("hps", checkpoint=str(tmp_path / "hps.pt"), arch=str(tmp_path / "hps-tiny.json"), device="cpu")
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prompts = ["a red circle", "two blue squares"]
    score = reward(images, prompts)["hps"]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():  # the anchors score uint8 images: quantise like the reward does
        img = torch.nn.functional.normalize(model.encode_image(((images * 255).round() / 255 - mean) / std), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(open_clip.get_tokenizer("hps-tiny")(prompts)), dim=-1)
    assert torch.allclose(score, (img * txt).sum(-1), atol=1e-5)
    with pytest.raises(RewardInputError, match="neither a file"):
        get_reward("hps", checkpoint=str(tmp_path / "missing.pt"), arch=str(tmp_path / "hps-tiny.json"))


def test_shapes_soft_reward_margins_and_partial_credit():
    from visgen.rewards import get_reward
    from visgen.rewards.shapes_soft import shape_margin
    from visgen.tasks import shapes as S

    t3, t4 = S.TRIANGLE_MIN_THREEFOLD, S.SQUARE_MIN_FOURFOLD
    assert shape_margin("triangle", t3 + 0.08, 0.5) == pytest.approx(0.08)
    assert shape_margin("square", t3 - 0.12, t4 + 0.05) == pytest.approx(0.05)
    assert shape_margin("circle", t3 - 0.01, t4 - 0.1) == pytest.approx(0.01)
    assert shape_margin("circle", 0.0, t4 + 0.02) == pytest.approx(-0.02)
    spec = S.parse_prompt("a red circle on the left and a blue square on the right")
    swapped = S.parse_prompt("a red square on the left and a blue circle on the right")
    truth = torch.from_numpy(S.render_batch([spec, swapped], seed=0))
    prompts = [spec.prompt, spec.prompt]
    soft = get_reward("shapes_soft")(truth, prompts, [spec.to_dict()] * 2)["shapes_soft"]
    hard = get_reward("shapes")(truth, prompts, [spec.to_dict()] * 2)["shapes"]
    assert hard.tolist() == pytest.approx([1.0, 7 / 9])  # the swapped image fails both shape checks
    assert 0.9 < soft[0] <= 1.0 and hard[1] < soft[1] < soft[0]  # soft margins: partial credit, still ordered


# ------------------------------------------------------------------------------------------ reward faults
def test_failing_reward_backend_is_retried_then_masked_in_training(tiny_dir, monkeypatch):
    """A reward server that drops every call: the guard retries, the rollout carries NaN under the reward's own
    output names, the trainer masks the batch and counts it, and ``fatal`` stops with a RewardFailure instead."""
    from shared_rl.rewards import RewardFailure
    from visgen import rewards as vr

    calls = []

    def _factory():
        def score(images, prompts, metadata=None):
            calls.append(len(prompts))
            raise ConnectionError("reward server unreachable")
        return score

    monkeypatch.setitem(vr._REGISTRY, "test_unreachable_server", _factory)   # registered for this test only
    cfg = make_cfg(tiny_dir, **{"visgen.rewards": [{"name": "shapes"}, {"name": "test_unreachable_server"}],
                               "visgen.reward_guard": {"retries": 1, "backoff_s": 0.0},
                               "advantage.weights": {"shapes": 1.0, "shapes_strict": 0.0,
                                                     "test_unreachable_server": 1.0}})
    tr = Trainer(cfg, None, log=quiet)
    m = tr.iteration(0)
    assert calls == [8, 8]                                    # 2 prompts x 4 samples, first try + one retry
    assert m["reward/nan_count"] == 8
    cfg = make_cfg(tiny_dir, **{"visgen.rewards": [{"name": "test_unreachable_server"}],
                               "visgen.reward_guard": {"retries": 0, "on_failure": "fatal"},
                               "advantage.weights": {"test_unreachable_server": 1.0}})
    with pytest.raises(RewardFailure, match="test_unreachable_server.*failed after 1 attempts"):
        Trainer(cfg, None, log=quiet).iteration(0)
