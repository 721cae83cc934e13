"""Host overhead of the fast LLM engine's decode loop (issue 42), the earlier compacting loop vs the static loop,
side by side in one process: ``python -m bench.llm_decode --out DIR [--quick]`` (``grove bench llm`` runs it too).

CPU proxy of "host microseconds per generated token": a tiny random Llama (hidden 64, 4 layers, vocab 256) whose
arithmetic is small, so a decode step's time on one CPU thread is mostly host work (Python, op dispatch, small
allocations). Two shapes: 1 row (pure host cost per step) and 8 prompts x 8 samples (the recipe's batch), 64 new
tokens at temperature 1 with a fixed generator. Per loop: process CPU seconds per generate (median of interleaved
rounds; the side that runs first alternates), split into the model's decode forwards (``_step``), the prefill
(``_start``) and the rest of the loop (sampling and bookkeeping: the per-token work the static loop cuts), per
step and per generated token. The two loops' token ids are checked equal on the way.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parents[1] / "docs" / "bench" / "llm.md"
BEGIN, END = "<!-- llm-decode: begin (bench.llm_decode) -->", "<!-- llm-decode: end -->"


def _engine(loop: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared_rl.llm.fast_llama import FastLlamaEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    return FastLlamaEngine(LlamaForCausalLM(cfg).eval(), 0, [2], loop=loop)


def _timed(engine, prompts, n, new_tokens):
    """(cpu seconds total, in decode forwards, in the prefill, generation)."""
    spent = {"_step": 0.0, "_start": 0.0}

    def timed(name):
        inner = getattr(engine, name)

        def call(*args):
            t = time.process_time()
            out = inner(*args)
            spent[name] += time.process_time() - t
            return out
        return call

    engine._step, engine._start = timed("_step"), timed("_start")
    try:
        t = time.process_time()
        gen = engine.generate(prompts, n, new_tokens, 1.0, torch.Generator().manual_seed(1))
        return time.process_time() - t, spent["_step"], spent["_start"], gen
    finally:
        del engine._step, engine._start


def run(out_dir: Path, quick: bool = False, log=print, write_doc: bool | None = None) -> dict:
    from shared_rl.bench import write_results

    torch.set_num_threads(1)
    rounds = 3 if quick else 7
    new_tokens = 16 if quick else 64
    t0 = time.perf_counter()
    engines = {loop: _engine(loop) for loop in ("compact", "static")}
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 256, (int(torch.randint(5, 13, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    rows, identical = [], True
    for label, P, n in (("1 row", 1, 1), ("8 prompts x 8", 8, 8)):
        for e in engines.values():
            _timed(e, prompts[:P], n, new_tokens)  # warm-up
        res: dict[str, list[tuple[float, float, float, int, int]]] = {k: [] for k in engines}
        for r in range(rounds):
            gens = {}
            for loop in (("compact", "static") if r % 2 == 0 else ("static", "compact")):
                total, fwd, prefill, gen = _timed(engines[loop], prompts[:P], n, new_tokens)
                tokens = sum(len(c) for c in gen.completion_ids)
                steps = max(len(c) for c in gen.completion_ids)
                res[loop].append((total, fwd, prefill, tokens, steps))
                gens[loop] = gen.completion_ids
            identical &= gens["compact"] == gens["static"]
        per = {}
        for loop, xs in res.items():
            total, fwd, prefill = (statistics.median(x[i] for x in xs) for i in range(3))
            tokens, steps = xs[0][3], xs[0][4]
            loop_work = total - fwd - prefill
            per[loop] = (total, loop_work, tokens)
            rows.append({"variant": f"{label}: {loop} loop", "rows": P * n, "steps": steps, "tokens": tokens,
                         "host_us_per_step": 1e6 * total / steps, "host_us_per_token": 1e6 * total / tokens,
                         "forward_us_per_step": 1e6 * fwd / steps, "prefill_us_per_step": 1e6 * prefill / steps,
                         "loop_us_per_step": 1e6 * loop_work / steps,
                         "loop_us_per_token": 1e6 * loop_work / tokens})
        (ct, cl, ctok), (st, sl, stok) = per["compact"], per["static"]
        rows[-1]["ratio_total_compact_over_static"] = (ct / ctok) / (st / stok)
        rows[-1]["ratio_loop_compact_over_static"] = (cl / ctok) / (sl / stok)
        log(f"llm-decode {label}: total {1e6 * ct / ctok:.1f} -> {1e6 * st / stok:.1f} us/token, loop "
            f"{1e6 * cl / ctok:.1f} -> {1e6 * sl / stok:.1f} us/token")
    notes = (f"\nTiny random Llama (hidden 64, 4 layers, vocab 256), {new_tokens} new tokens at temperature 1, "
             f"fixed generator, one CPU thread; {rounds} interleaved rounds, medians of process CPU time. host = the "
             f"whole generate call; forward = the decode steps' model forwards (`_step`); prefill = the "
             f"prompts' forward and the cache layout (`_start`); loop = the rest (sampling and bookkeeping). "
             f"Token ids of the two loops identical: **{identical}**. "
             f"Total {time.perf_counter() - t0:.0f} s. Command: `python -m bench.llm_decode --out DIR"
             f"{' --quick' if quick else ''}` (also run by `grove bench llm`).\n")
    result = write_results(Path(out_dir), "llm-decode", rows, notes, {"identical": identical})
    if write_doc if write_doc is not None else not quick:
        _write_section(Path(out_dir) / "results.md")
    return result


def _write_section(results_md: Path) -> None:
    """The table as a section of docs/bench/llm.md after its hand-written analysis mark (kept when the TRL
    comparison rewrites the page)."""
    from shared_rl.bench import ANALYSIS_MARK

    body = results_md.read_text().replace("# Benchmark `llm-decode`", "### Decode loop host overhead (issue 42)", 1)
    doc = DOC.read_text() if DOC.is_file() else ""
    if BEGIN in doc:
        head, rest = doc.split(BEGIN, 1)
        tail = rest.split(END, 1)[1] if END in rest else ""
    else:
        if ANALYSIS_MARK not in doc:
            doc = doc.rstrip("\n") + f"\n\n{ANALYSIS_MARK}; sections written by their own commands)\n"
        head, tail = doc.rstrip("\n") + "\n\n", "\n"
    DOC.write_text(f"{head}{BEGIN}\n{body.strip()}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.llm_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    run(Path(args.out), args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
