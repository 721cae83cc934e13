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


def write_results(out_dir: Path, bench: str, rows: list[dict[str, Any]], notes: str = "",
                  extra: dict[str, Any] | None = None, doc_path: Path | None = None) -> dict[str, Any]:
    """Write results.json and results.md (and, when given, the docs page with the same table)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in rows:
        if "variant" not in r:
            raise ValueError(f"every benchmark row needs a 'variant' field: {r}")
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
