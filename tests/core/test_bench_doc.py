"""Benchmark pages: the table is rewritten on every run, the hand-written analysis below it survives exactly once."""
from shared_rl.bench import ANALYSIS_MARK, write_results


def test_rerun_rewrites_table_and_keeps_one_analysis(tmp_path):
    doc = tmp_path / "page.md"
    write_results(tmp_path / "run1", "demo", [{"variant": "a", "x": 1.0}], doc_path=doc)
    doc.write_text(doc.read_text() + f"\n{ANALYSIS_MARK} after run 1)\n\nreading of run 1\n")
    for run in ("run2", "run3"):
        write_results(tmp_path / run, "demo", [{"variant": "a", "x": 2.0}], doc_path=doc)
    text = doc.read_text()
    assert text.count(ANALYSIS_MARK) == 1 and "reading of run 1" in text
    assert "| a | 2 |" in text and "| a | 1 |" not in text
    assert text.index("| a | 2 |") < text.index(ANALYSIS_MARK)


def test_kept_rows_fill_in_what_this_sitting_did_not_measure_and_a_new_measurement_replaces_its_copy():
    from shared_rl.bench import merge_kept_rows, row_key

    kept = [{"variant": "BC, K=5", "kind": "bc", "seed": 0, "success": 0.62},
            {"variant": "RL a", "kind": "rl", "run_dir": "rl-a-s0", "success": 0.6},
            {"variant": "RL b", "kind": "rl", "run_dir": "rl-b-s0", "success": 0.7},
            {"variant": "spread", "kind": "noise_sd", "success": 0.03}]
    now = [{"variant": "BC, K=5", "kind": "bc", "seed": 0, "success": 0.64},  # measured again: replaces
           {"variant": "RL c", "kind": "rl", "run_dir": "rl-c-s0", "success": 0.5},  # new
           {"variant": "spread", "kind": "noise_sd", "seed": None, "success": 0.04}]  # same row, seed written as null
    merged = merge_kept_rows(now, kept)
    assert [r["success"] for r in merged] == [0.64, 0.6, 0.7, 0.5, 0.04], "kept rows sit after their kept neighbour"
    assert len({row_key(r) for r in merged}) == len(merged)
    assert merge_kept_rows(merged, kept) == merged, "merging again changes nothing"
    assert merge_kept_rows(now, []) == now


def test_write_results_writes_the_merged_rows_back_beside_the_page(tmp_path):
    import json

    import pytest

    from shared_rl.bench import read_kept_rows, write_results

    rows_file = tmp_path / "page.rows.json"
    rows_file.write_text(json.dumps([{"variant": "old", "kind": "rl", "run_dir": "rl-old", "success": 0.6}]))
    write_results(tmp_path / "out", "b", [{"variant": "new", "success": 0.7}], doc_path=tmp_path / "page.md",
                  rows_file=rows_file)
    assert [r["variant"] for r in read_kept_rows(rows_file)] == ["old", "new"]
    assert "| old |" in (tmp_path / "page.md").read_text() and "| new |" in (tmp_path / "page.md").read_text()
    assert not list(tmp_path.glob("*.tmp")), "written through a temporary file renamed into place"
    write_results(tmp_path / "out2", "b", [{"variant": "part"}], rows_file=rows_file)  # no page: a part, not kept
    assert [r["variant"] for r in read_kept_rows(rows_file)] == ["old", "new"]
    rows_file.write_text('{"not": "rows"}')
    with pytest.raises(ValueError, match="git checkout"):
        read_kept_rows(rows_file)
