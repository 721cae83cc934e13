"""The visgen-methods benchmark: every variant is a valid config of the demo recipe, and its reading rules (noise
band, first reach, speedups) are computed as documented."""
import pytest

from bench.visgen_methods import MIN_BAND, VARIANTS, first_reach, noise_band, rows_from, variant_config
from shared_rl.config import load_train_config

SHORT_NAMES = {"flat", "dance", "fast", "mix", "branch", "branch-prune", "branch-mix", "tree", "egrpo", "nft", "awm",
               "dgpo", "guard", "dpo", "flowdppo", "opsd", "opd", "crd"}
# issue 63's five: the bench row's short name -> (its shapes recipe, the policy loss it builds)
ISSUE_63 = {"dpo": ("shapes_dpo.yaml", "dpo"), "flowdppo": ("shapes_flowdppo.yaml", "flow_dppo"),
            "opsd": ("shapes_diffusion_opsd.yaml", "diffusion_opsd"), "opd": ("shapes_opd.yaml", "opd"),
            "crd": ("shapes_crd.yaml", "crd")}


def test_every_method_is_a_valid_demo_config():
    assert set(VARIANTS) == SHORT_NAMES
    for name in set(VARIANTS) - set(ISSUE_63):
        cfg = load_train_config(variant_config(name, 0, 3, quick=False))
        assert cfg.rollout.groups_per_iteration == 32, name  # the demo's 512-image scale for every method
        assert cfg.domain_config.eval.samples_per_prompt == 4
        # one optimizer step per batch (the demo's) except the likelihood-free objectives' tuned 8
        assert cfg.optim.minibatches_per_epoch == (8 if name in ("nft", "awm") else 1), name
    assert load_train_config(variant_config("nft", 0, 3, False)).policy_loss_choice().name == "nft"
    assert load_train_config(variant_config("dgpo", 0, 3, False)).policy_loss_choice().name == "dgpo"
    assert load_train_config(variant_config("egrpo", 0, 3, False)).advantage.multi_reward == "normalize_then_sum"


def test_noise_band_first_reach_and_speedups():
    assert noise_band([0.5]) == MIN_BAND and noise_band([0.5, 0.6, 0.55]) == pytest.approx(0.1)
    pts = [{"nfe": 0, "time": 0, "score": 0.5}, {"nfe": 100, "time": 10, "score": 0.6},
           {"nfe": 200, "time": 20, "score": 0.8}]
    assert first_reach(pts, 0.7) == pytest.approx((150, 15))
    assert first_reach(pts, 0.9) == (None, None)
    flat = [{"points": [{"nfe": 0, "time": 0, "score": 0.5}, {"nfe": 400, "time": 40, "score": 0.7}],
             "iterations": 4, "images": 2048, "nfe": 400, "time": 40}]
    fast = {"points": pts, "iterations": 2, "images": 1024, "nfe": 200, "time": 20}
    rows, s = rows_from({"flat": flat, "nft": [fast]}, 400)
    assert s["signal"] and s["flat_final"] == pytest.approx(0.7)
    nft = [r for r in rows if r["variant"] == "nft"][0]
    assert nft["nfe_to_flat_final"] == pytest.approx(150) and nft["speedup_nfe_vs_flat"] == pytest.approx(400 / 150)
    assert nft["speedup_time_vs_flat"] == pytest.approx(40 / 15)
    # a flat rise inside the band defines no speedup
    flat[0]["points"][-1]["score"] = 0.52
    rows, s = rows_from({"flat": flat, "nft": [fast]}, 400)
    assert not s["signal"] and all(r["speedup_nfe_vs_flat"] is None for r in rows)


def test_flat_runs_are_reused_only_at_the_same_sizes(tmp_path):
    import json

    from bench.visgen_methods import _save_partial, load_runs
    from shared_rl.errors import ConfigError

    run = {"points": [{"iteration": 0, "nfe": 0, "time": 0, "score": 0.5},
                      {"iteration": 5, "nfe": 50, "time": 5, "score": 0.55},
                      {"iteration": 10, "nfe": 100, "time": 10, "score": 0.6}],
           "iterations": 10, "images": 5120, "nfe": 100, "time": 10}
    short = {**run, "iterations": 7}
    _save_partial(tmp_path, {"flat": [run], "nft": [short]})
    assert load_runs([tmp_path / "partial.json"], 10, 5) == {"flat": [run], "nft": [short]}
    # the same run in two files (a partial.json repeats what it reused) counts once
    assert load_runs([tmp_path / "partial.json"] * 2, 10, 5) == {"flat": [run], "nft": [short]}
    with pytest.raises(ConfigError, match="needs 30 iterations"):
        load_runs([tmp_path / "partial.json"], 30, 5)
    with pytest.raises(ConfigError, match="evaluated every 2"):
        load_runs([tmp_path / "partial.json"], 10, 2)
    (tmp_path / "old.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ConfigError, match="no runs"):
        load_runs([tmp_path / "old.json"], 10, 5)


def test_probe_overrides_reach_the_config():
    cfg = load_train_config(variant_config("awm", 0, 3, False, overrides=["optim.lr=3e-3",
                                                                         "visgen.num_inference_steps=7"]))
    assert cfg.optim.lr == pytest.approx(3e-3) and cfg.domain_config.num_inference_steps == 7


def test_two_stage_bench_takes_reused_seeds_and_runs_only_the_missing(tmp_path, monkeypatch):
    import bench.visgen_methods as vm
    from bench import visgen_two_stage as ts

    def run(seed, score):
        return {"points": [{"iteration": 0, "nfe": 0, "time": 0, "score": 0.5},
                           {"iteration": 5, "nfe": 50, "time": 5, "score": score}],
                "iterations": 5, "images": 10, "nfe": 50, "time": 5}

    vm._save_partial(tmp_path, {"flat": [run(0, 0.6)], "two-stage-nvfp4-nft": [run(0, 0.7)]})
    calls = []
    monkeypatch.setattr(vm, "run_variant", lambda name, seed, *a, **k: calls.append((name, seed)) or run(seed, 0.65))
    res = ts.run(tmp_path / "out", variants=["two-stage-nvfp4-nft"], flat_iters=5, flat_seeds=1, eval_every=5,
                 reuse=[tmp_path / "partial.json"], variant_seeds=2, write_doc=False, log=lambda s: None)
    assert calls == [("two-stage-nvfp4-nft", 1)]  # seed 0 reused, seed 1 run
    assert [r["seed"] for r in res["rows"] if r["variant"] == "two-stage-nvfp4-nft"] == [0, 1]


def test_a_second_seed_stream_joins_the_table_as_seed_1(tmp_path, monkeypatch):
    """``--flat-seeds 0 --budget-nfe B --seed 1`` runs the variant's seed 1; reusing the seed-0 and seed-1 streams
    gives both rows, and the best method's second seed is then not re-run."""
    import bench.visgen_methods as vm

    def run(score):
        return {"points": [{"iteration": 0, "nfe": 0, "time": 0, "score": 0.5},
                           {"iteration": 5, "nfe": 50, "time": 5, "score": score}],
                "iterations": 5, "images": 10, "nfe": 50, "time": 5}

    calls = []
    monkeypatch.setattr(vm, "run_variant", lambda name, seed, *a, **k: calls.append((name, seed)) or run(0.6 + seed / 10))
    vm.run(tmp_path / "s1", variants=["tree"], flat_iters=5, flat_seeds=0, eval_every=5, budget_nfe=50,
           variant_seed=1, write_doc=False, log=lambda s: None)
    assert calls == [("tree", 1)]
    (tmp_path / "s0").mkdir()
    vm._save_partial(tmp_path / "s0", {"flat": [run(0.55)], "tree": [run(0.6)]})
    res = vm.run(tmp_path / "out", variants=["tree"], flat_iters=5, flat_seeds=1, eval_every=5, best_seeds=2,
                 reuse=[tmp_path / "s0" / "partial.json", tmp_path / "s1" / "partial.json"], write_doc=False,
                 log=lambda s: None)
    assert calls == [("tree", 1)]  # nothing more was run
    assert [r["strict_at_budget"] for r in res["rows"] if r["variant"] == "tree"] == [0.6, 0.7]


def test_probe_overrides_come_last_so_step_clip_frac_survives():
    cfg = load_train_config(variant_config("guard", 0, 3, False, overrides=["logging.step_clip_frac=true",
                                                                           "optim.minibatches_per_epoch=4"]))
    assert cfg.logging.step_clip_frac and not cfg.logging.progress and cfg.optim.minibatches_per_epoch == 4


def test_a_table_assembled_from_reused_runs_says_what_they_took_not_this_call(tmp_path):
    """A table made with --reuse took seconds itself; its page sums the runs' recorded time and names --reuse."""
    import bench.visgen_methods as vm

    run = {"points": [{"iteration": 0, "nfe": 0, "time": 0, "score": 0.5},
                      {"iteration": 5, "nfe": 50, "time": 600, "score": 0.6}],
           "iterations": 5, "images": 10, "nfe": 50, "time": 600}
    vm._save_partial(tmp_path, {"flat": [run], "tree": [{**run, "time": 1200}]})
    res = vm.run(tmp_path / "out", variants=["tree"], flat_iters=5, flat_seeds=1, eval_every=5, best_seeds=1,
                 reuse=[tmp_path / "partial.json"], write_doc=False, log=lambda s: None)
    notes = (tmp_path / "out" / "results.md").read_text()
    assert "2 runs, most reused from earlier calls: their rollout + training time sums to 30 min" in notes
    assert "--reuse" in notes and "total 0.0 min" not in notes
    assert vm.time_note({"flat": [run]}, 90.0, reused=False) == "total 1.5 min"


def test_issue_63_rows_are_their_own_shapes_recipes():
    """Online DPO, Flow-DPPO, DiffusionOPSD, diffusion OPD and CRD are bench rows; each row is its shapes recipe as
    shipped (the authors' defaults at the demo's scale) with only the bench's fixed settings, and OPD's teacher is
    the one the bench names (flat seed 0's policy, merged)."""
    import bench.visgen_methods as vm
    from shared_rl.config import load_yaml
    from shared_rl.errors import ConfigError

    assert {n: vm.RECIPES[n] for n in ISSUE_63} == {n: r for n, (r, _) in ISSUE_63.items()}
    for name, (recipe, loss) in ISSUE_63.items():
        shipped = load_yaml(vm.RECIPE.parent / recipe)
        data = variant_config(name, 0, 3, quick=False, overrides=vm.teacher_overrides(name, "T/teacher"))
        assert data["visgen"]["objective"] == {**shipped["visgen"]["objective"],
                                                **({"teacher": "T/teacher"} if name == "opd" else {})}, name
        for part in ("rollout", "advantage", "loss", "optim"):
            assert data[part] == shipped[part], (name, part)
        assert data["iterations"] == 3 and data["eval"] == {"at_start": False} and data["checkpoint"] == {"every": 0}
        cfg = load_train_config(data)
        assert cfg.policy_loss_choice().name == loss, name
        assert cfg.domain_config.eval.samples_per_prompt == 4 and cfg.domain_config.model == "assets/shapes-sd3-tiny"
    assert vm.teacher_overrides("dpo", None) is None
    with pytest.raises(ConfigError, match="--teacher"):
        vm.teacher_overrides("opd", None)


def test_a_probe_file_is_reused_as_its_variants_run(tmp_path):
    """A flat seed run as ``--probe flat`` in its own process joins the table through --reuse."""
    import json

    from bench.visgen_methods import load_runs

    run = {"points": [{"iteration": 0, "nfe": 0, "time": 0, "score": 0.5},
                      {"iteration": 5, "nfe": 50, "time": 5, "score": 0.55}],
           "iterations": 5, "images": 10, "nfe": 50, "time": 5, "variant": "flat", "overrides": [], "seed": 1}
    (tmp_path / "flat_base_s1.json").write_text(json.dumps(run))
    assert load_runs([tmp_path / "flat_base_s1.json"], 5, 5) == {"flat": [run]}


def test_quick_bench_runs_issue_63_rows_end_to_end(tmp_path, tiny_dir):
    """``grove bench visgen-methods --quick``'s path in one process for the five rows (flat 1 iteration on the tiny
    pipeline): flat seed 0 sets the budget and, merged, is OPD's teacher; each row trains to that budget and is
    evaluated; results.json holds every row and the page is not rewritten (quick never writes the doc)."""
    import json

    import bench.visgen_methods as vm

    page = vm.DOC.read_text()
    lines: list[str] = []
    res = vm.run(tmp_path, quick=True, variants=list(ISSUE_63), flat_iters=1, model=str(tiny_dir), log=lines.append)
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"flat", *ISSUE_63}
    assert (tmp_path / "teacher" / "model_index.json").is_file()  # flat seed 0 merged: OPD's teacher
    budget = res["budget_nfe"]
    assert budget == res["runs"]["flat"][0]["nfe"] > 0
    for name in ISSUE_63:
        run = res["runs"][name][0]
        # trained until the budget was spent (or 3x flat's iterations), evaluated before and at the end
        assert run["nfe"] >= budget or run["iterations"] == 3, name
        assert len(run["points"]) == run["iterations"] + 1 and 0 <= rows[name]["strict_at_budget"] <= 1, name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["quick"] and {r["variant"] for r in saved["rows"]} == set(rows)
    assert "grove bench visgen-methods --quick" in saved["notes"] and vm.DOC.read_text() == page
    assert any(line.startswith("visgen-methods: done in") for line in lines)
