"""grove bench robotics-libero-rl: how a row is read back (the rows themselves are LIBERO processes)."""
import json

import numpy as np
import pytest

import bench.robotics_libero_rl as bl


def test_the_verdict_is_two_paired_standard_errors():
    assert bl.verdict(0.15, 0.05) == "gain" and bl.verdict(-0.15, 0.05) == "loss"
    assert bl.verdict(0.09, 0.05) == "inside the band" and bl.verdict(-0.1, 0.05) == "inside the band"
    assert bl.verdict(0.0, 0.0) == "no change"


def _finished_rl(out, variant, seed, before, after_success, delta, se):
    clone = bl.clone_dir(out, bl.RL_K)
    clone.mkdir(parents=True, exist_ok=True)
    (clone / "eval_episodes.json").write_text(json.dumps({"success": before}))
    run = out / f"rl-{variant}-K{bl.RL_K}-s{seed}"
    run.mkdir(parents=True)
    (run / "final").mkdir()
    recs = [{"step": 1, "env/steps": 1000, "time/iteration": 60.0},
            {"step": 2, "env/steps": 1500, "time/iteration": 60.0, "time/eval": 120.0, "eval/success": after_success,
             "eval/success_delta": delta, "eval/success_delta_se": se,
             "eval/success/libero_spatial/0": 0.6, "eval/success_delta/libero_spatial/0": 0.2,
             "eval/success_delta_se/libero_spatial/0": 0.07}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_an_rl_row_reads_the_paired_change_and_its_cost(tmp_path):
    _finished_rl(tmp_path, "grove", 0, [True, False, False, True], 0.75, 0.25, 0.1)
    row = bl.rl_row(tmp_path, bl.RL_K, 0, "grove", [], {"assemble": True})
    assert row["success_before"] == 0.5 and row["success"] == 0.75
    assert (row["paired_delta"], row["paired_se"], row["verdict"]) == (0.25, 0.1, "gain")
    assert row["env_steps"] == 2500 and row["wall_min"] == 4.0
    assert row["libero_spatial/0"] == "0.40 -> 0.60 (+0.20 ± 0.07)"
    assert bl.rl_row(tmp_path, bl.RL_K, 1, "grove", [], {"assemble": True}) is None, "not run: nothing to read"


def test_rl_from_few_demos_is_compared_with_bc_from_twenty():
    rows = [{"kind": "bc", "K": 20, "success": 0.6}, {"kind": "rl", "variant": "RL grove from K=5", "success": 0.7},
            {"kind": "rl", "variant": "RL grove from K=5", "success": 0.4}]
    assert bl.compare_with_bc(rows) == ["RL grove from K=5: 0.550 over 2 seed(s) < BC from K=20 (0.600)"]
    assert bl.compare_with_bc(rows[1:]) == [], "no BC K=20 row yet: no comparison"


def test_the_variants_are_valid_configs_with_their_settings():
    """Each variant is the recipe + overrides that parse, and each says what it claims (broken once: fails)."""
    import yaml

    from shared_rl.config import apply_overrides, load_train_config

    def recipe(v):
        return yaml.safe_load((bl.ROOT / bl.VARIANT_RECIPES.get(v, bl.RL_RECIPE)).read_text())

    cfgs = {v: load_train_config(apply_overrides(recipe(v), [x.replace("{demos}", "d.npz") for x in o]))
            for v, o in bl.RL_VARIANTS.items()}
    g, sv, ript, pirl = (cfgs[v] for v in ("grove", "simplevla", "ript-loop", "pirl"))
    assert g.rollout.groups_per_iteration * g.rollout.group_size == 64 and g.domain_config.adapters.steps == "by_episodes"
    assert sv.selection.filter == "band" and list(sv.selection.band) == [0.1, 0.9] and sv.selection.max_refill_rounds == 4
    assert ript.advantage.estimator.name == "rloo" and ript.loss.clip_low == ript.loss.clip_high == 0.1
    assert ript.optim.inner_epochs == 8 and ript.optim.lr == pytest.approx(5e-5)
    crn = cfgs["ript-loop+shared-start"]
    assert crn.domain_config.group_start_noise == "shared" and ript.domain_config.group_start_noise == "independent"
    assert crn.optim.lr == ript.optim.lr and crn.advantage.estimator.name == "rloo"
    assert pirl.domain_config.noise_level == 0.5 and pirl.domain_config.head_mode == "sde_one_step"
    assert g.domain_config.env.tasks == bl.TASKS
    assert cfgs["grove+kl"].loss.kl_coef == 0.04 and g.loss.kl_coef == 0
    ex, ex0 = cfgs["explorer"], cfgs["explorer-no-ranker"]
    assert ex.domain_config.rollout.name == ex0.domain_config.rollout.name == "verified"
    assert ex.domain_config.rollout.verify.score == "ranker" and ex0.domain_config.rollout.verify.score == "prob"
    assert ex.domain_config.env.tasks == bl.TASKS and ex.domain_config.checkpoint == g.domain_config.checkpoint
    assert (ex.advantage.estimator.name, ex.loss.clip_low, ex.optim.lr, ex.optim.inner_epochs) == \
        (ript.advantage.estimator.name, ript.loss.clip_low, ript.optim.lr, ript.optim.inner_epochs), "LOOP, as ript-loop"
    fbc = cfgs["filtered-bc"]  # no policy gradient: the BC term on the run's successes, every state, nothing dropped
    assert fbc.loss.policy_coef == 0 and g.loss.policy_coef == 1.0 and fbc.domain_config.replay.source == "successes"
    assert fbc.domain_config.replay.coef == 1.0 and fbc.domain_config.adapters.steps == "equal"
    assert (fbc.selection.filter, fbc.selection.max_refill_rounds, fbc.optim.inner_epochs) == ("none", 0, 32)
    replay = cfgs["grove+replay"].domain_config.replay
    assert replay.coef == 1.0 and replay.data == "d.npz" and g.domain_config.replay.coef == 0


def test_the_null_control_keeps_each_adapters_size_and_loses_its_direction():
    import torch

    from robotics.policies.vla import TinyVLA, VLAConfig

    policy = TinyVLA(VLAConfig(cnn_channels=[8, 8, 8, 8], feature_dim=32, text_dim=8, hidden=64))
    policy.add_task_adapters(["a", "b", "c"], 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        policy.adapters.up[0].fill_(0.5)
        policy.adapters.up[1].normal_()
    before = policy.adapters.up.detach().clone()
    down = policy.adapters.down.detach().clone()
    norms = bl.random_adapters_like(policy, torch.Generator().manual_seed(1))
    after = policy.adapters.up.detach()
    assert norms == pytest.approx([float(before[t].norm()) for t in range(3)])
    for t in range(3):
        assert float(after[t].norm()) == pytest.approx(float(before[t].norm()), rel=1e-5)
    assert not torch.allclose(after[0], before[0]) and float(after[2].abs().max()) == 0, "a zero adapter stays zero"
    assert torch.equal(policy.adapters.down, down)


def test_a_longer_budget_goes_on_from_the_longest_finished_shorter_row(tmp_path):
    """rl-V-K5-s0-it12 extends the finished row with the most iterations below 12 whose last checkpoint is kept;
    an unfinished row, a longer one, or one without its last checkpoint is not a start."""
    def row(its, final=True, last_checkpoint=True):
        d = tmp_path / f"rl-grove-K5-s0-it{its}"
        (d / "checkpoints" / f"step_{its - (0 if last_checkpoint else 1):06d}").mkdir(parents=True)
        if final:
            (d / "final").mkdir()
        return d

    assert bl.shorter_row(tmp_path, "rl-grove-K5-s0-it12", 12) is None
    four = row(4)
    row(8, final=False)
    row(6, last_checkpoint=False)
    row(16)
    (tmp_path / "rl-grove-K5-s1-it9").mkdir()
    assert bl.shorter_row(tmp_path, "rl-grove-K5-s0-it12", 12) == four
    assert bl.shorter_row(tmp_path, "rl-grove-K5-s0-it4", 4) is None


def test_the_smolvla_row_pairs_with_its_own_first_evaluation(tmp_path):
    """before = the run's iteration-0 evaluation of the SmolVLA clone, after = its last; the paired change and the
    cost are the run's own."""
    run = tmp_path / f"rl-smolvla-{bl.SMOLVLA_VARIANT}-K5-s0-it4"
    (run / "final").mkdir(parents=True)
    recs = [{"step": 0, "eval/success": 0.25, "eval/success/libero_spatial/0": 0.1, "time/eval": 300.0},
            {"step": 1, "env/steps": 9000, "time/iteration": 240.0},
            {"step": 4, "env/steps": 8000, "time/iteration": 240.0, "time/eval": 300.0, "eval/success": 0.4,
             "eval/success_delta": 0.15, "eval/success_delta_se": 0.05, "eval/success/libero_spatial/0": 0.3,
             "eval/success_delta/libero_spatial/0": 0.2, "eval/success_delta_se/libero_spatial/0": 0.08}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = bl.smolvla_row(tmp_path, 5, 0, 4, {"assemble": True, "quick": False})
    assert (row["success_before"], row["success"], row["paired_delta"], row["verdict"]) == (0.25, 0.4, 0.15, "gain")
    assert row["env_steps"] == 17000 and row["wall_min"] == 18.0 and row["iterations"] == 4
    assert row["libero_spatial/0"] == "0.10 -> 0.30 (+0.20 ± 0.08)"
    assert bl.smolvla_row(tmp_path, 5, 0, 8, {"assemble": True, "quick": False}) is None


def test_the_gradient_noise_row_is_the_ratio_of_the_iterations_means(tmp_path):
    """noise scale = mean(noise_trace) / mean(signal_sq) over the run's iterations (not the mean of the ratios)."""
    run = tmp_path / "gradnoise-ript-loop-K5-s0"
    (run / "final").mkdir(parents=True)
    recs = [{"step": 1, "env/steps": 9000, "env/episodes": 64, "grad/signal_sq": 1e-4, "grad/noise_trace": 0.2,
             "grad/half_cosine": 0.01},
            {"step": 2, "env/steps": 8000, "env/episodes": 64, "grad/signal_sq": 3e-4, "grad/noise_trace": 0.2,
             "grad/half_cosine": 0.03},
            {"step": 2, "eval/success": 0.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    row = bl.gradnoise_row(tmp_path, 5, 0, "ript-loop", bl.RL_VARIANTS["ript-loop"], {"assemble": True, "quick": False})
    assert row["noise_scale"] == pytest.approx(0.2 / 2e-4) and row["half_cosine"] == pytest.approx(0.02)
    se = 1e-4 * 2 ** 0.5 / 2 ** 0.5  # the sd of (1e-4, 3e-4) is sqrt(2)*1e-4, over sqrt(2) iterations
    assert row["signal_sq_se"] == pytest.approx(se) and row["noise_scale_min"] == pytest.approx(0.2 / (2e-4 + 2 * se))
    assert row["per_iteration"] == [2000, 667] and row["episodes_per_update"] == 64 and row["env_steps"] == 17000
    assert bl.gradnoise_row(tmp_path, 5, 0, "ript-loop+shared-start", [], {"assemble": True, "quick": False}) is None


def test_a_fresh_output_directory_assembles_every_kept_row_and_runs_none_of_them_again(tmp_path, monkeypatch):
    """A fresh machine has no run directories: --assemble must still table every row of earlier sittings (from the
    committed rows file), list none of them as not run, and a part run must read a kept row back, not re-measure it."""
    kept = [{"variant": "BC, K=5", "kind": "bc", "K": 5, "seed": 0, "success": 0.62},
            {"variant": "RL grove from K=5, 6 iterations", "kind": "rl", "K": 5, "run_dir": "rl-grove-K5-s0-it6",
             "seed": 0, "success_before": 0.62, "success": 0.635, "paired_delta": 0.015, "paired_se": 0.03},
            {"variant": "BC K=5 clone: sd over 2 start-noise seeds", "kind": "noise_sd", "K": 5, "success": 0.03}]
    rows_file = tmp_path / "page.rows.json"
    rows_file.write_text(json.dumps(kept))
    monkeypatch.setattr(bl, "DOC", tmp_path / "page.md")
    monkeypatch.setattr(bl, "_run", lambda *a, **k: pytest.fail(f"a kept row was measured again: {a}"))
    res = bl.run(tmp_path / "out", assemble=True, rows_file=rows_file)
    by = {r["variant"]: r for r in res["rows"]}
    assert by["RL grove from K=5, 6 iterations"]["success"] == 0.635 and by["BC, K=5"]["success"] == 0.62
    assert "BC K=5 clone: sd over 2 start-noise seeds" in by
    assert "| RL grove from K=5, 6 iterations |" in (tmp_path / "page.md").read_text()
    assert "BC K=5 seed 0" not in res["notes"], "a kept row is not 'not run yet'"
    written = json.loads(rows_file.read_text())
    assert all(r in written for r in kept), "the rows file keeps every row"
    # the same row asked for again in a part run: read back from the kept rows, no process started
    part = bl.run(tmp_path / "out", only="rl", variants=("grove",), seeds=(0,), iterations=6, rows_file=rows_file)
    assert [r["success"] for r in part["rows"] if r.get("run_dir") == "rl-grove-K5-s0-it6"] == [0.635]
