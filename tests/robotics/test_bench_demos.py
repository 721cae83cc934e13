"""grove bench robotics-demos: the demo-count read-off and the K-demo subsets (the rows themselves are processes)."""
import math
from pathlib import Path

import numpy as np
import pytest

from bench.robotics_demos import TASKS, demo_subset, equivalent_demos, equivalent_success
from robotics.data import Episode, load_episodes, save_episodes


def test_equivalent_demos_reads_the_bc_curve_linearly_in_log_k():
    curve = {1: 0.2, 2: 0.4, 5: 0.6, 10: 0.8}
    assert equivalent_demos(curve, 0.5) == pytest.approx(math.sqrt(10))  # halfway from 2 to 5 in log K
    assert equivalent_demos(curve, 0.4) == pytest.approx(2.0)
    assert equivalent_demos(curve, 0.7) == pytest.approx(math.sqrt(50))
    assert equivalent_demos(curve, 0.1) == 1.0  # below the curve: its smallest K
    assert equivalent_demos(curve, 0.9) is None  # above BC at every measured K
    # a dip in the curve: the first K whose success reaches it
    assert equivalent_demos({1: 0.2, 2: 0.5, 5: 0.4, 10: 0.8}, 0.45) == pytest.approx(2 ** (0.25 / 0.3))


def test_equivalent_success_is_the_inverse_read_off():
    curve = {1: 0.2, 2: 0.4, 5: 0.6, 10: 0.8}
    assert equivalent_success(curve, math.sqrt(10)) == pytest.approx(0.5)
    assert equivalent_success(curve, 8) == pytest.approx(0.6 + 0.2 * math.log(8 / 5) / math.log(2))
    assert equivalent_success(curve, 0.5) == 0.2 and equivalent_success(curve, 40) == 0.8  # clamped to the curve


def test_assembled_table_reads_each_task_off_its_own_bc_curve_and_draws_the_picture(tmp_path, monkeypatch):
    """Per task "before -> after (K' on that task's BC curve)", the mean's K' and K'/K, and the picture beside the
    docs page; hand-computed from a two-point curve."""
    import json

    import bench.robotics_demos as bd

    def finished(run_dir, rec):
        (run_dir / "model").mkdir(parents=True)
        (run_dir / "model" / "model.safetensors").write_bytes(b"x")
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rec))

    # BC (seed 0 only): reach and push score 0.2 at K = 2 and 0.6 at K = 5; the other three 0.5 and 1.0
    for k, p, q in ((2, 0.2, 0.5), (5, 0.6, 1.0)):
        per_task = {t: p if t in ("reach-v3", "push-v3") else q for t in TASKS}
        finished(tmp_path / f"bc-K{k}-s0", [{"eval/success": np.mean(list(per_task.values())),
                                              **{f"eval/success/{t}": v for t, v in per_task.items()}}])
    after = {t: 0.4 for t in TASKS}
    after["push-v3"] = 0.1
    finished(tmp_path / "rl-grpo-K2-s0", [{"step": 1, "env/steps": 10, "eval/success": 0.4,
                                           **{f"eval/success/{t}": v for t, v in after.items()}}])
    (tmp_path / "rl-grpo-K2-s0" / "summary.txt").write_text("done")  # a finished RL row has its summary
    monkeypatch.setattr(bd, "DOC", tmp_path / "doc.md")
    monkeypatch.setattr(bd, "KS", (2, 5))
    res = bd.run(tmp_path, assemble=True)
    rl = next(r for r in res["rows"] if r["kind"] == "rl")
    kp = math.exp(math.log(2) + (0.4 - 0.38) / (0.84 - 0.38) * math.log(5 / 2))  # the mean curve: 0.38 -> 0.84
    assert rl["bc_equivalent_K"] == pytest.approx(round(kp, 1))
    assert rl["demo_multiplier"] == pytest.approx(round(kp / 2, 1))
    assert rl["reach-v3"] == f"0.20 -> 0.40 (K' {math.sqrt(10):.1f})"  # halfway from 0.2 to 0.6 in log K
    assert rl["push-v3"] == "0.20 -> 0.10 (K' 2.0)"  # below its curve: the smallest K
    assert rl["door-open-v3"] == "0.50 -> 0.40 (K' 2.0)"
    assert (tmp_path / "doc.png").stat().st_size > 10_000 and (tmp_path / "robotics_demos.png").is_file()


def test_demo_subset_takes_the_first_k_and_the_validation_demos_of_each_task(tmp_path):
    rng = np.random.default_rng(0)
    eps = [Episode(task=t, instruction=t, images=rng.integers(0, 255, (3, 8, 8, 3), dtype=np.uint8),
                   proprio=np.zeros((3, 4), np.float32), actions=np.zeros((3, 4), np.float32),
                   success=np.array([False, False, True]), key=100 * i + j)
           for i, t in enumerate(TASKS) for j in range(6)]
    pool = save_episodes(eps, tmp_path / "demos.npz")
    sub = load_episodes(demo_subset(pool, 2, 1, tmp_path))
    assert [e.key % 100 for e in sub] == [0, 1, 5] * len(TASKS)
    assert [e.task for e in sub] == [t for t in TASKS for _ in range(3)]
    only = load_episodes(demo_subset(pool, 2, 0, tmp_path))
    assert [e.key % 100 for e in only] == [0, 1] * len(TASKS), "RL's replay file: the K demos, no validation demo"
    with pytest.raises(ValueError, match="K=6 \\+ 1 validation"):
        demo_subset(pool, 6, 1, tmp_path / "other")


def test_assemble_reads_finished_rows_only_and_names_the_missing(tmp_path, monkeypatch):
    """--assemble runs nothing: a finished BC row is read back, the others are listed as not run."""
    import json

    import bench.robotics_demos as bd

    done = tmp_path / "bc-K1-s0"
    (done / "model").mkdir(parents=True)
    (done / "model" / "model.safetensors").write_bytes(b"x")
    rec = {"eval/success": 0.5, "eval/success_se": 0.02, "bc/best_step": 250, **{f"eval/success/{t}": 0.5 for t in TASKS}}
    (done / "metrics.jsonl").write_text(json.dumps(rec) + "\n")
    monkeypatch.setattr(bd, "_grove", lambda *a, **k: pytest.fail("--assemble must not start a run"))
    monkeypatch.setattr(bd, "DOC", tmp_path / "doc.md")
    res = bd.run(tmp_path, assemble=True)
    assert [(r["K"], r["seed"], r["success"]) for r in res["rows"]] == [(1, 0, 0.5)]
    assert "Not run yet" in res["notes"] and "BC K=40 seed 1" in res["notes"] and "RL grpo K=2 seed 0" in res["notes"]
    assert (tmp_path / "doc.md").is_file()


def test_row_filters_run_only_the_chosen_rows(tmp_path, monkeypatch):
    """--ks/--seeds: a second process can take other rows; the rows not chosen are read back or named as not run."""
    import json

    import bench.robotics_demos as bd

    rng = np.random.default_rng(0)
    eps = [Episode(task=t, instruction=t, images=rng.integers(0, 255, (3, 8, 8, 3), dtype=np.uint8),
                   proprio=np.zeros((3, 4), np.float32), actions=np.zeros((3, 4), np.float32),
                   success=np.array([False, False, True]), key=100 * i + j)
           for i, t in enumerate(TASKS) for j in range(8)]
    save_episodes(eps, tmp_path / "demos.npz")
    started = []

    def fake_grove(args, log_path):
        run_dir = Path(args[args.index("--out") + 1])
        started.append(run_dir.name)
        (run_dir / "model").mkdir(parents=True)
        (run_dir / "model" / "model.safetensors").write_bytes(b"x")
        rec = {"eval/success": 0.4, "eval/success_se": 0.02, **{f"eval/success/{t}": 0.4 for t in TASKS}}
        (run_dir / "metrics.jsonl").write_text(json.dumps(rec) + "\n")

    monkeypatch.setattr(bd, "_grove", fake_grove)
    monkeypatch.setattr(bd, "DOC", tmp_path / "doc.md")
    res = bd.run(tmp_path, only="bc", ks=(2,), seeds=(1,))
    assert started == ["bc-K2-s1"]
    assert [(r["K"], r["seed"]) for r in res["rows"]] == [(2, 1)]
    assert "BC K=1 seed 0" in res["notes"] and "BC K=2 seed 1" not in res["notes"]
    assert not (tmp_path / "doc.md").exists()  # a part never writes the docs page; --assemble does
    with pytest.raises(ValueError, match="unknown variant"):
        bd.run(tmp_path, only="rl", variants=("sac",))


def test_every_rl_variant_is_a_valid_config_that_differs_from_the_recipe_where_it_says():
    """A variant is a recipe plus overrides: a misspelt key must fail here, not 20 minutes into a row."""
    from bench.robotics_demos import RL_VARIANTS
    from shared_rl.config import apply_overrides, load_train_config, load_yaml

    root = Path(__file__).resolve().parents[2]
    kl = load_train_config(apply_overrides(load_yaml(root / RL_VARIANTS["grpo+kl"][0]), RL_VARIANTS["grpo+kl"][1]))
    assert kl.loss.kl_coef == pytest.approx(0.04)
    for name, (recipe, overrides) in RL_VARIANTS.items():
        base = load_yaml(root / recipe)
        replay = ["robotics.replay.data=demos-K2-only.npz"] if any("replay" in o for o in overrides) else []  # as rl_row
        cfg = load_train_config(apply_overrides(base, overrides + replay))
        assert cfg.domain == "robotics", name
        if name == "grpo":
            assert cfg.loss.kl_coef == 0.0 and cfg.domain_config.replay.coef == 0.0
            assert cfg.advantage.estimator.name == "grpo" and cfg.selection.max_refill_rounds == 0
            assert cfg.domain_config.adapters.rank > 0 and not cfg.domain_config.train_encoder
        if name == "grpo+keep-best+100it":
            assert cfg.iterations == 100 and cfg.domain_config.adapters.keep_best
        if name == "grpo+cosine":
            assert cfg.optim.schedule == "cosine"
        if name == "grpo+rloo":
            assert cfg.advantage.estimator.name == "rloo"
        if name == "grpo+dynamic":
            assert cfg.selection.filter == "band" and cfg.selection.max_refill_rounds == 2
        if name == "grpo+full":
            assert cfg.domain_config.adapters.rank == 0 and cfg.domain_config.train_encoder
