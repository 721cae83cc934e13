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
