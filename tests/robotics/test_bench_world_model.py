"""The world-model benchmark's bookkeeping: the eval curve against real env steps, steps to a target, mean rows."""
from bench.robotics_world_model import curve, mean_row, row, steps_to


def _hist(evals, steps_per_it, real_key=False):
    hist = [{"step": 0, "eval/success": evals[0], "eval/success_se": 0.04}]
    if real_key:
        hist[0]["eval/real_env_steps"] = 10_000
    for it in range(1, len(evals)):
        h = {"step": it, "env/steps": steps_per_it, "groups/kept": 2, "verify/rank_spearman": 0.5}
        h.update({"eval/success": evals[it], "eval/success_se": 0.04})
        if real_key:
            h["eval/real_env_steps"] = 10_000 + it * steps_per_it
        hist.append(h)
    return hist


def test_curve_and_steps_to_target():
    sim = curve(_hist([0.7, 0.72, 0.8, 0.85], 7000))
    assert [p["real_env_steps"] for p in sim] == [0, 7000, 14000, 21000], "sim: the summed env/steps"
    wm = curve(_hist([0.7, 0.86, 0.8], 1000, real_key=True))
    assert [p["real_env_steps"] for p in wm] == [10_000, 11_000, 12_000], "world model: its counted real steps"
    assert [p["se"] for p in wm] == [0.04] * 3
    assert steps_to(wm, 0.85) == 11_000 and steps_to(sim, 0.9) is None
    assert steps_to(curve(_hist([0.9, 0.5], 100)), 0.85) is None, "the start does not count as reaching it"


def test_rows_and_means():
    r0 = row("verified", 0, _hist([0.7, 0.86], 1000, real_key=True), 60.0, 0.85, 21000.0)
    r1 = row("verified", 1, _hist([0.7, 0.8], 1000, real_key=True), 60.0, 0.85, 21000.0)
    assert r0["steps_to_sim_final"] == 11_000 and abs(r0["fraction_of_sim_steps"] - 11 / 21) < 1e-9
    assert r1["steps_to_sim_final"] is None and r0["rank_spearman"] == 0.5
    m = mean_row([r0, r1])
    assert m["seeds_reaching_sim_final"] == "1/2" and abs(m["after"] - 0.83) < 1e-9
    assert abs(m["after_se"] - (2 * 0.04 ** 2) ** 0.5 / 2) < 1e-12
