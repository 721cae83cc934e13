"""Behaviour cloning of the tiny VLA on noisy scripted-expert demos (``grove train`` with ``kind: supervised``).

``run(cfg, run_dir, log)`` is five steps, each a function here:

1. ``collect``: the demonstrations (collected first if the data file does not exist);
2. ``train``: the VLA (flow-matching loss for the flow head, cross-entropy over 256 bins for the discrete head) on
   (frame, proprio, instruction) -> next K actions with random-shift augmentation (DrQ, Kostrikov et al. 2021),
   ``metrics.jsonl`` as it goes, the model (``model.safetensors`` + ``config.json``) in ``run_dir/model`` at the
   end; it stops at ``train_steps`` or ``time_budget_s``;
3. ``evaluate``: the deterministic policy (ODE / arg-max) on held-out evaluation reset states (``robotics.evaluation``);
4. ``export``: the model to ``export_dir`` when set (``assets/metaworld-vla-tiny`` is made this way);
5. ``plot``: ``bc_curve.png``.
"""
from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shared_rl.errors import ConfigError
from shared_rl.rundir import atomic_write_text

from .collect import collect_demos
from .data import Episode, load_episodes, save_episodes
from .datasets import ChunkDataset
from .envs.vector import EnvConfig, make_vector_env
from .evaluation import evaluate_policy, policy_digest
from .policies.vla import TinyVLA, VLAConfig


@dataclass
class CollectConfig:
    demos_per_task: int = field(default=40, metadata={"help": "scripted-expert episodes per task"})
    task_demos: dict[str, int] = field(default_factory=dict, metadata={
        "help": "per-task override of demos_per_task, e.g. {push-v3: 160} for a task the clone needs more of"})
    noise_std: float = field(default=0.3, metadata={"help": "std of the Gaussian noise added to expert actions"})
    seed: int = field(default=0, metadata={"help": "seed of the action noise"})
    labels: str = field(default="executed", metadata={
        "help": "executed (record the noisy action) | expert (DART: the expert's clean action at the noisy state)"})

    def check(self, where: str) -> None:
        if self.labels not in ("executed", "expert"):
            raise ConfigError(f"{where}.labels must be 'executed' or 'expert', got {self.labels!r}")
        low = {t: n for t, n in self.task_demos.items() if n < 1}
        if self.demos_per_task < 1 or low:
            raise ConfigError(f"{where}: demos_per_task and every task_demos count must be >= 1, got "
                              f"{self.demos_per_task} and {low or self.task_demos}")


@dataclass
class BCConfig:
    data: str = field(default="runs/robotics-demos/demos40.npz",
                      metadata={"help": "demonstrations .npz; collected there first if missing"})
    collect: CollectConfig = field(default_factory=CollectConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: VLAConfig = field(default_factory=VLAConfig)
    train_steps: int = field(default=6000, metadata={"help": "optimizer steps"})
    time_budget_s: float = field(default=0.0, metadata={"help": "> 0: stop training after this many seconds"})
    batch_size: int = field(default=64, metadata={"help": "samples (frame -> action chunk) per step"})
    lr: float = field(default=3e-4, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay"})
    augment_shift: int = field(default=4, metadata={"help": "pixels of random-shift augmentation; 0 = off"})
    log_every: int = field(default=200, metadata={"help": "steps between log lines"})
    eval_states_per_task: int = field(default=20, metadata={"help": "held-out reset states per task for evaluation"})
    eval_every: int = field(default=0, metadata={"help": "steps between evaluations; 0 = only at the end"})
    gifs: bool = field(default=True, metadata={"help": "write a GIF of one evaluation episode per task"})
    seed: int = field(default=0, metadata={"help": "seed of initialisation, batches and augmentation"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    export_dir: str = field(default="", metadata={
        "help": "also write the final model here (e.g. assets/metaworld-vla-tiny); '' = only the run directory"})
    val_demos_per_task: int = field(default=0, metadata={
        "help": "demos per task held out of training (the last ones of each task): every val_every steps the BC loss "
                "on them (fixed noise, no augmentation) is measured and the model kept is the one with the lowest; "
                "0 = the last step's model"})
    val_every: int = field(default=200, metadata={"help": "steps between validation losses (val_demos_per_task > 0)"})
    aux_object_coef: float = field(default=0.0, metadata={
        "help": "weight of an auxiliary loss: a linear head (training only) predicts the object's xyz (Meta-World "
                "state obs[4:7], z-scored) from the image features, so the encoder learns where the object is; "
                "needs demos with states; 0 = off"})

    def check(self, where: str = "bc") -> None:
        if self.batch_size < 1 or self.train_steps < 0:
            raise ConfigError(f"{where}: batch_size must be >= 1 and train_steps >= 0")
        self.env.check_eval_states(self.eval_states_per_task, where)
        if self.env.image_size != self.model.image_size:
            raise ConfigError(f"{where}.model.image_size ({self.model.image_size}) must equal env.image_size ({self.env.image_size})")
        if self.val_demos_per_task < 0 or self.val_every < 1:
            raise ConfigError(f"{where}: val_demos_per_task must be >= 0 and val_every >= 1")
        stray = sorted(set(self.collect.task_demos) - set(self.env.tasks))
        if stray:
            raise ConfigError(f"{where}.collect.task_demos names {stray}, which are not in env.tasks {self.env.tasks}")


def fit_task_adapters(policy: TinyVLA, episodes: list[Episode], steps: int, batch_size: int = 64, lr: float = 1e-3,
                      augment_shift: int = 4, seed: int = 0, log=print, log_every: int = 500) -> list[float]:
    """Behaviour cloning through the policy's task adapters only (``TinyVLA.add_task_adapters`` first): every other
    weight is frozen, the image features are computed without a graph, AdamW (no weight decay) with a cosine decay
    from ``lr`` to 0 over ``steps``, gradients clipped to norm 1. Each row trains only its own task's adapter, so the
    demos of one task leave every other task's actions exactly as they were. Returns the loss of every step.

    The five-task clone's 3000 steps, shared by five tasks, underfit its own demos (push most); this fits its
    adapters to them (docs/methods/robotics.md, "The clone underfits its own demos")."""
    if policy.adapters is None:
        raise ValueError("fit_task_adapters needs task adapters on the policy (TinyVLA.add_task_adapters)")
    for name, prm in policy.named_parameters():
        prm.requires_grad_(name.startswith("adapters."))
    params = [prm for prm in policy.parameters() if prm.requires_grad]
    data = ChunkDataset(episodes, policy.cfg.chunk, policy)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    losses: list[float] = []
    policy.train()
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = rng.integers(0, len(data), size=batch_size)
        imgs, pro, tids, chunks = data.batch(idx, augment_shift, rng)
        with torch.no_grad():  # the encoder is frozen
            img = policy.image_features(imgs)
        loss = policy.bc_loss(policy.fuse_features(img, pro, tids), chunks, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if log_every and step % log_every == 0:
            log(f"step {step}: bc loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")
    return losses


def run(cfg: dict, run_dir: Path, log=print) -> dict[str, float]:
    """The ``kind: supervised`` job of ``domain: robotics``: collect, train, evaluate, export, plot."""
    from shared_rl.config import from_dict

    c: BCConfig = from_dict(BCConfig, cfg, "robotics-bc")
    torch.set_num_threads(max(1, c.threads))
    torch.manual_seed(c.seed)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    episodes = collect(c, log)
    venv = make_vector_env(c.env)  # one env pool for the evaluations during and after training
    try:
        trained = train(c, episodes, venv, run_dir, log)
        result = evaluate(c, trained, venv, run_dir)
    finally:
        venv.close()
    export(c, run_dir, result, log)
    plot(trained.history, run_dir / "bc_curve.png")
    log("bc: " + " ".join(f"{k}={v:.3g}" for k, v in result.items() if k.startswith("eval/")))
    return result


def collect(c: BCConfig, log=print) -> list[Episode]:
    """The demonstrations of ``env.tasks`` from ``c.data``; collected (and saved there) first if it is missing."""
    data_path = Path(c.data)
    if data_path.is_file():
        episodes = load_episodes(data_path)
        log(f"bc: {len(episodes)} demos from {data_path}")
    else:
        log(f"bc: {data_path} missing; collecting {c.collect.demos_per_task} demos/task, {c.collect.task_demos or 'no'} "
            f"overrides (noise {c.collect.noise_std})")
        episodes = collect_demos(c.env, c.collect.demos_per_task, c.collect.noise_std, c.collect.seed, log=log,
                                 labels=c.collect.labels, task_demos=c.collect.task_demos)
        save_episodes(episodes, data_path)
    episodes = [e for e in episodes if e.task in c.env.tasks]
    if not episodes:
        raise ConfigError(f"{data_path} has no demos for env.tasks {c.env.tasks}")
    return episodes


@dataclass
class Trained:
    """What ``train`` hands to ``evaluate``: the policy, the metric records so far, where and when it stopped."""

    policy: TinyVLA
    history: list[dict]
    step: int
    seconds: float


def new_policy(c: BCConfig, episodes: list[Episode]) -> TinyVLA:
    """A fresh VLA whose input sizes and proprio normalisation come from the demonstrations."""
    mcfg = c.model
    mcfg.image_channels = episodes[0].images.shape[-1]
    mcfg.proprio_dim = episodes[0].proprio.shape[-1]
    mcfg.action_dim = episodes[0].actions.shape[-1]
    if c.env.kind == "libero":  # LIBERO's instructions are not in the Meta-World vocabulary
        from .policies.vla import libero_vocab

        mcfg.vocab = libero_vocab(mcfg.vocab)
    allp = np.concatenate([e.proprio for e in episodes])
    mcfg.proprio_mean = allp.mean(0).tolist()
    mcfg.proprio_std = (allp.std(0) + 1e-3).tolist()
    return TinyVLA(mcfg)


class ObjectHead(torch.nn.Module):
    """``aux_object_coef``'s training-only linear head: the object's z-scored xyz from the image features (not part
    of the saved model)."""

    def __init__(self, c: BCConfig, data: ChunkDataset):
        super().__init__()
        if data.objects is None:
            raise ConfigError(f"aux_object_coef={c.aux_object_coef} needs demos with Meta-World states; {c.data} "
                              f"has none (collect them with `grove robotics collect`)")
        self.mean, self.std = data.objects.mean(0), data.objects.std(0) + 1e-3
        self.linear = torch.nn.Linear(c.model.feature_dim, 3)
        self.objects = data.objects

    def loss(self, img: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        target = torch.from_numpy((self.objects[idx] - self.mean) / self.std)
        return torch.nn.functional.mse_loss(self.linear(img), target)


def split_validation(episodes: list[Episode], per_task: int) -> tuple[list[Episode], list[Episode]]:
    """(training, validation): the last ``per_task`` demos of each task are validation; a task needs at least one
    training demo beside them."""
    if per_task == 0:
        return episodes, []
    by_task: dict[str, list[Episode]] = {}
    for e in episodes:
        by_task.setdefault(e.task, []).append(e)
    short = {t: len(eps) for t, eps in by_task.items() if len(eps) <= per_task}
    if short:
        raise ConfigError(f"val_demos_per_task={per_task} leaves no training demo for {short} (demos per task); "
                          f"lower it or collect more")
    val = {id(e) for eps in by_task.values() for e in eps[-per_task:]}
    return [e for e in episodes if id(e) not in val], [e for e in episodes if id(e) in val]


class ValidationLoss:
    """The BC loss on the validation demos with the same noise every time (one generator seed, no augmentation), so
    two measurements differ only by the weights."""

    def __init__(self, episodes: list[Episode], policy: TinyVLA, chunk: int, seed: int, batch: int = 256):
        self.data = ChunkDataset(episodes, chunk, policy)
        self.seed, self.batch = seed, batch

    @torch.no_grad()
    def __call__(self, policy: TinyVLA) -> float:
        was = policy.training
        policy.eval()
        gen = torch.Generator().manual_seed(self.seed)
        rng = np.random.default_rng(self.seed)
        total, n = 0.0, len(self.data)
        for a in range(0, n, self.batch):
            idx = np.arange(a, min(n, a + self.batch))
            imgs, pro, tids, chunks = self.data.batch(idx, 0, rng)
            h = policy.fuse_features(policy.image_features(imgs), pro, tids)
            total += float(policy.bc_loss(h, chunks, gen)) * len(idx)
        policy.train(was)
        return total / n


def train(c: BCConfig, episodes: list[Episode], venv, run_dir: Path, log=print) -> Trained:
    """AdamW with a cosine schedule over ``train_steps``, gradients clipped to norm 1; a log record every
    ``log_every`` steps (the mean loss since the last one), an evaluation every ``eval_every``; with
    ``val_demos_per_task`` the weights of the lowest validation loss are the result (early stopping chosen on
    held-out demos, never on the evaluation states). The model is saved at the end, before the final evaluation (a
    long run keeps its weights if the evaluation dies, e.g. out of memory)."""
    rng = np.random.default_rng(c.seed)
    episodes, val_episodes = split_validation(episodes, c.val_demos_per_task)
    policy = new_policy(c, episodes)
    data = ChunkDataset(episodes, c.model.chunk, policy)
    val_loss = ValidationLoss(val_episodes, policy, c.model.chunk, c.seed) if val_episodes else None
    best = (math.inf, 0, None)  # (validation loss, step, weights)
    log(f"bc: {len(data)} samples, model {sum(p.numel() for p in policy.parameters()):,} params, head {c.model.head}")
    params = [p for n, p in policy.named_parameters() if not n.startswith("flow.noise_std")]  # ReinFlow's: RL only
    aux = ObjectHead(c, data) if c.aux_object_coef > 0 else None
    params += list(aux.linear.parameters()) if aux is not None else []
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, c.train_steps)))))
    gen = torch.Generator().manual_seed(c.seed)
    history, window, step, t0 = [], [], 0, time.perf_counter()
    with open(run_dir / "metrics.jsonl", "w") as metrics_f:
        for step in range(1, c.train_steps + 1):
            idx = rng.integers(0, len(data), size=c.batch_size)
            imgs, pro, tids, chunks = data.batch(idx, c.augment_shift, rng)
            img = policy.image_features(imgs)  # once: the auxiliary head reads the same features
            loss = policy.bc_loss(policy.fuse_features(img, pro, tids), chunks, gen)
            if aux is not None:
                loss = loss + c.aux_object_coef * aux.loss(img, idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            window.append(float(loss.detach()))
            elapsed = time.perf_counter() - t0
            out_of_time = c.time_budget_s > 0 and elapsed > c.time_budget_s
            rec = None
            if step % c.log_every == 0 or step == c.train_steps or out_of_time:
                mean_loss = sum(window) / len(window)  # mean over the steps since the last log line
                window = []
                rec = {"step": step, "loss/bc": mean_loss, "lr": sched.get_last_lr()[0], "time/train": elapsed}
                log(f"bc step {step}: loss {mean_loss:.4f} ({elapsed:.0f}s)")
            if val_loss is not None and (step % c.val_every == 0 or step == c.train_steps or out_of_time):
                rec = rec or {"step": step}
                rec["loss/val"] = v = val_loss(policy)
                if v < best[0]:
                    best = (v, step, {k: t.detach().clone() for k, t in policy.state_dict().items()})
            if c.eval_every and step % c.eval_every == 0 and not out_of_time and step != c.train_steps:
                rec = rec or {"step": step}
                rec.update(evaluate_policy(policy, c.env, c.eval_states_per_task, venv))
                log(f"bc eval @ {step}: success {rec['eval/success']:.2f}")
            if rec:
                history.append(rec)
                metrics_f.write(json.dumps(rec) + "\n")
                metrics_f.flush()
            if out_of_time:
                log(f"bc: time budget {c.time_budget_s:.0f}s reached at step {step}")
                break
    if best[2] is not None:
        policy.load_state_dict(best[2])
        log(f"bc: the lowest validation loss {best[0]:.4f} was at step {best[1]} of {step}; that model is kept")
        history.append({"step": step, "bc/best_step": best[1], "loss/val_best": best[0]})
    policy.save_pretrained(run_dir / "model")
    return Trained(policy, history, step, time.perf_counter() - t0)


def evaluate(c: BCConfig, trained: Trained, venv, run_dir: Path) -> dict[str, float]:
    """The final held-out evaluation (GIFs in ``run_dir/gifs``), appended to the history and ``metrics.jsonl``."""
    te = time.perf_counter()
    sink: list = []
    result = evaluate_policy(trained.policy, c.env, c.eval_states_per_task, venv,
                             gif_dir=run_dir / "gifs" if c.gifs else None, tag="bc-", standard_errors=True,
                             outcomes=sink)
    # the episodes, with the digest of the weights they are of: an RL run from this clone pairs with them
    # (robotics.eval_baseline=RUN/eval_episodes/final.json) instead of evaluating its start again
    if sink:  # (an evaluation that keeps no episodes: a stand-in in the tests)
        sink[0].policy = policy_digest(trained.policy)
        (run_dir / "eval_episodes").mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "eval_episodes" / "final.json", json.dumps(sink[0].to_json()) + "\n")
    result["time/eval"] = time.perf_counter() - te
    result["time/train"] = trained.seconds
    result["train_steps"] = trained.step
    result["bc/best_step"] = next((r["bc/best_step"] for r in trained.history if "bc/best_step" in r), trained.step)
    rec = {"step": trained.step, **result}
    trained.history.append(rec)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    return result


def export(c: BCConfig, run_dir: Path, result: dict[str, float], log=print) -> None:
    """Copy the model to ``export_dir`` (when set) with its evaluation in ``eval.json`` and its held-out episodes in
    ``eval_episodes.json`` (``robotics.eval_baseline`` of an RL run from it)."""
    if not c.export_dir:
        return
    dst = Path(c.export_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("model.safetensors", "config.json"):
        shutil.copy2(run_dir / "model" / f, dst / f)
    if (run_dir / "eval_episodes" / "final.json").is_file():  # robotics.eval_baseline of an RL run from the export
        shutil.copy2(run_dir / "eval_episodes" / "final.json", dst / "eval_episodes.json")
    (dst / "eval.json").write_text(json.dumps({k: round(v, 4) for k, v in result.items()}, indent=1))
    log(f"bc: exported the model to {dst}")


def plot(history: list[dict], path: Path) -> None:
    """The BC loss curve (log scale); nothing without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    pts = [(r["step"], r["loss/bc"]) for r in history if "loss/bc" in r]
    if not pts:
        return
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.plot(*zip(*pts))
    ax.set_xlabel("step")
    ax.set_ylabel("BC loss (window mean)")
    ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
