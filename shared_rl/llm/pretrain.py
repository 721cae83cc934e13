"""Supervised fine-tuning (SFT) that produces the embedded starting checkpoint ``assets/llm-arith-tiny``.

A tiny ``LlamaForCausalLM`` with the character-level tokenizer learns ``a+b=`` -> ``c</s>`` (loss on completion
tokens only, in the same padding layout RL uses). The checkpoint is chosen by its **sampled** accuracy at the RL
temperature, not greedy accuracy (DESIGN §7): GRPO learns only from groups whose rewards differ, so a start whose
samples are right ~30-50% of the time gives most groups variance, while a greedy-accurate but sample-poor start
leaves most groups all-wrong. Training stops once the sampled accuracy passes the band; the evaluated checkpoint
closest to ``target`` inside the band is saved.

Entry point: ``run(cfg, run_dir, log)`` (``grove pretrain configs/llm/arith_sft.yaml``).
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, from_dict
from .engine import TorchRolloutEngine
from .model import build_tiny_llama
from .policy import collate, token_log_probs
from .rewards import numeric_match
from .tasks import DatasetSettings, arith_example, arith_problems, is_eval_pair, load_task
from .tokenizer import build_char_tokenizer


@dataclass
class TinyLlamaArch:
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_layers: int = field(default=4, metadata={"help": "transformer blocks"})
    num_heads: int = field(default=4, metadata={"help": "attention heads"})
    intermediate_size: int = field(default=0, metadata={"help": "MLP width; 0 = the Llama default for hidden_size"})
    max_position_embeddings: int = field(default=32, metadata={"help": "longest sequence in tokens"})


@dataclass
class SFTConfig:
    """``out_dir``: where the chosen checkpoint is saved (``save_pretrained`` model + tokenizer).
    ``target_band``/``target``: sampled accuracy band at ``temperature`` and the preferred value inside it.
    ``max_steps``/``max_minutes``: hard limits. ``eval_every``: steps between checkpoint evaluations."""

    out_dir: str = field(default="assets/llm-arith-tiny", metadata={"help": "where the chosen checkpoint is saved"})
    arch: TinyLlamaArch = field(default_factory=TinyLlamaArch)
    dataset: DatasetSettings = field(default_factory=DatasetSettings)
    max_steps: int = field(default=20000, metadata={"help": "optimizer steps at most"})
    max_minutes: float = field(default=20.0, metadata={"help": "wall-clock minutes at most"})
    batch_size: int = field(default=64, metadata={"help": "examples per step"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW peak learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=100, metadata={"help": "steps of linear warm-up"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global gradient norm"})
    eval_every: int = field(default=250, metadata={"help": "steps between checkpoint evaluations"})
    eval_prompts: int = field(default=500, metadata={"help": "held-out prompts per evaluation"})
    max_new_tokens: int = field(default=6, metadata={"help": "completion length cap in tokens"})
    temperature: float = field(default=1.0, metadata={"help": "temperature of the sampled accuracy (the RL one)"})
    target_band: list[float] = field(default_factory=lambda: [0.3, 0.5],
                                     metadata={"help": "[lo, hi] sampled accuracy the checkpoint should have"})
    target: float = field(default=0.4, metadata={"help": "preferred sampled accuracy inside target_band"})
    stop_above_band: bool = field(default=True, metadata={"help": "stop once the sampled accuracy passes the band"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation and data order"})
    num_threads: int = field(default=1, metadata={"help": "torch CPU threads"})

    def check(self, where: str) -> None:
        lo, hi = (list(self.target_band) + [0, 0])[:2]
        if len(self.target_band) != 2 or not 0 <= lo < hi <= 1 or not lo <= self.target <= hi:
            raise ConfigError(f"{where}.target_band must be [lo, hi] in [0, 1] containing target; got "
                              f"{self.target_band} / {self.target}")
        if self.batch_size < 1 or self.max_steps < 1 or self.eval_every < 1:
            raise ConfigError(f"{where}: batch_size, max_steps and eval_every must be >= 1")


def _train_example_stream(ds: DatasetSettings, seed: int):
    """Endless training examples: fresh ``arith`` problems from the train partition, or the dataset's rows."""
    rng = random.Random(seed)
    if ds.source == "arith":
        limit = 10 ** ds.digits
        while True:
            a, b = rng.randrange(limit), rng.randrange(limit)
            if not is_eval_pair(a, b):
                yield arith_example(a, b)
    rows = load_task(ds).train
    while True:
        yield rows[rng.randrange(len(rows))]


@torch.no_grad()
def sampled_and_greedy_accuracy(model, tokenizer, examples: list[dict[str, Any]], max_new_tokens: int,
                                temperature: float, seed: int = 0) -> dict[str, float]:
    """Accuracy (numeric match) of one sample per prompt at ``temperature`` and of greedy decoding."""
    engine = TorchRolloutEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = [tokenizer(ex["prompt"]).input_ids for ex in examples]
    reward = numeric_match()
    out = {}
    for name, temp in (("sampled_accuracy", temperature), ("greedy_accuracy", 0.0)):
        gen = engine.generate(prompts, 1, max_new_tokens, temp, torch.Generator().manual_seed(seed))
        texts = [tokenizer.decode(c, skip_special_tokens=True) for c in gen.completion_ids]
        # a completion that never ended (no EOS) is wrong even if its digits start right
        r = reward([ex["prompt"] for ex in examples], texts, answer=[ex["answer"] for ex in examples])
        out[name] = sum(float(v) * f for v, f in zip(r, gen.finished)) / len(r)
    return out


def _sft_step(model, tok, examples: list[dict], opt, sched, grad_clip: float) -> float:
    """One supervised step on ``examples`` (prompt -> answer + eos; the loss is the answer tokens' mean NLL)."""
    prompts = [torch.tensor(tok(ex["prompt"]).input_ids) for ex in examples]
    targets = [torch.tensor(tok(str(ex["answer"]), add_special_tokens=False).input_ids + [tok.eos_token_id])
               for ex in examples]
    batch = collate(prompts, targets, None, tok.pad_token_id)
    model.train()
    logp, _ = token_log_probs(model, batch, 1.0)
    loss = -(logp.sum() / batch.completion_mask.sum())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    sched.step()
    return float(loss.detach())


def _band_distance(sampled: float, c) -> float:
    """How far a checkpoint's sampled accuracy is from ``c.target``; any in-band checkpoint beats any outside."""
    lo, hi = c.target_band
    return abs(sampled - c.target) - (1.0 if lo <= sampled <= hi else 0.0)


def run(cfg: dict, run_dir: Path, log=print) -> dict[str, float]:
    c: SFTConfig = from_dict(SFTConfig, cfg, "sft")
    torch.set_num_threads(c.num_threads)
    torch.manual_seed(c.seed)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, c.arch.hidden_size, c.arch.num_layers, c.arch.num_heads,
                             c.arch.intermediate_size or None, c.arch.max_position_embeddings, c.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"sft: tiny Llama {n_params:,} params, vocab {len(tok)}; target sampled accuracy {c.target_band} "
        f"at temperature {c.temperature}")
    if c.dataset.source == "arith":
        validation = arith_problems("train", c.eval_prompts, c.dataset.digits, seed=c.seed + 7919)
        held_out = arith_problems("eval", c.eval_prompts, c.dataset.digits, seed=c.dataset.seed)
    else:
        task = load_task(c.dataset)
        validation = held_out = task.eval[:c.eval_prompts]
    stream = _train_example_stream(c.dataset, c.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, c.warmup_steps)))
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.write_text("")
    best: tuple[float, int, dict[str, torch.Tensor], dict[str, float]] | None = None
    start = time.perf_counter()
    history = []
    step = 0
    loss_sum = 0.0
    while step < c.max_steps:
        loss_sum += _sft_step(model, tok, [next(stream) for _ in range(c.batch_size)], opt, sched, c.grad_clip)
        step += 1
        minutes = (time.perf_counter() - start) / 60
        if step % c.eval_every == 0 or step == c.max_steps or minutes > c.max_minutes:
            model.eval()
            acc = sampled_and_greedy_accuracy(model, tok, validation, c.max_new_tokens, c.temperature, c.seed)
            rec = {"step": step, "minutes": minutes, "loss": loss_sum / c.eval_every, **acc}
            loss_sum = 0.0
            history.append(rec)
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            log(f"sft step {step}: loss {rec['loss']:.4f} sampled {acc['sampled_accuracy']:.3f} "
                f"greedy {acc['greedy_accuracy']:.3f} ({minutes:.1f} min)")
            dist = _band_distance(acc["sampled_accuracy"], c)
            if best is None or dist < best[0]:
                best = (dist, step, {k: v.detach().clone() for k, v in model.state_dict().items()}, rec)
            if (c.stop_above_band and acc["sampled_accuracy"] > c.target_band[1]) or minutes > c.max_minutes:
                break
    assert best is not None
    _, best_step, state, rec = best
    model.load_state_dict(state)
    model.eval()
    final = sampled_and_greedy_accuracy(model, tok, held_out, c.max_new_tokens, c.temperature, c.seed + 1)
    out_dir = _repo_relative(c.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    summary = {"sft/step": float(best_step), "sft/params": float(n_params),
               "sft/val_sampled_accuracy": rec["sampled_accuracy"], "sft/val_greedy_accuracy": rec["greedy_accuracy"],
               "sft/heldout_sampled_accuracy": final["sampled_accuracy"],
               "sft/heldout_greedy_accuracy": final["greedy_accuracy"],
               "sft/minutes": (time.perf_counter() - start) / 60}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    _plot(history, run_dir / "sft_curve.png", best_step, c.target_band)
    if not c.target_band[0] <= rec["sampled_accuracy"] <= c.target_band[1]:
        log(f"WARNING: no evaluated checkpoint had sampled accuracy in {c.target_band}; saved the closest "
            f"({rec['sampled_accuracy']:.3f}); adjust lr/max_steps/eval_every")
    log(f"sft: saved step {best_step} to {out_dir}: held-out sampled {final['sampled_accuracy']:.3f}, greedy "
        f"{final['greedy_accuracy']:.3f}")
    return summary


def _repo_relative(path: str) -> Path:
    """``assets/...`` is the repository's assets folder wherever grove runs from; other paths are as given."""
    p = Path(path)
    if not p.is_absolute() and p.parts and p.parts[0] == "assets":
        return Path(__file__).resolve().parents[2] / p
    return p


def _plot(history: list[dict[str, float]], path: Path, chosen: int, band: list[float]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["sampled_accuracy"] for h in history], label="sampled (T=1)")
    ax.plot(steps, [h["greedy_accuracy"] for h in history], label="greedy")
    ax.axhspan(band[0], band[1], color="green", alpha=0.1, label="target band")
    ax.axvline(chosen, color="k", ls=":", label="chosen")
    ax.set_xlabel("SFT step")
    ax.set_ylabel("accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
