"""Issue 63: diffusion on-policy distillation (verl-omni ``DistillKLLoss``, docs/algo/diffusion_opd.md) — the loss
mean ‖μ_θ − μ_T‖²/(2σ_t²) and its gradient worked out by hand, alone and added to Flow-GRPO's clipped surrogate; on
the tiny pipeline a second tiny model as the frozen teacher: its replay of the student's stored states equals the
Gaussian-mean formula, the teacher never moves, is never checkpointed, a teacher equal to the student gives 0 at the
first step; a micro-batch split = the same gradient; a teacher of another family or scheduler and bad settings one
line (exit 2, from ``--dry-run`` too); the shapes and SD3.5-M recipes on the tiny pipeline."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_rl.config import ConfigError, LossConfig, load_train_config, load_yaml
from shared_rl.domain import StepLogProbs
from shared_rl.flow_kernels import sde_mean_kl
from shared_rl.losses import OPDSettings, opd_loss
from shared_rl.trainer import Trainer

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[2]
QUIET = {"logging": {"progress": False}, "eval": {"at_start": False}}
TINY_EVAL = {"max_prompts": 2, "samples_per_prompt": 1, "grid_prompts": 0}
TINY = dict(seed=0, sample_size=16, vae_channels=(8, 16), num_layers=1, num_heads=2, head_dim=8, text_hidden=16)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second tiny SD3 of the same family and scheduler, other weights (seed 1): the teacher."""
    from visgen import tiny
    from visgen.tasks.shapes import vocabulary

    return tiny.save_pipeline(tiny.build_pipeline(vocabulary(), **{**TINY, "seed": 1}),
                              tmp_path_factory.mktemp("opd") / "teacher")


def _cfg(tiny_dir, objective, **over):
    optim = {"lr": 1e-2, "minibatches_per_epoch": 1, **over.pop("optim", {})}
    return load_train_config({
        "domain": "visgen", "seed": 3, "iterations": 1,
        "rollout": {"groups_per_iteration": 2, "group_size": 4},
        "advantage": {"estimator": "grpo", "weights": {"shapes_strict": 0.0}},
        "loss": {"kl_coef": 0.0, **over.pop("loss", {})}, "optim": optim, **QUIET,
        "visgen": {"model": str(tiny_dir), "num_inference_steps": 4, "lora": {"rank": 4, "alpha": 8},
                   "method": {"name": "flow_grpo", "train_fraction": 0.5}, "objective": objective,
                   "eval": TINY_EVAL, **over},
    })


# ------------------------------------------------------------------------------------------------ the loss
def test_distill_kl_and_its_gradient_by_hand():
    """Two latent elements, σ_t = 0.5: μ_θ = (1, 2), μ_T = (0, 1) → KL = mean(1², 1²)/(2·0.25) = 2;
    ∂KL/∂μ_θ = (μ_θ − μ_T)/(σ²·D) = 1/(0.25·2) = 2 per element. Second step σ = 1, μ_θ − μ_T = (0.5, −1.5):
    KL = (0.25 + 2.25)/2/2 = 0.625. The loss per step is c·KL (c = 0.5), its token-mean (0.5·2 + 0.5·0.625)/2."""
    mu = torch.tensor([[1.0, 2.0], [0.5, -1.5]], requires_grad=True)
    mu_t = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    std = torch.tensor([0.5, 1.0])
    kl = sde_mean_kl(mu, mu_t, std)
    assert kl.tolist() == pytest.approx([2.0, 0.625])
    old_kl = kl.reshape(1, 2)  # one sample, two trained steps
    logp = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, st = opd_loss(logp, logp.detach(), torch.tensor([3.0]), mask, LossConfig(), OPDSettings(0.5),
                        StepLogProbs(logp=logp, old_kl=old_kl))
    assert loss.flatten().tolist() == pytest.approx([1.0, 0.3125])
    (loss.sum() / 2).backward()
    # d/dμ of 0.5·KL/2: 0.5·(μ − μ_T)/(σ²·D)/2
    assert mu.grad.flatten().tolist() == pytest.approx([0.5, 0.5, 0.0625, -0.1875])
    assert logp.grad is None or logp.grad.abs().sum() == 0  # pure distillation: the advantage plays no part
    assert st["ratio"].eq(1).all() and st["clipped"].eq(0).all()


def test_with_grpo_adds_the_clipped_surrogate():
    """ρ = e^0.3 > 1 + ε (ε 0.2) with A = 1: the surrogate is −A·1.2 (clipped, no gradient), plus c·KL = 2·0.1."""
    logp_old = torch.full((1, 1), -2.0)
    logp = (logp_old + 0.3).requires_grad_(True)
    kl = torch.tensor([[0.1]], requires_grad=True)
    loss, st = opd_loss(logp, logp_old, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                        LossConfig(clip_low=0.2), OPDSettings(2.0, with_grpo=True), StepLogProbs(logp=logp, old_kl=kl))
    assert loss.item() == pytest.approx(-1.2 + 0.2)
    loss.sum().backward()
    assert logp.grad.item() == 0.0 and kl.grad.item() == 2.0 and st["clipped"].item() == 1.0
    # the first inner step: ρ = 1, −A·∇logp flows
    logp2 = torch.tensor([[-1.0]], requires_grad=True)
    out, st2 = opd_loss(logp2, logp2.detach(), torch.tensor([0.7]), torch.ones(1, 1, dtype=torch.bool), LossConfig(),
                        OPDSettings(1.0, with_grpo=True), StepLogProbs(logp=logp2, old_kl=torch.zeros(1, 1)))
    out.sum().backward()
    assert st2["ratio"].item() == 1.0 and out.item() == pytest.approx(-0.7) and logp2.grad.item() == pytest.approx(-0.7)
    with pytest.raises(ConfigError, match="old_kl"):
        opd_loss(logp2, logp2.detach(), torch.tensor([0.7]), torch.ones(1, 1, dtype=torch.bool), LossConfig(),
                 OPDSettings(), StepLogProbs(logp=logp2))


# ------------------------------------------------------------------------------------------------ the domain
def test_the_teacher_replays_the_students_states(tiny_dir, teacher_dir):
    """Ratio 1 at the first inner step; ``old_kl`` is ‖μ_θ − μ_T‖²/(2σ²) (the Flow-GRPO KL with the teacher as the
    reference), positive at step one (other weights), with grad into the student's LoRA only; the teacher is a
    separate frozen transformer that an optimizer step and a new rollout leave as it was; checkpoints carry no
    teacher and no old copy."""
    tr = Trainer(_cfg(tiny_dir, {"name": "opd", "teacher": str(teacher_dir)}), None, log=lambda *_: None)
    dom, policy = tr.domain, tr.domain.policy
    assert policy.teacher is not None and policy.teacher is not policy.transformer
    ro = dom.rollout([0, 1], 4, torch.Generator().manual_seed(0), 0)
    idx = torch.arange(len(ro.mask))
    out = dom.log_probs(ro, idx, False)
    assert torch.equal(out.logp[ro.mask], ro.logp_old[ro.mask])
    assert (out.old_kl[ro.mask] > 0).all() and out.old_kl.requires_grad
    from visgen.pipelines.base import Conditioning
    from visgen.recompute import recompute_edges

    r = dom.rollouts
    p = ro.index_payload(idx)
    rec = recompute_edges(r.adapter, p, ro.mask, Conditioning(p["cond"], **r._cond_meta), r.kernel.kernel,
                          r.kernel.reduction, reference=policy.old_weights, kl_type="mean")
    assert torch.allclose(rec.kl.detach()[ro.mask], out.old_kl.detach()[ro.mask], rtol=1e-5, atol=1e-12)
    out.old_kl[ro.mask].mean().backward()
    assert all(q.grad is None for q in policy.teacher.parameters())
    assert sum(float(q.grad.abs().sum()) for q in policy.parameters() if q.grad is not None) > 0
    before = {n: t.clone() for n, t in policy.teacher.state_dict().items()}
    m = tr.iteration(0)
    assert m["loss/policy"] > 0 and m["nfe/train"] == 8 * 2 * 2  # 8 samples x 2 trained steps x (student + teacher)
    dom.rollout([0, 1], 4, torch.Generator().manual_seed(1), 1)
    assert all(torch.equal(before[n], t) for n, t in policy.teacher.state_dict().items())
    state = policy.state_dict()
    assert not any(k.startswith("old.") for k in state) and policy.OLD_SYNCED not in state
    policy.load_state_dict(state)  # round trip


def test_a_teacher_equal_to_the_student_gives_zero(tiny_dir):
    tr = Trainer(_cfg(tiny_dir, {"name": "opd", "teacher": str(tiny_dir)}), None, log=lambda *_: None)
    m = tr.iteration(0)
    assert m["loss/policy"] == 0.0 and m["ratio/mean"] == 1.0


def test_a_micro_batch_split_trains_the_same_update(tiny_dir, teacher_dir):
    def weights(objective=None, **optim):
        tr = Trainer(_cfg(tiny_dir, objective or {"name": "opd", "teacher": str(teacher_dir)}, optim=optim), None,
                     log=lambda *_: None)
        tr.iteration(0)
        return {n: p.detach().clone() for n, p in tr.domain.policy._named_trainable()}

    whole, split, steps = weights(micro_batch_size=0), weights(micro_batch_size=3), weights(backward_steps=1)
    assert all(torch.allclose(whole[n], split[n], atol=1e-6) for n in whole)
    assert all(torch.allclose(whole[n], steps[n], atol=1e-6) for n in whole)
    grpo = weights({"name": "opd", "teacher": str(teacher_dir), "with_grpo": True})
    assert any(not torch.allclose(whole[n], grpo[n]) for n in whole)  # the surrogate adds its own gradient


# ------------------------------------------------------------------------------------------------ bad settings
@pytest.mark.parametrize("objective, message", [
    ({"name": "opd"}, "teacher is required"),
    ({"name": "opd", "teacher": "TEACHER", "distill_coef": 0.0}, "distill_coef must be > 0"),
    ({"name": "opd", "teacher": "TINY"}, None),  # a pipeline directory: accepted at parse
])
def test_bad_settings_are_one_line(tiny_dir, teacher_dir, objective, message):
    objective = {k: {"TEACHER": str(teacher_dir), "TINY": str(tiny_dir)}.get(v, v) for k, v in objective.items()}
    if message is None:
        _cfg(tiny_dir, objective)
        return
    with pytest.raises(ConfigError, match=message) as info:
        _cfg(tiny_dir, objective)
    assert "\n" not in str(info.value)


def test_a_teacher_that_is_no_pipeline_is_one_line(tiny_dir, tmp_path):
    """A directory without model_index.json: at parse (dry run too); a path that does not exist: when it loads."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a diffusers pipeline") as info:
        _cfg(tiny_dir, {"name": "opd", "teacher": str(tmp_path / "empty")})
    assert "\n" not in str(info.value)
    cfg = _cfg(tiny_dir, {"name": "opd", "teacher": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="teacher: model path .* does not exist") as info:
        Trainer(cfg, None, log=lambda *_: None)
    assert "\n" not in str(info.value)


def test_a_teacher_of_another_family_or_scheduler_is_one_line(tiny_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from visgen import tiny
    from visgen.tasks.shapes import vocabulary

    from .conftest import build_flux, ready

    flux = tmp_path / "flux"
    ready(build_flux()).save_pretrained(flux)
    shifted = tiny.build_pipeline(vocabulary(), **TINY)
    shifted.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    shifted_dir = tiny.save_pipeline(shifted, tmp_path / "shifted")
    from shared_rl.preflight import preflight

    for path, message in ((flux, "is a FluxPipeline, the student a StableDiffusion3Pipeline"),
                          (shifted_dir, r"another scheduler than the student \(differs in \['shift'\]\)")):
        cfg = _cfg(tiny_dir, {"name": "opd", "teacher": str(path)})
        with pytest.raises(ConfigError, match=message) as info:  # from the files, before anything loads (--dry-run)
            preflight(cfg)
        assert "\n" not in str(info.value)
        with pytest.raises(ConfigError, match=message) as info:  # and when the weights load
            Trainer(cfg, None, log=lambda *_: None)
        assert "\n" not in str(info.value)
    preflight(_cfg(tiny_dir, {"name": "opd", "teacher": str(tiny_dir)}))  # the same family and scheduler pass
    preflight(_cfg(tiny_dir, {"name": "opd", "teacher": str(tmp_path / "not-made-yet")}))  # left to the load


def test_cli_exits_2_with_one_line(tiny_dir, tmp_path):
    dry = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_opd.yaml", "--dry-run",
                          "visgen.objective.distill_coef=0"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 2 and "distill_coef must be > 0" in dry.stderr
    assert len(dry.stderr.strip().splitlines()) == 1
    from .conftest import build_flux, ready

    flux = tmp_path / "flux"
    ready(build_flux()).save_pretrained(flux)
    dry = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_opd.yaml", "--dry-run",
                          f"visgen.model={tiny_dir}", f"visgen.objective.teacher={flux}"], cwd=REPO,
                         capture_output=True, text=True)
    assert dry.returncode == 2 and "is a FluxPipeline" in dry.stderr, dry.stderr[-2000:]
    assert len(dry.stderr.strip().splitlines()) == 1
    run = subprocess.run([sys.executable, "-m", "shared_rl.cli", "train", "configs/visgen/shapes_opd.yaml",
                          "--out", str(tmp_path / "run"), f"visgen.model={tiny_dir}", f"visgen.objective.teacher={flux}",
                          "iterations=1"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and "is a FluxPipeline" in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------ recipes
@pytest.mark.parametrize("name", ["shapes_opd", "sd35_opd"])
def test_recipes_parse_and_run_two_iterations_on_the_tiny_pipeline(name, tiny_dir, teacher_dir):
    data = load_yaml(REPO / "configs" / "visgen" / f"{name}.yaml")
    data["visgen"]["objective"]["teacher"] = str(teacher_dir)  # the shipped path needs a trained teacher
    recipe = load_train_config(data)
    choice = recipe.policy_loss_choice()
    assert choice.name == "opd" and choice.settings.distill_coef == 1.0 and not choice.settings.with_grpo
    assert recipe.loss.kl_coef == 0.0 and recipe.loss.aggregation == "token-mean"
    data.update(device="cpu", iterations=2, **QUIET)
    data["rollout"] = {"groups_per_iteration": 2, "group_size": 4}
    data["checkpoint"] = {"every": 0}
    data["advantage"].pop("weights", None)
    data["optim"]["micro_batch_size"] = 0
    reward = {"name": "shapes_soft"} if name.startswith("shapes") else {"name": "jpeg_compressibility"}
    data["visgen"].update(model=str(tiny_dir), dtype="float32", num_inference_steps=4, rewards=[reward],
                          eval=TINY_EVAL, task="shapes")
    data["visgen"]["method"] = {"name": "flow_grpo", "train_fraction": 0.5}
    for key in ("train_prompts", "eval_prompts", "resolution", "max_sequence_length", "rollout_micro_batch"):
        data["visgen"].pop(key, None)
    tr = Trainer(load_train_config(data), None, log=lambda *_: None)
    ms = [tr.iteration(it) for it in range(2)]
    assert all(math.isfinite(m["loss/policy"]) and m["grad_norm"] > 0 for m in ms)
    assert ms[1]["loss/policy"] < ms[0]["loss/policy"] * 1.5


def test_merge_teacher_turns_a_lora_run_into_a_teacher_with_the_same_velocity(tiny_dir, tmp_path):
    """``visgen.tiny.merge_teacher``: a LoRA export fused into a full pipeline directory; the teacher's transformer
    gives the trained student's velocity (to float rounding) and carries no adapter."""
    from visgen.policy import FlowPolicy, LoraSettings
    from visgen.tiny import load_shapes_asset, merge_teacher

    pipe = load_shapes_asset(tiny_dir)
    policy = FlowPolicy(pipe, "lora", LoraSettings(rank=4, alpha=8))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.save_pretrained(tmp_path / "final", info={"base_model": str(tiny_dir)})
    out = merge_teacher(tmp_path / "final", tmp_path / "teacher")
    teacher = load_shapes_asset(out)
    assert not any("lora" in n for n, _ in teacher.transformer.named_parameters())
    x = torch.randn(2, 4, 8, 8)
    kw = dict(timestep=torch.tensor([500.0, 250.0]), encoder_hidden_states=torch.randn(2, 2, 32),
              pooled_projections=torch.randn(2, 32), return_dict=False)
    with torch.no_grad():
        v_student, v_teacher = policy.transformer(x, **kw)[0], teacher.transformer(x, **kw)[0]
        with policy.reference():
            v_base = policy.transformer(x, **kw)[0]
    assert torch.allclose(v_student, v_teacher, atol=1e-5)
    assert not torch.allclose(v_base, v_teacher, atol=1e-3)  # the LoRA was merged, not dropped


def test_resume_equals_the_uninterrupted_run(tmp_path, tiny_dir, teacher_dir):
    """Killed in the third iteration and resumed: the teacher is reloaded from its path (no checkpoint entry), the
    student's weights and records equal the uninterrupted run's."""
    from tests.resume_harness import resume_mismatches

    data = load_yaml(REPO / "configs" / "visgen" / "shapes_opd.yaml")
    data.update(eval={"at_start": False, "every": 0}, rollout={"groups_per_iteration": 2, "group_size": 2})
    data["optim"]["backward_steps"] = 0
    data["visgen"].update(num_threads=1, num_inference_steps=4, model=str(tiny_dir),
                          eval={"max_prompts": 1, "samples_per_prompt": 1, "grid_prompts": 0},
                          method={"name": "flow_grpo", "train_fraction": 0.5})
    data["visgen"]["objective"]["teacher"] = str(teacher_dir)
    bad = resume_mismatches(data, tmp_path)
    assert not bad, "\n".join(bad[:20])
