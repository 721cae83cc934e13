"""LLM benchmark: grove's GRPO vs TRL's ``GRPOTrainer`` on the same work, and tree vs flat rollouts at an equal
generated-token budget. ``grove bench llm --out DIR [--quick]`` calls ``run(out_dir, quick)``.

Part 1 (same work, interleaved in one process): the embedded checkpoint ``assets/llm-arith-tiny``, the same
prompt pool (3-digit addition, train split), 8 prompts x 8 completions per step, completions of at most 6 tokens
at temperature 1, lr, clip 0.2, no KL, per-sequence token-mean loss (TRL ``loss_type="grpo"`` = grove
``seq-mean-token-mean``), group-std scaling, one optimizer step per generation, same number of steps, 1 thread.
The variants run step by step in turn (TRL's step, then one iteration of every grove variant from a TRL
callback, in rotating order), so load from other processes on a shared CPU falls on all of them alike; the
global RNG state is saved and restored around the grove iterations so TRL's sampling stream is untouched.
Reported: wall and CPU (process) seconds per step after each run's first, completions per second, reward per
step (mean over seeds), and greedy accuracy on the same 500 held-out problems after training.
``speedup_vs_trl`` = TRL s/step / variant s/step (wall), ``cpu_speedup_vs_trl`` the same with CPU seconds.

Part 2: flat GRPO vs a segment tree (branching [2, 2, 2] every token, TreePO/TreeRL style, ``treerl`` advantages)
with the number of prompts per iteration chosen so both generate about the same number of tokens per iteration;
both run the same number of iterations. Reported: generated tokens, leaves (completions) scored, accuracy.
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
LR, GROUPS, GROUP_SIZE, MAX_NEW = 5e-4, 8, 8, 6  # the same work: step size, prompts x completions, tokens


def _grove_cfg(model: str, steps: int, lr: float, groups: int, group_size: int, max_new: int, tree: bool = False,
               seed: int = 0, behaviour: str = "recompute", engine: str = "fast", share: bool = False,
               train_forward: str = "hf"):
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
                "eval": {"num_prompts": 500, "sampled": False}, "num_threads": 1, "engine": engine,
                "behaviour_logprobs": behaviour, "share_prompt_forward": share, "train_forward": train_forward},
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
             prompts: list[dict[str, Any]], workdir: Path, seed: int = 0, between_steps=None) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same work. ``between_steps(step)`` runs after each TRL step (the interleaved grove
    iterations); its time is not counted as TRL's."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    times: list[float] = []
    cpu: list[float] = []
    resumed = [0.0, 0.0]   # when TRL's current step began (after the previous interleaved work)

    class Interleave(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - resumed[0])
            cpu.append(time.process_time() - resumed[1])
            if between_steps is not None:
                between_steps(len(times) - 1)
            resumed[:] = [time.perf_counter(), time.process_time()]

    args = _trl_args(workdir / "trl", steps, lr, groups, group_size, max_new, seed)
    trainer = GRPOTrainer(model=model, reward_funcs=[_arith_reward], args=args,
                          train_dataset=datasets.Dataset.from_list(prompts), processing_class=tok,
                          callbacks=[Interleave()])
    resumed[:] = [time.perf_counter(), time.process_time()]
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"times": times, "cpu": cpu, "rewards": rewards, "model": trainer.model, "tokenizer": tok}


def _trl_args(out: Path, steps: int, lr: float, groups: int, group_size: int, max_new: int, seed: int):
    """The one GRPOConfig of the same work: TRL's trainer in part 1, and both trainers in part 3."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=groups * group_size, num_generations=group_size,
        max_completion_length=max_new, learning_rate=lr, max_steps=steps, logging_steps=1, report_to="none",
        save_strategy="no", bf16=False, use_cpu=True, loss_type="grpo", scale_rewards="group", beta=0.0,
        epsilon=0.2, temperature=1.0, seed=seed, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        disable_tqdm=True, remove_unused_columns=False, dataloader_num_workers=0, num_iterations=1,
        gradient_checkpointing=False,  # TRL's default True only costs time on a model this small (grove: off too)
    )


def same_config_row(impl: str, seed: int, steps: int, lr: float, groups: int, group_size: int, max_new: int,
                    workdir: Path) -> dict[str, Any]:
    """Part 3, one row in its own process: ``impl`` (``trl`` or ``grove``: ``shared_rl.llm.api.GRPOTrainer``, the
    drop-in) trained with the same ``GRPOConfig`` on the same model, prompts and reward; wall and CPU seconds per
    step (from ``on_step_end``), the reward per step and greedy accuracy on the 500 held-out problems."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from shared_rl.llm.tasks import arith_problems

    torch.set_num_threads(1)
    if impl == "trl":
        from trl import GRPOTrainer
    else:
        from shared_rl.llm.api import GRPOTrainer
    tok = AutoTokenizer.from_pretrained(ASSET)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32)
    times: list[float] = []
    cpu: list[float] = []
    mark = [0.0, 0.0]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - mark[0])
            cpu.append(time.process_time() - mark[1])
            mark[:] = [time.perf_counter(), time.process_time()]

    trainer = GRPOTrainer(model=model, reward_funcs=[_arith_reward],
                          args=_trl_args(workdir / impl, steps, lr, groups, group_size, max_new, seed),
                          train_dataset=datasets.Dataset.from_list(arith_problems("train", 20000, 3, seed=0)),
                          processing_class=tok, callbacks=[Clock()])
    mark[:] = [time.perf_counter(), time.process_time()]
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"impl": impl, "seed": seed, "times": times, "cpu": cpu, "rewards": rewards,
            "accuracy": _accuracy(trainer.model, tok, arith_problems("eval", 500, 3, seed=0))}


def _same_config_rows(seeds, steps, lr, groups, group_size, max_new, workdir: Path) -> dict[str, list[dict]]:
    """Each (trainer, seed) of part 3 in a fresh process (``python -m bench.llm_vs_trl --same-config-row``), the
    order alternating by seed."""
    import subprocess
    import sys

    out: dict[str, list[dict]] = {}
    for seed in seeds:
        for impl in (("trl", "grove") if seed % 2 == 0 else ("grove", "trl")):
            path = workdir / f"same-config-{impl}-s{seed}.json"
            subprocess.run([sys.executable, "-m", "bench.llm_vs_trl", "--same-config-row", impl, "--seed", str(seed),
                            "--steps", str(steps), "--row-out", str(path)], check=True, cwd=ASSET.parents[1])
            out.setdefault(impl, []).append(json.loads(path.read_text()))
    return out


GROVE_VARIANTS = {  # name -> (llm.engine, llm.behaviour_logprobs, llm.share_prompt_forward, llm.train_forward)
    "grove_grpo_torch_engine": ("torch", "recompute", False, "hf"),
    "grove_grpo": ("fast", "recompute", False, "hf"),
    "grove_grpo_engine_logp": ("fast", "engine", False, "hf"),
    "grove_grpo_deferred": ("fast", "deferred", False, "hf"),
    "grove_grpo_shared": ("fast", "recompute", True, "hf"),
    "grove_grpo_deferred_shared": ("fast", "deferred", True, "hf"),
    "grove_grpo_fast_train": ("fast", "deferred", True, "fast"),
}


def _same_work_one_seed(seed: int, steps: int, lr: float, groups: int, group_size: int, max_new: int,
                        prompts, eval_examples, workdir: Path) -> dict[str, dict[str, Any]]:
    """TRL and every grove variant for ``steps`` steps, interleaved step by step."""
    import random

    from shared_rl.trainer import Trainer

    trainers = {name: Trainer(_grove_cfg(str(ASSET), steps, lr, groups, group_size, max_new, seed=seed,
                                         engine=engine, behaviour=behaviour, share=share, train_forward=forward),
                              None, log=lambda s: None)
                for name, (engine, behaviour, share, forward) in GROVE_VARIANTS.items()}
    res = {name: {"times": [], "cpu": [], "rewards": [], "rollout_s": [], "train_s": []} for name in trainers}

    def grove_steps(step: int) -> None:
        states = (torch.get_rng_state(), random.getstate())   # keep TRL's random stream as if run alone
        names = list(trainers)
        names = names[step % len(names):] + names[:step % len(names)]   # rotate who runs first
        for name in names:
            t, c = time.perf_counter(), time.process_time()
            m = trainers[name].iteration(step)
            r = res[name]
            r["times"].append(time.perf_counter() - t)
            r["cpu"].append(time.process_time() - c)
            r["rewards"].append(m["reward/mean"])
            r["rollout_s"].append(m["time/rollout"])
            r["train_s"].append(m["time/train"])
        torch.set_rng_state(states[0])
        random.setstate(states[1])

    trl = _run_trl(ASSET, steps, lr, groups, group_size, max_new, prompts, workdir, seed=seed,
                   between_steps=grove_steps)
    trl["accuracy"] = _accuracy(trl.pop("model"), trl.pop("tokenizer"), eval_examples)
    for name, tr in trainers.items():
        res[name]["accuracy"] = tr.domain.evaluate(steps)["eval/accuracy"]
    return {"trl_grpo": trl, **res}


def _load_asset():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32), AutoTokenizer.from_pretrained(ASSET)


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
    lr, groups, group_size, max_new = LR, GROUPS, GROUP_SIZE, MAX_NEW
    prompts = arith_problems("train", 20000, 3, seed=0)
    eval_examples = arith_problems("eval", 500, 3, seed=0)
    rows: list[dict[str, Any]] = []
    curves: dict[str, list[float]] = {}

    # ---- part 1: same work, grove vs TRL, interleaved step by step ------------------------------------------
    seeds = [0] if quick else [0, 1, 2]
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, r in _same_work_one_seed(seed, steps, lr, groups, group_size, max_new, prompts,
                                               eval_examples, Path(tmp) / f"seed{seed}").items():
                runs.setdefault(name, []).append(r)
    n = groups * group_size

    def per_step(name: str, key: str) -> float:   # mean over every seed's steps after its first
        return statistics.mean(x for r in runs[name] for x in r[key][1:])

    def curve(name: str) -> list[float]:          # reward per step, mean over seeds
        return [statistics.mean(r["rewards"][i] for r in runs[name]) for i in range(steps)]

    trl_s, trl_cpu = per_step("trl_grpo", "times"), per_step("trl_grpo", "cpu")
    for name in ["trl_grpo", *GROVE_VARIANTS]:
        wall, cpu, rewards = per_step(name, "times"), per_step(name, "cpu"), curve(name)
        row = {"variant": name, "s_per_step": wall, "cpu_s_per_step": cpu, "completions_per_s": n / wall,
               "speedup_vs_trl": trl_s / wall, "cpu_speedup_vs_trl": trl_cpu / cpu}
        if name != "trl_grpo":
            row.update({"rollout_s_per_step": per_step(name, "rollout_s"), "train_s_per_step": per_step(name, "train_s")})
        row.update({"reward_first": rewards[0], "reward_mean": statistics.mean(rewards),
                    "reward_last10": statistics.mean(rewards[-10:]),
                    "eval_accuracy": statistics.mean(r["accuracy"] for r in runs[name]),
                    "eval_accuracy_seeds": " ".join(f"{r['accuracy']:.3f}" for r in runs[name])})
        rows.append(row)
        curves[name] = rewards

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

    # ---- part 3: the same GRPOConfig handed to TRL's GRPOTrainer and to grove's drop-in ----------------------
    with tempfile.TemporaryDirectory() as tmp:
        same = _same_config_rows(seeds, steps, lr, groups, group_size, max_new, Path(tmp))
    base = _accuracy(*_load_asset(), eval_examples)

    def same_step(impl: str, key: str) -> float:
        return statistics.mean(x for r in same[impl] for x in r[key][1:])

    for impl, name in (("trl", "same_config_trl"), ("grove", "same_config_grove_dropin")):
        rewards = [statistics.mean(r["rewards"][i] for r in same[impl]) for i in range(steps)]
        rows.append({"variant": name, "s_per_step": same_step(impl, "times"), "cpu_s_per_step": same_step(impl, "cpu"),
                     "speedup_vs_trl": same_step("trl", "times") / same_step(impl, "times"),
                     "cpu_speedup_vs_trl": same_step("trl", "cpu") / same_step(impl, "cpu"),
                     "reward_first": rewards[0], "reward_mean": statistics.mean(rewards),
                     "reward_last10": statistics.mean(rewards[-10:]), "eval_accuracy_before": base,
                     "eval_accuracy": statistics.mean(r["accuracy"] for r in same[impl]),
                     "eval_accuracy_seeds": " ".join(f"{r['accuracy']:.3f}" for r in same[impl])})
        curves[name] = rewards

    by_name = {r["variant"]: r for r in rows}
    best = max((by_name[name] for name in GROVE_VARIANTS), key=lambda r: r["cpu_speedup_vs_trl"])
    dropin = by_name["same_config_grove_dropin"]
    _plot(curves, out_dir / "llm_bench.png")
    notes = (f"Command: `grove bench llm --out {out_dir}` (quick={quick}). Part 1: {steps} steps x "
             f"{len(seeds)} seed(s) ({', '.join(map(str, seeds))}) of {groups} prompts x {group_size} completions "
             f"(<= {max_new} tokens, temperature 1, lr {lr}, clip 0.2, no KL, TRL loss_type=grpo = grove "
             f"seq-mean-token-mean, one optimizer step per generation, no gradient checkpointing), same checkpoint (assets/llm-arith-tiny) and "
             f"prompt pool, CPU, 1 thread. TRL and every grove variant run interleaved step by step in one process "
             f"(TRL step, then one iteration of each grove variant in rotating order), so other load on the shared "
             f"CPU hits them alike. Times are means over every step but each run's first; cpu_s_per_step is process "
             f"CPU time (the steadier measure on a shared machine). Variants (llm.engine / behaviour_logprobs / "
             f"share_prompt_forward): grove_grpo_torch_engine = torch / recompute / off (HF-module KV-cache "
             f"sampler); grove_grpo = fast / recompute / off; grove_grpo_engine_logp = fast / engine / off (the "
             f"sampler's log-probs, ratio 1 to ~1e-6); grove_grpo_deferred = fast / deferred / off (logp_old from the "
             f"first loss forward, as TRL with num_iterations=1; ratio exactly 1); grove_grpo_shared = fast / "
             f"recompute / on (each prompt's forward run once and its KV cache expanded to its 8 completions, in the "
             f"loss and the recompute forward); grove_grpo_deferred_shared = fast / deferred / on; "
             f"grove_grpo_fast_train = fast / deferred / on with llm.train_forward fast (the loss log-probs from "
             f"grove's lean packed forward, shared_rl/llm/fast_train.py: real tokens only, each prompt once; equal "
             f"to the HF forward to ~1e-6). recompute and "
             f"deferred train bitwise alike (same curves); the shared forward differs from the one-pass forward by "
             f"float rounding (~1e-6), which could flip a sampled token after some updates (it did not within "
             f"these runs: all grove variants have the same rewards and accuracies). rollout_s / train_s: "
             f"grove's wall time in rollout (sampling, rewards, recomputed behaviour log-probs) and in the loss "
             f"forward/backward/optimizer. Rewards: mean over seeds per step; reward_first is before any update. "
             f"eval_accuracy: greedy on 500 held-out problems after training (mean over seeds; per seed in "
             f"eval_accuracy_seeds). Part 2 (fast engine, recompute, one-pass forward, as before): tree = branching "
             f"[2,2,2] at every token (segment_tokens 1), treerl advantages, prompts per iteration sized to the flat "
             f"run's generated tokens per iteration; same iterations; one seed. Plot: llm_bench.png "
             f"(docs/bench/llm.png). Fastest variant: {best['variant']}, {best['cpu_speedup_vs_trl']:.2f}x "
             f"TRL by CPU time ({best['speedup_vs_trl']:.2f}x wall); its loss forward/backward/optimizer is "
             f"{best['train_s_per_step'] / best['s_per_step']:.0%} of its wall time per step. Part 3: one "
             f"GRPOConfig (part 1's: TRL's defaults but gradient checkpointing off, as grove's variants) handed to TRL's "
             f"GRPOTrainer (same_config_trl) and to grove's drop-in shared_rl.llm.api.GRPOTrainer "
             f"(same_config_grove_dropin, what a TRL user gets by changing the import: grove's engine chosen by "
             f"llm.engine auto, behaviour log-probs from the first loss forward, the loss log-probs from "
             f"llm.train_forward auto = the lean forward, and TRL's default optim adamw_torch_fused as AdamW's fused "
             f"kernel, as TRL runs it), each (trainer, seed) in a fresh "
             f"process, same seeds; times from on_step_end; eval_accuracy_before is the checkpoint's. The drop-in: "
             f"{dropin['cpu_speedup_vs_trl']:.2f}x TRL by CPU time ({dropin['speedup_vs_trl']:.2f}x wall), greedy "
             f"accuracy {dropin['eval_accuracy_before']:.3f} -> {dropin['eval_accuracy']:.3f} (TRL "
             f"{by_name['same_config_trl']['eval_accuracy']:.3f}).")
    result = write_results(out_dir, "llm", rows, notes, extra={"curves": curves},
                           doc_path=None if quick else DOC)
    if not quick:
        import shutil

        shutil.copyfile(out_dir / "llm_bench.png", DOC.with_suffix(".png"))
    # the decode loop's host overhead, compacting vs static loop (issue 42): its own section of the page
    from bench import llm_decode

    llm_decode.run(Path(out_dir) / "decode", quick)
    return result


def _plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name in ("trl_grpo", *GROVE_VARIANTS):
        axes[0].plot(curves[name], label=name)
    axes[0].set_title("same work: reward per step (mean over seeds)")
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
    p.add_argument("--same-config-row", choices=("trl", "grove"), help="(a row's process) part 3's one run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--row-out", default="")
    p.add_argument("--same-config", action="store_true",
                   help="only part 3 (the same GRPOConfig to both trainers), --seeds seeds, printed; no docs written")
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args()
    if a.same_config:
        with tempfile.TemporaryDirectory() as tmp:
            got = _same_config_rows(range(a.seeds), a.steps, LR, GROUPS, GROUP_SIZE, MAX_NEW, Path(tmp))
        per = {impl: {k: statistics.mean(x for r in rs for x in r[k][1:]) for k in ("cpu", "times")}
               for impl, rs in got.items()}
        print(json.dumps({"cpu_s_per_step": {i: v["cpu"] for i, v in per.items()},
                          "s_per_step": {i: v["times"] for i, v in per.items()},
                          "cpu_speedup_vs_trl": per["trl"]["cpu"] / per["grove"]["cpu"],
                          "speedup_vs_trl": per["trl"]["times"] / per["grove"]["times"],
                          "eval_accuracy": {i: [r["accuracy"] for r in rs] for i, rs in got.items()}}, indent=1))
    elif a.same_config_row:
        out = Path(a.row_out)
        row = same_config_row(a.same_config_row, a.seed, a.steps, LR, GROUPS, GROUP_SIZE, MAX_NEW,
                              out.parent / f"work-{out.stem}")
        out.write_text(json.dumps(row))
    else:
        print(json.dumps(run(Path(a.out), a.quick)["rows"], indent=1))
