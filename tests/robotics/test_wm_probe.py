"""The world-model ranking probe and the sibling ranker: hand-computed metrics and losses, sibling sets whose real
side is the simulator's re-execution of each stream, a ranker that learns a within-keyframe order it can see and
not one it cannot, files that round-trip (point env, tiny models, seconds)."""
import math
import os

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import pytest
import torch

from shared_rl.config import ConfigError, load_train_config
from shared_rl.trainer import Trainer

from bench.robotics_wm_probe import split_keyframes, truncated_score
from robotics.episodes import run_episodes
from robotics.world_model.probe import SiblingSets, collect_sibling_sets, imagine_candidates, ranking_metrics
from robotics.world_model.ranker import (RankerConfig, SiblingRanker, fit_ranker, outcome, pairwise_loss,
                                         rank_scores)
from robotics.world_model.verified import RestoredEnv

from .test_verified import _point, _verified_config
from .test_world_model_fixtures import tiny_wm_asset


def test_ranking_metrics_by_hand():
    S = np.array([[4.0, 3, 2, 1], [1, 2, 3, 4], [1, 2, 3, 4]])
    R = np.array([[1.0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    m = ranking_metrics(S, R, k=2)
    # row 0: centred ranks S (1.5, .5, -.5, -1.5), R (1, 1, -1, -1): 4 / (sqrt(5) * 2); row 1: -3 / (sqrt(5) sqrt(3));
    # row 2: R constant -> undefined, left out
    r0, r1 = 4 / (math.sqrt(5) * 2), -3 / (math.sqrt(5) * math.sqrt(3))
    assert m["spearman_within"] == pytest.approx((r0 + r1) / 2)
    assert m["spearman_within_defined"] == 2
    # the best a strict order can reach on each defined row: row 0 = r0 (it is one), row 1 = 3 / (sqrt(5) sqrt(3))
    assert m["spearman_within_max"] == pytest.approx((r0 + 3 / (math.sqrt(5) * math.sqrt(3))) / 2)
    # top-2 by score: row 0 keeps (1, 1), row 1 keeps (0, 0); base rate over the mixed rows 3 / 8
    assert m["top_k_precision"] == pytest.approx(0.5) and m["base_rate"] == pytest.approx(3 / 8)
    assert m["top_k_lift"] == pytest.approx(0.125)
    assert m["mixed_random"] == pytest.approx(1 / 3)  # the first 2 candidates: only row 0's differ
    assert m["spearman_within_of_max"] == pytest.approx(m["spearman_within"] / m["spearman_within_max"])


def test_spearman_within_spread_keeps_keyframes_with_a_quarter_to_three_quarters_successes():
    S = np.tile(np.arange(8.0, 0, -1), (2, 1))
    R = np.array([[0.0, 0, 0, 0, 0, 0, 0, 1], [1, 1, 0, 1, 0, 1, 0, 0]])  # 1 of 8 (left out), 4 of 8 (kept)
    m = ranking_metrics(S, R, k=2)
    # row 1: centred ranks S (3.5 .. -3.5), R (+2 for a success, -2 for a failure): 20 / sqrt(42 * 32)
    assert m["spearman_within_spread"] == pytest.approx(20 / math.sqrt(42 * 32))
    assert m["keyframes_spread"] == 1 and m["spearman_within"] < m["spearman_within_spread"]
    assert math.isnan(ranking_metrics(S, R * 0.5 + 0.1, k=2)["spearman_within_spread"]), "defined for 0/1 outcomes only"


def test_pairwise_loss_by_hand():
    s = torch.tensor([[0.0, 1.0, 5.0]], requires_grad=True)
    y = torch.tensor([[1.0, 0.0, 0.0]])
    loss = pairwise_loss(s, y)  # pairs (0 > 1), (0 > 2): mean of softplus(1), softplus(5)
    assert float(loss.detach()) == pytest.approx((math.log1p(math.e) + math.log1p(math.e ** 5)) / 2, rel=1e-6)
    loss.backward()
    assert s.grad[0, 0] < 0 < s.grad[0, 2], "the better sibling's score is pushed up, the worse one's down"
    flat = pairwise_loss(s, torch.ones(1, 3))
    assert float(flat.detach()) == 0.0 and flat.requires_grad, "no pair: nothing to learn, still differentiable"


def test_depth_rows_split_the_probe_by_keyframe_depth():
    from bench.robotics_wm_probe import depth_rows

    sets = _synthetic(6)
    sets.chunk[:] = [0, 2, 4, 6, 8, 20]
    good = sets.real_success.astype(float) + 0.1 * np.arange(8)  # ranks by the outcome: the best order there is
    rows = depth_rows(sets, {"oracle-ish": [good]})
    assert [(r["variant"].split(":")[0], r["keyframes"]) for r in rows] == [
        ("keyframes at chunks 0-0", 1), ("keyframes at chunks 2-6", 3), ("keyframes at chunks 8-20", 2)]
    early = sets.subset([1, 2, 3])
    assert rows[1]["real_mixed"] == pytest.approx(np.mean(early.real_success.max(1) != early.real_success.min(1)))
    assert rows[1]["spearman_within_of_max"] == pytest.approx(1.0)
    from bench.robotics_wm_probe import depth_trained_row

    train = _synthetic(12, seed=1)
    train.chunk[:] = [2] * 8 + [10] * 4
    row = depth_trained_row(train, sets, 2, 6, {"ranker_steps": 5, "ranker_seeds": (0,)})
    assert row["keyframes"] == 3 and "trained on the 8 training keyframes" in row["variant"]
    assert f"({int(train.real_steps[:8].sum())} real env steps of sets)" in row["variant"]
    from bench.robotics_wm_probe import candidate_rows

    small = train.first_candidates(3)
    assert small.shape == (12, 3) and small.z.shape == (12, 3, 5, 6) and small.start_z.shape == (12, 6)
    assert np.array_equal(small.real_success, train.real_success[:, :3]) and np.array_equal(small.keys, train.keys)
    with pytest.raises(ValueError, match="hold 8 candidates"):
        train.first_candidates(9)
    rows = candidate_rows(train, sets, {"ranker_steps": 5, "ranker_seeds": (0,), "set_sizes": (4, 8, 16)})
    assert [(r["train_candidates"], r["train_real_steps"]) for r in rows] == [(4, 8 * 4 * 20), (8, 8 * 8 * 20)], \
        "16 is more than the sets hold: skipped; each set size costs its own re-executions"
    assert rows[0]["keyframes"] == 3, "probed on the held-out keyframes there with all their candidates"


def _synthetic(g, n=8, t=5, seed=0):
    """Sibling sets whose real success is the sign of the first action of chunk 1; P(success) is noise."""
    rng = np.random.default_rng(seed)
    act = rng.normal(size=(g, n, t, 4)).astype(np.float32)
    succ = act[:, :, 1, 0] > 0
    z = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return SiblingSets(
        keys=np.arange(g), seeds=rng.integers(0, 2**40, (g, n)), episode_keys=np.arange(g), chunk=np.zeros(g, np.int64),
        start_z=z(g, 6), start_proprio=z(g, 2), z=z(g, n, t, 6), proprio=z(g, n, t, 2), actions=act,
        prob=rng.uniform(size=(g, n, t)).astype(np.float32), uncertainty=np.ones((g, n, t), np.float32),
        valid=np.ones((g, n, t), bool), score=rng.uniform(size=(g, n)), imagined_success=np.zeros((g, n), bool),
        real_success=succ, real_dense=rng.uniform(size=(g, n)).astype(np.float32) * 0.1,
        real_steps=np.full((g, n), 20))


def _fit_and_probe(inputs, first_chunks=0):
    train, test = _synthetic(40, seed=0), _synthetic(12, seed=1)
    cfg = RankerConfig(latent_dim=6, proprio_dim=2, action_dim=4, horizon_chunks=5, inputs=inputs,
                       first_chunks=first_chunks, latent_proj=4, hidden=32)
    model = fit_ranker(train, cfg, target="success", steps=150, lr=3e-3, seed=0)
    return model, ranking_metrics(rank_scores(model, test), test.real_success.astype(float), 4), test


def test_the_ranker_learns_a_within_keyframe_order_it_can_see_and_not_one_it_cannot():
    model, seen, test = _fit_and_probe(["actions"])
    assert seen["spearman_within"] > 0.6 and seen["top_k_lift"] > 0.25
    _, noise, _ = _fit_and_probe(["prob"])  # P(success) here carries no information about the outcome
    assert noise["spearman_within"] < 0.3
    _, first, _ = _fit_and_probe(["actions"], first_chunks=1)  # the deciding action is in chunk 1, masked out
    assert first["spearman_within"] < 0.3


def test_ranker_files_round_trip(tmp_path):
    model, _, test = _fit_and_probe(["actions", "latent", "proprio"])
    model.save(tmp_path / "r")
    again = SiblingRanker.load(tmp_path / "r")
    assert np.allclose(rank_scores(model, test), rank_scores(again, test), atol=1e-6)
    with pytest.raises(FileNotFoundError, match="ranker.json"):
        SiblingRanker.load(tmp_path)
    with pytest.raises(ConfigError, match="inputs"):
        RankerConfig(inputs=["pixels"]).check()
    with pytest.raises(ConfigError, match="differ"):
        fit_ranker(_constant(), steps=1)


def _constant():
    s = _synthetic(6)
    s.real_success[:] = True
    s.real_dense[:] = 0.5
    return s


def test_outcome_targets():
    s = _synthetic(2)
    assert np.array_equal(outcome(s, "success"), s.real_success.astype(float))
    assert np.allclose(outcome(s, "return"), s.real_success + 0.5 * s.real_dense)
    with pytest.raises(ConfigError, match="target"):
        outcome(s, "reward")


def test_truncated_score_by_hand():
    s = _synthetic(1, n=3, t=4)
    s.prob[0] = [[0.1, 0.4, 0.3, 0.9], [0.2, 0.3, 0.95, 0.1], [0.5, 0.1, 0.1, 0.1]]
    s.uncertainty[0] = [[0.5, 0.5, 2.0, 0.5], [0.5, 0.5, 2.0, 0.5], [2.0, 0.5, 0.5, 0.5]]
    s.valid[0, 2, 3] = False
    # row 0: cut at step 2 (uncertain, 0.3 below the 0.9 threshold) -> best of steps 0-1 = 0.4;
    # row 1: step 2 is uncertain but an imagined success (0.95 > 0.9): no cut -> 0.95; row 2: cut at 0 -> 0
    assert np.allclose(truncated_score(s, threshold=0.9), [[0.4, 0.95, 0.0]])


def test_sibling_set_halves_are_split_by_reset_state_and_grow_as_prefixes():
    class KF:
        def __init__(self, e):
            self.episode_key = e

    from robotics.envs.metaworld_env import make_key

    kfs = {k: KF(make_key(0, "train", k % 10)) for k in range(100)}
    tr, ho = split_keyframes(kfs, 7, 20, 10)
    assert all(k % 10 < 7 for k in tr) and all(k % 10 >= 7 for k in ho) and not set(tr) & set(ho)
    tr2, ho2 = split_keyframes(kfs, 7, 40, 20)
    assert tr2[:20] == tr and ho2[:10] == ho, "more keyframes keep the ones already collected"


@pytest.fixture(scope="module")
def tiny_asset(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmprobe")
    return root, tiny_wm_asset(root)


def test_sibling_sets_re_execute_every_stream_in_the_simulator(tiny_asset, tmp_path):
    root, asset = tiny_asset
    tr = Trainer(load_train_config(_verified_config(asset, root, uncertainty_threshold=0.0)), None, log=lambda s: None)
    dom, st = tr.domain, tr.domain.rollouts
    keys = dom.train_keys()[:3]
    sets = collect_sibling_sets(dom.policy, st.imagine, RestoredEnv(_point(), st.keyframes), keys, 4, 12,
                                dom.sampling, torch.Generator().manual_seed(0), st.task_of, keys_per_batch=2)
    assert sets.shape == (3, 4) and sets.z.shape[:3] == (3, 4, 3) and sets.real_z.shape == sets.z.shape
    # the real side is the simulator's: each stream re-run alone from its keyframe gives the same outcome
    cand = [k for k in keys for _ in range(4)]
    ref = run_episodes(dom.policy, RestoredEnv(_point(), st.keyframes), cand, ["point-reach"] * 12, dom.sampling, 12,
                       torch.Generator().manual_seed(9), noise_seeds=sets.seeds.flatten().tolist())
    assert np.array_equal(sets.real_success.flatten(), ref.success_once)
    assert np.allclose(sets.real_dense.flatten(), ref.dense) and np.array_equal(sets.real_steps.flatten(), ref.length)
    # the imagined side is a function of the streams: imagined again, the same trajectories and scores
    again = imagine_candidates(dom.policy, st.imagine, keys, torch.from_numpy(sets.seeds), 12, dom.sampling,
                               torch.Generator().manual_seed(5), st.task_of)
    assert np.allclose(again["score"], sets.score) and np.allclose(again["actions"], sets.actions, atol=1e-6)
    # the first chunk sees the same real frame in both worlds: the same action chunk
    assert np.allclose(sets.actions[:, :, 0], sets.real_actions[:, :, 0], atol=1e-6)
    back = SiblingSets.load(sets.save(tmp_path / "s.npz"))
    assert np.array_equal(back.real_success, sets.real_success) and np.allclose(back.z, sets.z, atol=1e-2)
    assert not list(tmp_path.glob("*.tmp*")), "nothing half-written is left"


def _ranker_config(asset, root, **verify):
    cfg = _verified_config(asset, root, uncertainty_threshold=0.0)
    cfg["robotics"]["rollout"]["verify"].update(verify)
    return cfg


def test_verified_rollout_selects_by_the_ranker_refits_it_and_probes_held_out_keyframes(tiny_asset, tmp_path):
    root, asset = tiny_asset
    tr = Trainer(load_train_config(_ranker_config(asset, root)), None, log=lambda s: None)
    dom, st = tr.domain, tr.domain.rollouts
    sets = collect_sibling_sets(dom.policy, st.imagine, RestoredEnv(_point(), st.keyframes), dom.train_keys()[:6], 4,
                                12, dom.sampling, torch.Generator().manual_seed(0), st.task_of)
    fit_ranker(sets, RankerConfig(latent_dim=sets.z.shape[-1], proprio_dim=sets.proprio.shape[-1],
                                  action_dim=sets.actions.shape[-1], horizon_chunks=sets.z.shape[2],
                                  trained_real_steps=int(sets.real_steps.sum())),
               target="return", steps=5, val_fraction=0.0).save(tmp_path / "ranker")
    cfg = _ranker_config(asset, root, score="ranker", ranker=str(tmp_path / "ranker"), ranker_refit_steps=3,
                         probe_every=1, probe_keys=2, probe_states=2)
    cfg["robotics"]["rollout"]["world_model"].update(coevolve_every=1, coevolve_episodes=0, refit_steps=2,
                                                     refit_success_steps=2)
    cfg["iterations"] = 2
    tr = Trainer(load_train_config(cfg), None, log=lambda s: None)
    dom, st = tr.domain, tr.domain.rollouts
    from robotics.envs.metaworld_env import decode_key

    held = {k for k in st.keyframes if decode_key(st.keyframes[k].episode_key)[2] >= 6 - 2}
    assert held and not held & set(dom.train_keys()), "the probe's keyframes never train"
    assert set(st.probe_keys()) == held
    # the selector ranks by the ranker's score of each imagined trajectory
    keys = dom.train_keys()[:2]
    from robotics.world_model.probe import slot_features
    from robotics.world_model.ranker import trajectories_from

    # (without the probe: it would re-imagine other keyframes after the selection)
    st2 = Trainer(load_train_config({**cfg, "robotics": {**cfg["robotics"], "rollout": {
        **cfg["robotics"]["rollout"], "verify": {**cfg["robotics"]["rollout"]["verify"], "probe_every": 0}}}}),
        None, log=lambda s: None).domain.rollouts
    st2.rollout(keys, 3, torch.Generator().manual_seed(0), 0)
    with torch.no_grad():
        expect = st2.ranker(trajectories_from(slot_features(st2.imagine, keys, 6, 4, 3))).view(2, 6).double()
    assert torch.allclose(st2.last["score"], expect)
    assert not torch.allclose(st2.last["score"], torch.from_numpy(
        np.array([s_.trace["prob"][-1] for s_ in st2.imagine.slots])).view(2, 6).double())
    # the ranker's training sets were real steps: in the budget from the start, as the world model's data
    ranker_data = int(sets.real_steps.sum())
    assert ranker_data > 0 and st.ranker.cfg.trained_real_steps == ranker_data
    assert st.real_env_steps == st.real_steps_initial + ranker_data
    # training: the probe's metrics every iteration, its steps apart from the budget; the ranker is refit
    steps0 = st.real_env_steps
    before = [p.detach().clone() for p in st.ranker.parameters()]
    hist = tr.fit()
    probes = [h for h in hist if "probe/spearman_within" in h or "probe/env_steps_total" in h]
    assert len(probes) == 2 and all(h["probe/env_steps_total"] > 0 for h in probes)
    assert st.real_env_steps == steps0 + sum(h["env/steps"] for h in hist if "env/steps" in h), "probe steps apart"
    assert st.probe_steps == probes[-1]["probe/env_steps_total"]
    assert any("coevolve/ranker_groups" in h for h in hist)
    assert any(not torch.equal(a, b) for a, b in zip(before, st.ranker.parameters())), "the ranker was refit"
    tr.domain.save_pretrained(tmp_path / "final")
    assert (tmp_path / "final" / "world_model" / "ranker.json").is_file()


def test_a_ranker_learned_from_the_runs_own_groups_costs_no_real_step_beyond_the_run(tiny_asset, tmp_path):
    """ranker_from: own_groups — no ranker file; the selector ranks by imagined P(success) until the first
    co-evolution round, which fits a ranker on every group re-executed so far (and the next round on all of them
    again); nothing is added to the real-step budget but the run's own episodes."""
    root, asset = tiny_asset
    cfg = _ranker_config(asset, root, score="ranker", ranker_from="own_groups", ranker_refit_steps=3)
    cfg["robotics"]["rollout"]["world_model"].update(coevolve_every=1, coevolve_episodes=0, refit_steps=2,
                                                     refit_success_steps=2)
    cfg["iterations"] = 3
    tr = Trainer(load_train_config(cfg), None, log=lambda s: None)
    st = tr.domain.rollouts
    assert st.ranker is None and st.real_env_steps == st.real_steps_initial
    keys = tr.domain.train_keys()[:2]
    st.rollout(keys, 3, torch.Generator().manual_seed(0), 0)
    prob = torch.from_numpy(np.array([max(s_.trace["prob"]) for s_ in st.imagine.slots])).view(2, 6).double()
    assert torch.allclose(st.last["score"], prob), "before the first fit: the imagined P(success)"
    st._ranker_pending.clear()
    steps0 = st.real_env_steps
    hist = tr.fit()
    fits = [h["coevolve/ranker_groups"] for h in hist if "coevolve/ranker_groups" in h]
    assert fits and fits == sorted(fits) and len(set(fits)) == len(fits), "each fit sees every group so far"
    assert st.ranker is not None and st.ranker.cfg.trained_real_steps == 0
    assert st.real_env_steps == steps0 + sum(h["env/steps"] for h in hist if "env/steps" in h)
    with pytest.raises(ConfigError, match="own_groups"):
        load_train_config(_ranker_config(asset, root, score="prob", ranker_from="own_groups", ranker_refit_steps=3))
    with pytest.raises(ConfigError, match="ranker_refit_steps >= 1"):
        load_train_config(_ranker_config(asset, root, score="ranker", ranker_from="own_groups"))


def test_ranker_settings_errors(tiny_asset, tmp_path):
    root, asset = tiny_asset
    with pytest.raises(ConfigError, match="ranker.json"):
        Trainer(load_train_config(_ranker_config(asset, root, score="ranker", ranker=str(tmp_path))), None,
                log=lambda s: None)
    with pytest.raises(ConfigError, match="probe_states"):
        load_train_config(_ranker_config(asset, root, probe_every=1))
    with pytest.raises(ConfigError, match="keyframe_states"):
        load_train_config(_ranker_config(asset, root, probe_every=1, probe_states=6))


def test_the_oracle_explorer_keeps_the_candidates_of_the_best_real_spread(tiny_asset):
    """score: oracle re-executes every candidate: the kept k are the max-variance subset of their REAL returns, and
    every candidate's steps are counted (the kept ones' replays are not counted twice)."""
    root, asset = tiny_asset
    tr = Trainer(load_train_config(_ranker_config(asset, root, score="oracle")), None, log=lambda s: None)
    dom, st = tr.domain, tr.domain.rollouts
    keys = dom.train_keys()[:2]
    ro = dom.rollout(keys, 3, torch.Generator().manual_seed(0), 0)
    last = st.last
    cand = [k for k in keys for _ in range(6)]
    full = run_episodes(dom.policy, RestoredEnv(_point(), st.keyframes), cand, ["point-reach"] * 12, dom.sampling, 12,
                        torch.Generator().manual_seed(3), noise_seeds=last["seeds"].flatten().tolist())
    real_return = torch.from_numpy(full.success_once + 0.5 * full.dense).view(2, 6).double()
    assert torch.allclose(last["score"], real_return)
    import shared_rl.two_stage

    assert torch.equal(last["keep"], shared_rl.two_stage.select_candidates(real_return, 3, "max_variance"))
    assert ro.info["env/steps"] == int(full.length.sum())
