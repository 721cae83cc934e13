"""``shared_rl.llm.api.GRPOTrainer`` as a drop-in for TRL's: a ``GRPOConfig`` translated field by field
(``trl_args``), TRL's metric names in ``state.log_history``, rewards as TRL takes them (async functions, reward
models, ``None`` = not applicable), ``peft_config``, callbacks, ``evaluate`` and ``save_model``. TRL's own test file
runs through ``tests/llm/trl_suite.py`` (minutes; docs/methods/llm.md has its result)."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
from transformers import Qwen2Config, Qwen2ForSequenceClassification, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from shared_rl.config import ConfigError  # noqa: E402
from shared_rl.llm.api import GRPOTrainer, reward_model_function, trl_reward_metrics  # noqa: E402
from shared_rl.llm.model import build_tiny_llama  # noqa: E402
from shared_rl.llm.tokenizer import build_char_tokenizer  # noqa: E402
from shared_rl.llm.trl_args import translate  # noqa: E402


def _cfg(tmp_path, **kw):
    # use_cpu: TrainingArguments refuses TRL's bf16 default without a GPU otherwise
    return GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, **kw)


def _model(seed=0):
    tok = build_char_tokenizer()
    return build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, max_position_embeddings=48, seed=seed), tok


ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(1, 9) for b in (2, 5)]


def test_translation_of_trl_defaults_and_batch_arithmetic(tmp_path):
    # 16 rows, 3 completions per micro-batch, 3 generations: a generation = 1 prompt x 3; 3 epochs = 48 iterations
    t = translate(_cfg(tmp_path, per_device_train_batch_size=3, num_generations=3, max_completion_length=8), 16)
    c = t.config
    assert c["iterations"] == 48 and c["rollout"] == {"groups_per_iteration": 1, "group_size": 3}
    assert c["loss"] == {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0,
                         "kl_estimator": "k3"}  # TRL's default loss_type dapo, beta 0
    assert c["advantage"] == {"estimator": "grpo", "clip": None, "eps": 1e-4, "multi_reward": "sum_then_normalize"}
    o = c["optim"]
    assert (o["lr"], o["schedule"], o["warmup_steps"], o["grad_clip"]) == (1e-6, "linear", 0, 1.0)
    assert (o["inner_epochs"], o["minibatches_per_epoch"], o["micro_batch_size"]) == (1, 1, 3)
    assert c["llm"]["max_new_tokens"] == 8 and c["llm"]["gradient_checkpointing"] is True  # TRL's defaults
    assert c["llm"]["none_rewards"] == "zero_unless_all" and c["llm"]["chat_template"] == "never"
    assert t.trainer["steps_per_iteration"] == 1 and t.trainer["logging_steps"] == 10
    assert any("bf16" in n for n in t.notes)  # TRL's bf16 autocast default is said, not dropped
    # 4 steps per generation of 2 accumulation steps: 2 optimizer steps per generation, x2 iterations (mu)
    t = translate(_cfg(tmp_path, per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
                       steps_per_generation=4, num_iterations=2, max_steps=10, beta=0.04, loss_type="dr_grpo",
                       scale_rewards="batch", epsilon_high=0.28), 16)
    c = t.config
    assert c["rollout"] == {"groups_per_iteration": 4, "group_size": 4}  # 16 completions / 4
    assert (c["optim"]["inner_epochs"], c["optim"]["minibatches_per_epoch"]) == (2, 2)
    assert c["iterations"] == 3  # ceil(10 optimizer steps / 4 per iteration)
    assert c["loss"]["aggregation"] == "seq-mean-token-sum-norm" and c["loss"]["max_steps_norm"] == 512
    assert (c["loss"]["clip_high"], c["loss"]["kl_coef"]) == (0.28, 0.04)
    assert c["advantage"]["estimator"] == "batch_std" and c["llm"]["kl_ratio_correction"] == "token"
    assert c["llm"]["keep_reference"] is True


def test_a_trl_field_grove_cannot_honour_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"GRPOConfig\.vespo_k_pos=3\.0: grove has no equivalent"):
        translate(_cfg(tmp_path, vespo_k_pos=3.0), 16)
    with pytest.raises(ConfigError, match=r"GRPOConfig\.loss_type='vespo'"):
        translate(_cfg(tmp_path, loss_type="vespo"), 16)
    with pytest.raises(ConfigError, match=r"GRPOConfig\.delta=1\.1: .*delta > 1 \+ epsilon_high \(1\.2\)"):
        translate(_cfg(tmp_path, delta=1.1), 16)
    with pytest.raises(ConfigError, match=r"GRPOConfig\.loss_type='luspo': LUSPO is a sequence-level loss"):
        translate(_cfg(tmp_path, loss_type="luspo"), 16)


def test_trl_entropy_delta_cispo_luspo_and_lm_head_fields_translate(tmp_path):
    c = translate(_cfg(tmp_path, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=3.0,
                       entropy_coef_delta=0.002, entropy_coef_max=0.5, top_entropy_quantile=0.2), 16).config
    assert c["loss"]["entropy"] == {"coef": 0.01, "top_quantile": 0.2, "target": 3.0, "coef_step": 0.002,
                                    "coef_min": 0.0, "coef_max": 0.5}
    assert "target" not in translate(_cfg(tmp_path, entropy_coef=0.1), 16).config["loss"]["entropy"]  # fixed
    assert "entropy" not in translate(_cfg(tmp_path), 16).config["loss"]
    assert translate(_cfg(tmp_path, delta=2.0), 16).config["loss"]["dual_clip"] == 2.0  # INTELLECT-2 = dual clip
    assert "dual_clip" not in translate(_cfg(tmp_path, delta=2.0, loss_type="sapo"), 16).config["loss"]  # TRL: unused
    cispo = translate(_cfg(tmp_path, loss_type="cispo", epsilon_high=0.2, importance_sampling_level="sequence"),
                      16).config["loss"]
    assert cispo["policy_loss"] == {"name": "cispo", "max_weight": 0.2, "level": "sequence"}
    assert cispo["clip_low"] == 1.0  # TRL's cispo has no lower cap
    luspo = translate(_cfg(tmp_path, loss_type="luspo", importance_sampling_level="sequence"), 16).config["loss"]
    assert (luspo["policy_loss"], luspo["aggregation"], luspo["max_steps_norm"]) == (
        "gspo", "seq-mean-token-sum-norm", 1)
    assert translate(_cfg(tmp_path, cast_lm_head_to_fp32=True), 16).config["llm"]["lm_head_fp32"] is True
    assert translate(_cfg(tmp_path, off_policy_mask_threshold=0.5), 16).config["loss"]["off_policy_mask"] == 0.5


def test_trl_reward_metrics_by_hand():
    # two groups of 2; function b scores only the last row; row 2 is scored by nobody (unscorable, left out)
    raw = {"a": torch.tensor([1.0, 2.0, math.nan, 4.0]), "b": torch.tensor([math.nan, math.nan, math.nan, 1.0])}
    m = trl_reward_metrics(raw, {"a": 1.0, "b": 2.0}, 2, [False, True, False, False], torch.tensor([3., 5., 1., 2.]))
    assert m["rewards/a/mean"] == pytest.approx(7 / 3) and m["rewards/b/mean"] == 1.0
    assert m["rewards/a/std"] == pytest.approx(torch.tensor([1., 2., 4.]).std().item())
    assert math.isnan(m["rewards/b/std"])  # one value: no std
    totals = [1.0, 2.0, 4.0 + 2.0]  # nansum with weights 1 and 2
    assert m["reward"] == pytest.approx(sum(totals) / 3)
    assert m["reward_std"] == pytest.approx(torch.tensor(totals).std().item())
    assert m["frac_reward_zero_std"] == 0.5  # the second group has one scored row: std NaN counts as zero
    assert (m["completions/mean_length"], m["completions/clipped_ratio"]) == (2.75, 0.25)


def test_reward_model_scores_prompt_plus_completion_like_trl():
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg).eval()
    fn = reward_model_function(rm, tok)
    got = fn(prompts=["1+1=", "12+30="], completions=["2", "42"])
    with torch.no_grad():
        want = [rm(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for text in ("1+1=2", "12+30=42")]
    assert got == pytest.approx(want, abs=1e-5)  # right padding: each row scored as if alone
    with pytest.raises(ConfigError, match="not a sequence classifier"):
        reward_model_function(torch.nn.Linear(2, 2), tok)


class _Seen(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_step_end(self, args, state, control, **kw):
        self.events.append(("step", state.global_step))

    def on_log(self, args, state, control, logs=None, **kw):
        self.events.append(("log", sorted(logs)))

    def on_train_end(self, args, state, control, **kw):
        self.events.append(("end", state.global_step))


def test_grpo_config_run_with_trl_surface(tmp_path):
    """A GRPOConfig run: sync + async + None-returning rewards, callbacks, TRL's log_history names, TrainOutput,
    evaluate() and save_model(); the parameters move."""
    model, tok = _model()
    before = {n: p.clone() for n, p in model.named_parameters()}
    seen_state = []

    def short(completions, trainer_state, log_extra, **_):
        seen_state.append(trainer_state.global_step)
        log_extra("head", [c[:2] for c in completions])
        return [-len(c) / 4 for c in completions]

    async def digits(completions, **_):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    def not_applicable(completions, **_):
        return [None] * len(completions)

    cb = _Seen()
    args = _cfg(tmp_path, learning_rate=0.05, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=4, max_steps=3, logging_steps=2, gradient_checkpointing=False, seed=0)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[short, digits, not_applicable],
                          args=args, train_dataset=ROWS, eval_dataset=ROWS[:2], callbacks=[cb], log=lambda *_: None)
    assert trainer.args is args and trainer.ref_model is None  # beta 0: no reference, as TRL
    out = trainer.train()
    assert out.global_step == 3 and trainer.state.global_step == 3
    logs = trainer.state.log_history
    # every 2 steps, then the train summary holding what step 3 left unlogged (TRL's log() merges it there)
    assert [r["step"] for r in logs] == [2, 3] and "rewards/short/mean" in logs[-1] and "loss" not in logs[-1]
    for name in ("reward", "reward_std", "rewards/short/mean", "rewards/short/std", "rewards/digits/mean", "loss",
                 "frac_reward_zero_std", "completions/mean_length", "learning_rate"):
        assert name in logs[0], name
    assert math.isnan(logs[0]["rewards/not_applicable/mean"])  # None everywhere: no mean, the others still train
    assert logs[-1]["train_loss"] == pytest.approx(out.training_loss) and "kl" not in logs[0]
    assert [e for e in cb.events if e[0] == "step"] == [("step", 1), ("step", 2), ("step", 3)]
    assert cb.events[-1] == ("end", 3) and sum(e[0] == "log" for e in cb.events) == 1
    assert seen_state == [0, 1, 2]  # reward functions see TRL's state (global_step before the update)
    assert len(trainer._logs["extra"]["head"]) == 3 * 4  # log_extra: a column per completion, as TRL's table
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_reward", "eval_rewards/short/mean"} <= set(metrics)
    both = trainer.evaluate({"a": ROWS[:2], "b": ROWS[2:4]})
    assert {"eval_a_loss", "eval_b_loss"} <= set(both)
    saved = trainer.save_model(tmp_path / "saved")
    assert (saved / "config.json").exists() and (saved / "tokenizer.json").exists()


def test_none_means_not_applicable_as_in_trl(tmp_path):
    """TRL sums the functions with nansum: a None term counts 0 when another function scored the sample, so the
    policy still learns from the other function (grove's own default would make the sample missing)."""
    model, tok = _model(seed=1)
    before = [p.clone() for p in model.parameters()]

    def half(completions, **_):  # scores every other completion
        return [float(len(c)) if i % 2 else None for i, c in enumerate(completions)]

    def lengths(completions, **_):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[half, lengths],
                          args=_cfg(tmp_path, learning_rate=0.05, per_device_train_batch_size=4, num_generations=4,
                                    max_completion_length=4, max_steps=1, gradient_checkpointing=False),
                          train_dataset=ROWS, log=lambda *_: None)
    trainer.train()
    rec = trainer.trainer.history[-1]
    assert rec["reward/half/mean"] == pytest.approx(0.5 * trainer.state.log_history[0]["rewards/half/mean"])
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_peft_config_trains_only_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    model, tok = _model(seed=2)
    base = {n: p.clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=lambda completions, **_: [
        float(len(c)) for c in completions], train_dataset=ROWS, log=lambda *_: None,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        args=_cfg(tmp_path, learning_rate=0.05, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=4, max_steps=2, beta=0.1))
    assert trainer.ref_model is None  # the reference is the base model with the adapter disabled
    trainer.train()
    for n, p in trainer.model.named_parameters():
        plain = n.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" in n:
            continue
        assert torch.equal(base[plain], p), n
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in trainer.model.named_parameters())
    assert "kl" in trainer.state.log_history[0]


def test_kl_ratio_correction_is_trls_formula():
    """TRL (use_bias_correction_kl): per_token_kl = (exp(ref - logp) - (ref - logp) - 1) * exp(logp - old)."""
    from types import SimpleNamespace

    from shared_rl.llm.domain import LLMDomain

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref, old = torch.tensor([[-1.5, -1.0, -0.5]]), torch.tensor([[-1.2, -2.0, -0.7]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    dom = SimpleNamespace(cfg=SimpleNamespace(kl_ratio_correction="token"))
    got = LLMDomain._ratio_corrected_k3(dom, logp, ref, old, mask)
    d = ref - logp.detach()
    want = (torch.exp(d) - d - 1) * torch.exp(logp.detach() - old) * mask
    assert torch.allclose(got.detach(), want)
    got.sum().backward()  # the ratio keeps its gradient: d/dlogp [k3 * r] = (1 - exp(d)) * r + k3 * r
    r = torch.exp(logp.detach() - old)
    assert torch.allclose(logp.grad, ((1 - torch.exp(d)) * r + (torch.exp(d) - d - 1) * r) * mask)
    dom.cfg.kl_ratio_correction = "sequence"
    seq = LLMDomain._ratio_corrected_k3(dom, logp.detach(), ref, old, mask)
    ratio = math.exp(((-1.0 + 1.2) + 0.0) / 2)  # the mean log-ratio over the 2 real tokens
    assert torch.allclose(seq, (torch.exp(d) - d - 1) * ratio * mask)


def test_sync_ref_model_mixes_by_hand_and_mappings_of_field_names(tmp_path):
    """TRL's sync_ref_model: reference <- alpha * policy + (1 - alpha) * reference; a dict of GRPOConfig field names
    is a GRPOConfig."""
    from types import SimpleNamespace

    from shared_rl.llm.trl_args import from_mapping

    policy, ref = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        policy.weight.fill_(1.0)
        ref.weight.fill_(0.0)
    fake = SimpleNamespace(trainer=SimpleNamespace(domain=SimpleNamespace(reference=ref)), model=policy)
    GRPOTrainer._sync_reference(fake, 0.6)
    GRPOTrainer._sync_reference(fake, 0.6)
    assert ref.weight.item() == pytest.approx(0.6 + 0.4 * 0.6)  # 0 -> 0.6 -> 0.84
    args = from_mapping({"num_generations": 4, "output_dir": str(tmp_path)})
    assert type(args).__name__ == "GRPOConfig" and args.num_generations == 4
    with pytest.raises(ConfigError, match=r"\['num_generation'\] are not GRPOConfig fields"):
        from_mapping({"num_generation": 4})


def test_trl_entropy_bonus_runs_as_trl_documents_it(tmp_path):
    """entropy_coef: loss = policy_loss - coef * mean token entropy (logged as TRL: policy_loss, entropy_coef); the
    entropy carries grad only while the bonus is on; use_adaptive_entropy: one coef_delta per optimizer step."""
    model, tok = _model(seed=3)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=lambda completions, **_: [
        float(len(c)) for c in completions], train_dataset=ROWS, log=lambda *_: None,
        args=_cfg(tmp_path, learning_rate=0.05, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=4, max_steps=3, logging_steps=1, entropy_coef=0.5,
                  gradient_checkpointing=False))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "policy_loss" in h]
    assert len(logs) == 3 and all(h["entropy_coef"] == 0.5 for h in logs)
    for h in logs:  # one optimizer step an iteration: the bonus is exactly the logged mean entropy
        assert (h["policy_loss"] - h["loss"]) == pytest.approx(0.5 * h["entropy"], rel=1e-4)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    _, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3,
                                                           compute_entropy=True)
    assert ent.requires_grad and ent.shape == (1, 3)
    trainer._entropy_bonus_enabled = False
    _, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3,
                                                           compute_entropy=True)
    assert not ent.requires_grad

    adaptive = GRPOTrainer(model=_model(seed=4)[0], processing_class=tok, reward_funcs=lambda completions, **_: [
        float(len(c)) for c in completions], train_dataset=ROWS, log=lambda *_: None,
        args=_cfg(tmp_path, learning_rate=0.05, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=4, max_steps=2, gradient_accumulation_steps=2, steps_per_generation=2,
                  entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=50.0, gradient_checkpointing=False))
    adaptive.train()
    assert adaptive.state.global_step == 2
    assert adaptive.entropy_coef == pytest.approx(0.01 + 0.005 * 2)


def test_dropin_runs_grove_forward_and_trls_fused_adamw(tmp_path):
    """TRL's defaults through the drop-in: the lean loss forward where it runs the model (not with gradient
    checkpointing), and transformers' default optim (adamw_torch_fused) as AdamW's fused kernel: the same update as
    optim="adamw_torch" up to float rounding."""
    def make(**kw):
        model, tok = _model(seed=5)
        return GRPOTrainer(model=model, processing_class=tok, reward_funcs=lambda completions, **_: [
            float(len(c)) for c in completions], train_dataset=ROWS, log=lambda *_: None,
            args=_cfg(tmp_path / ("_".join(kw) or "defaults"),
                      **{"learning_rate": 0.05, "per_device_train_batch_size": 4, "num_generations": 4,
                         "max_completion_length": 4, "max_steps": 1, "gradient_checkpointing": False, "seed": 0,
                         **kw}))

    fused, plain = make(), make(optim="adamw_torch")
    assert fused.trainer.domain._fast_train and plain.trainer.domain._fast_train
    assert all(g["fused"] for g in fused.trainer.optimizer.param_groups)
    assert not any(g["fused"] for g in plain.trainer.optimizer.param_groups)
    start = {n: p.detach().clone() for n, p in fused.model.named_parameters()}
    fused.train()
    plain.train()
    moved = 0.0
    for (n, a), b in zip(fused.model.named_parameters(), plain.model.parameters()):
        step = (a.detach() - start[n]).abs().max()
        moved = max(moved, float(step))
        assert (a.detach() - b.detach()).abs().max() <= 1e-5 * 0.05, n   # rounding, vs a step of ~lr
    assert moved > 0.01
    # the fused kernel leaves the version counters alone: the fast engine's snapshot is re-taken on the domain's
    # after-step flag, so the next rollout samples the updated weights (a stale snapshot would not equal them)
    domain = fused.trainer.domain
    domain._sync_engine()
    assert torch.equal(domain.engine.lm_head, fused.model.lm_head.weight.detach())
    assert torch.equal(domain.engine.layers[0].down, fused.model.model.layers[0].mlp.down_proj.weight.detach())
    checkpointed = make(gradient_checkpointing=True)
    assert not checkpointed.trainer.domain._fast_train   # auto: the model's own (checkpointed) forward
