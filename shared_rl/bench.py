"""Benchmark results: one format for every ``grove bench NAME``.

``DIR/results.json`` = ``{"bench": NAME, "rows": [{"variant": str, <metric>: number, ...}], "machine": {...},
"notes": str}`` plus ``DIR/results.md`` (a Markdown table) and whatever plots the benchmark draws.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    gl = os.environ.get("MUJOCO_GL")
    if gl:
        info["mujoco_gl"] = gl
    return info


def markdown_table(rows: list[dict[str, Any]], digits: int = 4) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.{digits}g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


ANALYSIS_MARK = "## Analysis (hand-written"


def row_key(row: dict[str, Any]) -> str:
    """What makes two rows the same measurement: the run directory where the row has one, else kind, variant, seed."""
    seed = row.get("seed")  # a row over seeds (a spread) has none, whether written as null or left out
    return str(row.get("run_dir") or f"{row.get('kind', '')}|{row['variant']}|{'' if seed is None else seed}")


def read_kept_rows(path: Path | None) -> list[dict[str, Any]]:
    """The rows an earlier sitting committed beside its docs page (``[]`` when there is no such file)."""
    if path is None or not Path(path).is_file():
        return []
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "variant" in r for r in rows):
        raise ValueError(f"{path} is not a list of benchmark rows; restore it from git (`git checkout -- {path}`)")
    return rows


def merge_kept_rows(rows: list[dict[str, Any]], kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """This sitting's rows plus every kept row it did not measure again, each where it stood among the kept rows.

    A benchmark that runs in pieces across sittings (each row its own process, hours each) keeps its finished rows in
    a committed file, because a fresh machine's output directory has none of them: without this, the next full table
    would silently drop every row measured elsewhere. A row measured again replaces its kept copy."""
    merged = list(rows)
    have = {row_key(r): i for i, r in enumerate(merged)}
    previous = None  # the key of the last kept row placed, so an earlier row lands after its kept neighbour
    for r in kept:
        k = row_key(r)
        if k not in have:
            at = have[previous] + 1 if previous in have else 0
            merged.insert(at, r)
            have = {row_key(x): i for i, x in enumerate(merged)}
        previous = k
    return merged


def write_results(out_dir: Path, bench: str, rows: list[dict[str, Any]], notes: str = "",
                  extra: dict[str, Any] | None = None, doc_path: Path | None = None,
                  rows_file: Path | None = None) -> dict[str, Any]:
    """Write results.json and results.md (and, when given, the docs page with the same table). ``rows_file`` (with
    ``doc_path``): the committed rows of earlier sittings, merged in (``merge_kept_rows``) and written back."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in rows:
        if "variant" not in r:
            raise ValueError(f"every benchmark row needs a 'variant' field: {r}")
    if rows_file is not None and doc_path is not None:
        rows = merge_kept_rows(rows, read_kept_rows(rows_file))
        tmp = Path(rows_file).with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1, default=float) + "\n")
        tmp.replace(rows_file)  # never a half-written file of rows that exist nowhere else
    result = {"bench": bench, "rows": rows, "machine": machine_info(), "notes": notes, **(extra or {})}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1, default=float))
    table = markdown_table(rows)
    md = f"# Benchmark `{bench}`\n\n{table}\n{notes}\n\nMachine: `{json.dumps(result['machine'])}`\n"
    (out_dir / "results.md").write_text(md)
    if doc_path is not None:
        doc = Path(doc_path)
        doc.parent.mkdir(parents=True, exist_ok=True)
        # a hand-written analysis at the end of the page survives re-runs (it is about a measured run; re-read it)
        old = doc.read_text() if doc.is_file() else ""
        kept = old[old.index(ANALYSIS_MARK):] if ANALYSIS_MARK in old else ""
        doc.write_text(md + ("\n" + kept if kept else ""))
    return result
