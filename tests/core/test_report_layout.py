"""report.html reads at a glance: pictures captioned by what they show, the last iteration's metrics side by side."""
from shared_rl.report import METRIC_COLUMNS, write_report


def test_pictures_are_captioned_and_metrics_sit_in_columns(tmp_path):
    (tmp_path / "curves.png").write_bytes(b"")
    (tmp_path / "samples_before_after.png").write_bytes(b"")
    records = [{"step": 0, "eval/score": 0.5},
               {"step": 1, "eval/score": 0.7, "reward/mean": 0.6, **{f"m/{i:02d}": float(i) for i in range(12)}}]
    page = write_report(tmp_path, records, "grove run: t").read_text()
    assert "training curves: the training reward" in page and "<code>curves.png</code>" in page
    assert "the base model and the trained one" in page
    last = page[page.index("Last training iteration"):]
    assert last.count("<table>") == METRIC_COLUMNS and "class='cols'" in last  # 14 metrics in 3 tables
    assert "m/00" in last and "m/11" in last and "reward/mean" in last


def test_a_paired_change_sits_beside_its_metric_with_its_band(tmp_path):
    records = [{"step": 0, "eval/success": 0.5, "eval/success/a": 0.4},
               {"step": 4, "eval/success": 0.62, "eval/success/a": 0.44, "eval/success_delta": 0.12,
                "eval/success_delta_se": 0.03, "eval/success_delta/a": 0.04, "eval/success_delta_se/a": 0.05,
                "eval/paired_gained": 9.0, "eval/paired_lost": 3.0}]
    page = write_report(tmp_path, records, "grove run: t").read_text()
    held = page[page.index("Held-out evaluation"):]
    assert "paired change ± se" in held
    assert "+0.120 ± 0.030</td>" in held, "0.12 is four standard errors: outside the band"
    assert "+0.040 ± 0.050 (inside the band)" in held
    assert "eval/success_delta" not in held and "paired_gained" not in held, "the paired keys sit in their rows"


def test_a_run_paired_with_a_saved_baseline_shows_its_change(tmp_path):
    """One evaluation (the before is a saved file, robotics.eval_baseline): the paired change still shows."""
    records = [{"step": 6, "eval/success": 0.635, "eval/success_delta": 0.015, "eval/success_delta_se": 0.032}]
    held = write_report(tmp_path, records, "grove run: t").read_text()
    held = held[held.index("Held-out evaluation"):]
    assert "paired change ± se" in held and "+0.015 ± 0.032 (inside the band)" in held
