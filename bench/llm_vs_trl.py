"""LLM benchmark: grove's GRPO vs TRL's ``GRPOTrainer`` on the same work, and tree vs flat rollouts at an equal
generated-token budget. ``grove bench llm --out DIR [--quick]`` calls ``run(out_dir, quick)``.

Part 1 (same work, side by side in one process): the embedded checkpoint ``assets/llm-arith-tiny``, the same
prompt pool (3-digit addition, train split), 8 prompts x 8 completions per step, completions of at most 6 tokens
at temperature 1, lr, clip 0.2, no KL, per-sequence token-mean loss (TRL ``loss_type="grpo"`` = grove
``seq-mean-token-mean``), group-std scaling, one optimizer step per generation, same number of steps, 1 thread.
Reported: seconds per step (after the first), completions per second, reward per step, and greedy accuracy on
the same 500 held-out problems after training. ``speedup_vs_trl`` = TRL s/step / grove s/step.

Part 2: flat GRPO vs a segment tree (branching [2, 2, 2] every token, TreePO/TreeRL style, ``treerl`` advantages)
with the number of prompts per iteration chosen so both generate about the same number of tokens per iteration;
both run the same number of iterations. Reported: generated tokens, leaves (completions) scored, accuracy.
Absolute times mean little on a shared CPU; the ratios are the result.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ASSET = Path(__file__).resolve().parents[1] / "assets" / "llm-arith-tiny"
DOC = Path(__file__).resolve().parents[1] / "docs" / "bench" / "llm.md"


def _grove_cfg(model: str, steps: int, lr: float, groups: int, group_size: int, max_new: int, tree: bool = False,
               seed: int = 0, engine_logprobs: bool = False):
    from shared_rl.config import load_train_config

    data = {
        "domain": "llm", "seed": seed, "iterations": steps,
        "rollout": {"groups_per_iteration": groups, "group_size": group_size},
        "advantage": {"estimator": "treerl" if tree else "grpo", "clip": None},
        "loss": {"clip_low": 0.2, "aggregation": "seq-mean-token-mean", "kl_coef": 0.0},
        "optim": {"lr": lr, "grad_clip": 1.0, "inner_epochs": 1, "minibatches_per_epoch": 1},
        "eval": {"at_start": False},
        "logging": {"progress": False},
        "llm": {"model": model, "max_new_tokens": max_new, "temperature": 1.0,
                "dataset": {"source": "arith", "digits": 3, "num_train": 20000, "num_eval": 500},
                "rewards": [{"name": "numeric_match", "weight": 1.0}],
                "eval": {"num_prompts": 500, "sampled": False}, "num_threads": 1,
                "behaviour_logprobs": "engine" if engine_logprobs else "recompute"},
    }
    if tree:
        data["llm"]["tree"] = {"enabled": True, "branching": [2, 2, 2], "segment_tokens": 1}
    return load_train_config(data)


def _run_grove(cfg) -> dict[str, Any]:
    """Run iterations directly (no per-iteration eval) and time each one."""
    from shared_rl.trainer import Trainer

    trainer = Trainer(cfg, None, log=lambda s: None)
    times, cpu, rewards, tokens, leaves = [], [], [], 0.0, 0.0
    for it in range(cfg.iterations):
        t, c = time.perf_counter(), time.process_time()
        m = trainer.iteration(it)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        rewards.append(m["reward/mean"])
        tokens += m.get("completion/tokens", 0.0)
        leaves += m.get("completion/count", 0.0)
    acc = trainer.domain.evaluate(cfg.iterations)["eval/accuracy"]
    return {"times": times, "cpu": cpu, "rewards": rewards, "tokens": tokens, "leaves": leaves, "accuracy": acc}


def _arith_reward(prompts, completions, answer, **kwargs):
    """TRL-signature reward: 1 if the completion's number equals the answer (same check as grove's numeric_match)."""
    from shared_rl.llm.rewards import numeric_match

    return numeric_match()(prompts=prompts, completions=completions, answer=answer)


def _run_trl(model_dir: Path, steps: int, lr: float, groups: int, group_size: int, max_new: int,
             prompts: list[dict[str, Any]], workdir: Path, seed: int = 0) -> dict[str, Any]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stamps: list[tuple[float, float]] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append((time.perf_counter(), time.process_time()))

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=groups * group_size, num_generations=group_size,
        max_completion_length=max_new, learning_rate=lr, max_steps=steps, logging_steps=1, report_to="none",
        save_strategy="no", bf16=False, use_cpu=True, loss_type="grpo", scale_rewards="group", beta=0.0,
        epsilon=0.2, temperature=1.0, seed=seed, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0, num_iterations=1,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[_arith_reward], args=args,
                          train_dataset=datasets.Dataset.from_list(prompts), processing_class=tok,
                          callbacks=[Stamp()])
    start = (time.perf_counter(), time.process_time())
    trainer.train()
    times = [b[0] - a[0] for a, b in zip([start] + stamps[:-1], stamps)]
    cpu = [b[1] - a[1] for a, b in zip([start] + stamps[:-1], stamps)]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"times": times, "cpu": cpu, "rewards": rewards, "model": trainer.model, "tokenizer": tok}


def _accuracy(model, tok, eval_examples) -> float:
    from shared_rl.llm.pretrain import sampled_and_greedy_accuracy

    model.eval()
    return sampled_and_greedy_accuracy(model, tok, eval_examples, 6, 1.0)["greedy_accuracy"]


def _mean_tail(xs: list[float], skip: int = 1) -> float:
    tail = xs[skip:] if len(xs) > skip else xs
    return statistics.mean(tail)


def run(out_dir: Path, quick: bool = False) -> dict:
    from shared_rl.bench import write_results
    from shared_rl.llm.tasks import arith_problems

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (ASSET / "config.json").is_file():
        raise FileNotFoundError(f"{ASSET} is missing; make it with: grove pretrain configs/llm/arith_sft.yaml")
    steps = 8 if quick else 40
    budget_iters = 10 if quick else 120
    lr, groups, group_size, max_new = 5e-4, 8, 8, 6
    prompts = arith_problems("train", 20000, 3, seed=0)
    eval_examples = arith_problems("eval", 500, 3, seed=0)
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[float]] = {}

    # ---- part 1: same work, grove vs TRL --------------------------------------------------------------------
    with tempfile.TemporaryDirectory() as tmp:
        trl = _run_trl(ASSET, steps, lr, groups, group_size, max_new, prompts, Path(tmp))
        trl_acc = _accuracy(trl["model"], trl["tokenizer"], eval_examples)
    grove = _run_grove(_grove_cfg(str(ASSET), steps, lr, groups, group_size, max_new))
    grove_fast = _run_grove(_grove_cfg(str(ASSET), steps, lr, groups, group_size, max_new, engine_logprobs=True))
    n = groups * group_size
    trl_s, trl_cpu = _mean_tail(trl["times"]), _mean_tail(trl["cpu"])
    for name, res, acc in (("trl_grpo", trl, trl_acc), ("grove_grpo", grove, grove["accuracy"]),
                           ("grove_grpo_engine_logp", grove_fast, grove_fast["accuracy"])):
        wall, cpu = _mean_tail(res["times"]), _mean_tail(res["cpu"])
        rows.append({"variant": name, "s_per_step": wall, "cpu_s_per_step": cpu, "completions_per_s": n / wall,
                     "reward_first": res["rewards"][0], "reward_last5": statistics.mean(res["rewards"][-5:]),
                     "eval_accuracy": acc, "speedup_vs_trl": trl_s / wall, "cpu_speedup_vs_trl": trl_cpu / cpu})
        curves[name] = res["rewards"]

    # ---- part 2: tree vs flat at an equal generated-token budget --------------------------------------------
    flat = _run_grove(_grove_cfg(str(ASSET), budget_iters, lr, groups, group_size, max_new))
    flat_tokens_per_iter = flat["tokens"] / budget_iters
    # a tree with branching [2,2,2] per prompt generates 2 + 4 + 8*(rest) tokens: size its prompt count to match
    probe = _run_grove(_grove_cfg(str(ASSET), 1, lr, groups, group_size, max_new, tree=True))
    tree_tokens_per_prompt = probe["tokens"] / groups
    tree_groups = max(1, round(flat_tokens_per_iter / tree_tokens_per_prompt))
    tree = _run_grove(_grove_cfg(str(ASSET), budget_iters, lr, tree_groups, group_size, max_new, tree=True))
    base_acc = _run_grove(_grove_cfg(str(ASSET), 0, lr, groups, group_size, max_new))["accuracy"]
    for name, res, g in (("flat_grpo_budget", flat, groups), ("tree_treerl_budget", tree, tree_groups)):
        rows.append({"variant": name, "prompts_per_iter": g, "iterations": budget_iters,
                     "generated_tokens": res["tokens"], "completions_scored": res["leaves"],
                     "s_per_iter": _mean_tail(res["times"]), "eval_accuracy_before": base_acc,
                     "eval_accuracy": res["accuracy"]})
        curves[name] = res["rewards"]

    _plot(curves, out_dir / "llm_bench.png")
    notes = (f"Part 1: {steps} steps each of {groups} prompts x {group_size} completions (<= {max_new} tokens, "
             f"temperature 1, lr {lr}, clip 0.2, no KL, TRL loss_type=grpo = grove seq-mean-token-mean), same "
             f"checkpoint (assets/llm-arith-tiny) and prompt pool, CPU, 1 thread, run one after the other in one "
             f"process; s/step excludes the first step; cpu_s_per_step is process CPU time (robust to other "
             f"load on a shared machine, so cpu_speedup_vs_trl is the steadier ratio). grove_grpo_engine_logp takes "
             f"behaviour log-probs from the sampler instead of a recompute forward (TRL with num_iterations=1 also "
             f"skips that forward). eval_accuracy: greedy on 500 held-out problems after "
             f"training. Part 2: tree = branching [2,2,2] at every token (segment_tokens 1), treerl advantages, "
             f"prompts per iteration sized to the flat run's generated tokens per iteration; same iterations. "
             f"quick={quick}. Shared CPU: absolute times are noisy, ratios are the result; one seed, so accuracy "
             f"differences of a few points are within noise. Plot: llm_bench.png (docs/bench/llm.png).")
    result = write_results(out_dir, "llm", rows, notes, extra={"curves": curves},
                           doc_path=None if quick else DOC)
    if not quick:
        import shutil

        shutil.copyfile(out_dir / "llm_bench.png", DOC.with_suffix(".png"))
    return result


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name in ("trl_grpo", "grove_grpo", "grove_grpo_engine_logp"):
        axes[0].plot(curves[name], label=name)
    axes[0].set_title("same work: reward per step")
    for name in ("flat_grpo_budget", "tree_treerl_budget"):
        ys = curves[name]
        k = max(1, len(ys) // 20)
        smooth = [statistics.mean(ys[max(0, i - k):i + 1]) for i in range(len(ys))]
        axes[1].plot(smooth, label=name)
    axes[1].set_title("equal token budget: reward per iteration")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="runs/bench-llm")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(json.dumps(run(Path(a.out), a.quick)["rows"], indent=1))
