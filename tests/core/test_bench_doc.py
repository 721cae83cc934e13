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
