"""``RUN/report.html``: one page a person opens in a browser to see what a run did — what was trained and how
long it took, each held-out metric before -> after, ``curves.png``, and the samples the domain drew (the visgen
before/after grid, robot GIFs, LLM completions), found by name in the run directory so the page needs no domain
code. Written at the end of ``grove train`` (``Trainer._finish_main``) and by ``grove eval`` into its results.

Pictures are linked, not embedded (the page stays a few kB and opens from the run directory; copy the directory,
not the page). Everything from the run is HTML-escaped: prompts and completions are user text.
"""
from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

from .rundir import atomic_write_text

# files a domain writes that the page shows, in this order (anything else in the run directory is not a sample)
PICTURES = ("curves.png", "samples_before_after.png", "samples_before_after.gif", "eval_samples.png",
            "samples.png")
TEXTS = ("visgen_summary.txt", "samples.txt")  # summary.txt says what the evaluation table says
GIF_DIRS = ("gifs", "eval_gifs")
# what each picture shows, for its caption (the file name follows in the caption)
CAPTIONS = {"curves.png": "training curves: the training reward, then one panel per kind of metric",
            "samples_before_after.png": "held-out prompts, same seeds: the base model and the trained one",
            "samples_before_after.gif": "held-out prompts, same seeds: the base model and the trained one",
            "eval_samples.png": "samples of this evaluation", "samples.png": "samples"}
METRIC_COLUMNS = 3  # the last iteration's metrics side by side, not one long column
MAX_TEXT = 20_000  # characters of one text file shown (a long samples.txt is cut with a note)

STYLE = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1100px; color: #1d2330; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #dde;
       padding-bottom: 4px; }
.sub { color: #667; font-size: 13px; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 10px; border-bottom: 1px solid #eef; }
th { text-align: left; background: #f4f5fa; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.up { color: #137333; } td.down { color: #b3261e; }
img { max-width: 100%; border: 1px solid #dde; margin: 6px 0; image-rendering: auto; }
.gifs img { max-width: 260px; margin-right: 8px; } figure { display: inline-block; margin: 0 10px 10px 0; }
.cols { display: flex; flex-wrap: wrap; gap: 0 28px; align-items: flex-start; }
code { font-size: 12px; color: #556; }
figcaption { font-size: 12px; color: #556; }
pre { background: #f7f7fa; padding: 10px; font-size: 12px; overflow-x: auto; white-space: pre-wrap; }
"""


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if _num(v) else html.escape(str(v))


def eval_changes(records: list[dict[str, Any]]) -> list[tuple[str, Any, Any, int, int]]:
    """(metric, first value, last value, first step, last step) of every ``eval/*`` metric over the records that
    hold an evaluation (first and last are the same record when there was one evaluation)."""
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    return [(k, first.get(k), last[k], first["step"], last["step"]) for k in sorted(last)
            if k.startswith("eval/") and _num(last[k])]


def _paired_cell(pc: tuple[float, float, bool] | None) -> str:
    return "<td></td>" if pc is None else f"<td class='num'>{pc[0]:+.3f} ± {pc[1]:.3f}{' (inside the band)' if pc[2] else ''}</td>"


def _is_paired_key(key: str) -> bool:
    head = key.split("/")[1] if key.count("/") else key
    return head.endswith(("_delta", "_delta_se")) or head.startswith("paired_")


def paired_change(record: dict[str, Any], key: str) -> tuple[float, float, bool] | None:
    """(delta, standard error, inside ±2 se) of metric ``key`` (``eval/success/<task>``) when ``record`` holds its
    paired change (``eval/success_delta/<task>`` and ``eval/success_delta_se/<task>``, the robotics domain's paired
    evaluation), else None."""
    parts = key.split("/")
    if len(parts) < 2 or parts[0] != "eval" or _is_paired_key(key):
        return None
    rest = "/".join(parts[2:])
    tail = f"/{rest}" if rest else ""
    d, se = record.get(f"eval/{parts[1]}_delta{tail}"), record.get(f"eval/{parts[1]}_delta_se{tail}")
    if not (_num(d) and _num(se)):
        return None
    return float(d), float(se), abs(d) <= 2 * se


def _table(rows: list[list[str]], head: list[str]) -> str:
    out = ["<table>"] + (["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"] if any(head) else [])
    out += ["<tr>" + "".join(rows_) + "</tr>" for rows_ in rows]
    return "\n".join(out) + "</table>"


def captioned_rows(rows: list[Any], captions: list[str], header: str = ""):
    """A PIL image: ``rows`` (``H x W x 3`` uint8 arrays of one width, e.g. a prompt's samples before and after
    training side by side) stacked top to bottom, each under its caption (wrapped to the width), with ``header``
    above all. The captions are what a sample grid is read by; a ``.txt`` beside the picture is not."""
    import textwrap

    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    width = max(r.shape[1] for r in rows) if rows else 400
    size = 14
    font = ImageFont.load_default(size=size)
    chars = max(20, int(width / (0.55 * size)))
    line_h, pad = size + 4, 6
    blocks = [([header] if header else [])]
    blocks += [textwrap.wrap(c, chars) or [""] for c in captions]
    height = sum(len(b) * line_h + pad for b in blocks) + sum(r.shape[0] + pad for r in rows)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    y = 0
    if header:
        draw.text((4, y), header, fill=(90, 90, 90), font=font)
        y += line_h + pad
    for lines, row in zip(blocks[1:], rows):
        for line in lines:
            draw.text((4, y), line, fill=(20, 20, 20), font=font)
            y += line_h
        canvas.paste(Image.fromarray(np.ascontiguousarray(row)), (0, y))
        y += row.shape[0] + pad
    return canvas


def run_facts(cfg, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What a reader asks first about a run of ``cfg`` (a ``TrainConfig``): what was trained, with what, for how
    long (the iterations' and evaluations' own times, summed over resumes)."""
    from .metrics import duration

    r, o = cfg.rollout, cfg.optim
    steps = o.inner_epochs * o.minibatches_per_epoch
    done = max((rec["step"] for rec in records if _num(rec.get("reward/mean"))), default=0)
    spent = sum(rec.get(k) or 0.0 for rec in records for k in ("time/iteration", "time/eval")
                if _num(rec.get(k)))
    return {
        "domain": cfg.domain,
        "iterations": f"{done} of {cfg.iterations}",
        "per iteration": f"{r.groups_per_iteration} groups x {r.group_size} samples, {steps} optimizer step(s)",
        "advantage estimator": cfg.advantage.estimator.name,
        "policy loss": cfg.policy_loss_choice().name,
        "KL coefficient": cfg.loss.kl_coef,
        "learning rate": o.lr,
        "time in iterations and evaluations": duration(spent),
    }


def write_report(run_dir: Path, records: list[dict[str, Any]], title: str, facts: dict[str, Any] | None = None,
                 name: str = "report.html") -> Path:
    """Write ``run_dir/name`` from the run's metric records, ``facts`` (label -> value: what was trained, wall
    time, ...) and the pictures and texts found in ``run_dir``; returns its path."""
    from .metrics import constant_series

    run_dir = Path(run_dir)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<div class='sub'>{html.escape(str(run_dir.absolute()))} &middot; written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}</div>"]
    if facts:
        parts.append("<h2>Run</h2>")
        parts.append(_table([[f"<td>{html.escape(str(k))}</td>", f"<td>{_fmt(v)}</td>"] for k, v in facts.items()],
                            ["", ""]))
    changes = eval_changes(records)
    if changes:
        single = changes[0][3] == changes[0][4]
        last = records[-1] if records else {}
        paired = {k: paired_change(last, k) for k, *_ in changes}
        any_paired = any(v is not None for v in paired.values())
        parts.append("<h2>Held-out evaluation</h2>")
        if any_paired:
            parts.append("<div class='sub'>paired: the same states and start noise before and after, the mean "
                         "per-episode change ± its standard error; inside ±2 standard errors the evaluation cannot "
                         "tell it from no change</div>")
        rows = []
        for k, a, b, s0, s1 in changes:
            if any_paired and _is_paired_key(k):
                continue  # shown in its metric's row
            if single or not _num(a):
                row = [f"<td>{html.escape(k)}</td>", f"<td class='num'>{_fmt(b)}</td>"]
                if single and any_paired:  # before = a saved baseline (robotics.eval_baseline): only the change shows
                    row.append(_paired_cell(paired[k]))
                rows.append(row)
                continue
            cls = "up" if b > a else "down" if b < a else ""
            row = [f"<td>{html.escape(k)}</td>", f"<td class='num'>{_fmt(a)}</td>",
                   f"<td class='num'>{_fmt(b)}</td>", f"<td class='num {cls}'>{b - a:+.4g}</td>"]
            if any_paired:
                row.append(_paired_cell(paired[k]))
            rows.append(row)
        head = ["metric", f"iteration {changes[0][4]}"] + (["paired change ± se"] if any_paired else []) if single else \
            ["metric", f"iteration {changes[0][3]}", f"iteration {changes[0][4]}", "change"] + \
            (["paired change ± se"] if any_paired else [])
        parts.append(_table(rows, head))
    shown = [p for p in PICTURES if (run_dir / p).is_file()]
    if shown:
        parts.append("<h2>Curves and samples</h2>")
        for p in shown:
            what = html.escape(CAPTIONS.get(p, p))
            parts.append(f"<figure><img src='{html.escape(p)}' alt='{what}'>"
                         f"<figcaption>{what} <code>{html.escape(p)}</code></figcaption></figure>")
            left = constant_series(records) if p == "curves.png" else {}
            if left:  # right under the curves it belongs to, not after the samples
                parts.append("<div class='sub'>not drawn (constant in this run): " + ", ".join(
                    f"{html.escape(k)} = {v:.3g}" for k, v in sorted(left.items())) + "</div>")
    for folder in GIF_DIRS:
        gifs = sorted((run_dir / folder).glob("*.gif")) if (run_dir / folder).is_dir() else []
        if gifs:
            parts.append(f"<h2>Episodes ({html.escape(folder)}/)</h2><div class='gifs'>")
            parts += [f"<figure><img src='{html.escape(folder)}/{html.escape(g.name)}' alt='{html.escape(g.name)}'>"
                      f"<figcaption>{html.escape(g.stem)}</figcaption></figure>" for g in gifs]
            parts.append("</div>")
    for t in TEXTS:
        path = run_dir / t
        if path.is_file():
            text = path.read_text(errors="replace")
            cut = f"\n... ({len(text) - MAX_TEXT:,} more characters in {t})" if len(text) > MAX_TEXT else ""
            parts.append(f"<h2>{html.escape(t)}</h2><pre>{html.escape(text[:MAX_TEXT] + cut)}</pre>")
    last = next((r for r in reversed(records) if _num(r.get("reward/mean"))), None)
    if last is not None:
        parts.append(f"<h2>Last training iteration ({last['step']})</h2>")
        rows = [[f"<td>{html.escape(k)}</td>", f"<td class='num'>{_fmt(v)}</td>"]
                for k, v in sorted(last.items()) if k != "step" and _num(v)]
        per = -(-len(rows) // METRIC_COLUMNS) if rows else 1  # alphabetical, top to bottom, then the next column
        parts.append("<div class='cols'>" + "".join(_table(rows[i:i + per], ["metric", "value"])
                                                   for i in range(0, len(rows), per)) + "</div>")
    parts.append("</body></html>\n")
    out = run_dir / name
    atomic_write_text(out, "\n".join(parts))
    return out
