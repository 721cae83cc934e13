"""Behaviour cloning of the tiny VLA on noisy scripted-expert demos (``grove train`` with ``kind: supervised``).

``run(cfg, run_dir, log)`` collects demonstrations if the data file does not exist, trains the VLA (flow-matching
loss for the flow head, cross-entropy over 256 bins for the discrete head) on (frame, proprio, instruction) ->
next K actions with random-shift augmentation (DrQ, Kostrikov et al. 2021), evaluates the deterministic policy
(ODE / arg-max) on held-out evaluation reset states, writes ``metrics.jsonl``, ``bc_curve.png`` and the model
(``model.safetensors`` + ``config.json``) into ``run_dir/model`` and, if ``export_dir`` is set, there too
(``assets/metaworld-vla-tiny`` is made this way). The run stops at ``train_steps`` or ``time_budget_s``.
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

from .collect import collect_demos
from .data import Episode, load_episodes, save_episodes
from .envs.metaworld_env import OBJECT_XYZ, make_key
from .envs.vector import EnvConfig, make_vector_env
from .episodes import SamplingSettings, run_episodes, success_by_task, write_gif
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
        from shared_rl.config import ConfigError

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
    aux_object_coef: float = field(default=0.0, metadata={
        "help": "weight of an auxiliary loss: a linear head (training only) predicts the object's xyz (Meta-World "
                "state obs[4:7], z-scored) from the image features, so the encoder learns where the object is; "
                "needs demos with states; 0 = off"})

    def check(self, where: str = "bc") -> None:
        from shared_rl.config import ConfigError

        if self.batch_size < 1 or self.train_steps < 0:
            raise ConfigError(f"{where}: batch_size must be >= 1 and train_steps >= 0")
        if self.env.image_size != self.model.image_size:
            raise ConfigError(f"{where}.model.image_size ({self.model.image_size}) must equal env.image_size ({self.env.image_size})")
        stray = sorted(set(self.collect.task_demos) - set(self.env.tasks))
        if stray:
            raise ConfigError(f"{where}.collect.task_demos names {stray}, which are not in env.tasks {self.env.tasks}")


class ChunkDataset:
    """(frame, proprio, instruction ids, next-K-action chunk) samples from every step of every episode."""

    def __init__(self, episodes: list[Episode], chunk: int, policy: TinyVLA):
        self.images = np.concatenate([e.images for e in episodes])
        self.proprio = np.concatenate([e.proprio for e in episodes]).astype(np.float32)
        chunks, tids = [], []
        for e in episodes:
            a = e.actions
            # after the last action the episode is over (success): pad with "stay" (zero) actions
            padded = np.concatenate([a, np.zeros((chunk - 1, a.shape[1]), a.dtype)])
            chunks.append(np.stack([padded[t : t + chunk] for t in range(len(e))]))
            ids = policy.text.token_ids([e.instruction])[0]
            tids += [ids] * len(e)
        self.chunks = np.concatenate(chunks).astype(np.float32)
        self.text_ids = tids
        # the object's xyz per frame (Meta-World's 39-d state, obs[4:7]) for the auxiliary loss, when recorded
        self.objects = (np.concatenate([e.states[:, OBJECT_XYZ] for e in episodes]).astype(np.float32)
                        if all(e.states is not None for e in episodes) else None)

    def __len__(self) -> int:
        return len(self.chunks)

    def batch(self, idx: np.ndarray, shift: int, rng: np.random.Generator):
        imgs = torch.from_numpy(self.images[idx]).permute(0, 3, 1, 2).float() / 255.0 - 0.5
        if shift:
            imgs = random_shift(imgs, shift, rng)
        return imgs, torch.from_numpy(self.proprio[idx]), [self.text_ids[i] for i in idx], torch.from_numpy(self.chunks[idx])


def random_shift(imgs: torch.Tensor, pad: int, rng: np.random.Generator) -> torch.Tensor:
    """Pad by replication and crop back at a random offset per image (DrQ's augmentation)."""
    n, _, h, w = imgs.shape
    padded = torch.nn.functional.pad(imgs, (pad, pad, pad, pad), mode="replicate")
    out = torch.empty_like(imgs)
    offs = rng.integers(0, 2 * pad + 1, size=(n, 2))
    for i, (dy, dx) in enumerate(offs):
        out[i] = padded[i, :, dy : dy + h, dx : dx + w]
    return out


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


def eval_keys(env_cfg: EnvConfig, per_task: int, split: str = "eval", first_index: int = 0) -> tuple[list[int], list[str]]:
    """``per_task`` reset-state keys per task of ``split``, indices ``first_index ..`` (the held-out set by default)."""
    keys, tasks = [], []
    for t, task in enumerate(env_cfg.tasks):
        for i in range(first_index, first_index + per_task):
            keys.append(make_key(t, split, i))
            tasks.append(task)
    return keys, tasks


def evaluate_policy(policy: TinyVLA, env_cfg: EnvConfig, per_task: int, venv=None, gif_dir: Path | None = None,
                    tag: str = "", seed: int = 0, init_noise: float = 1.0, split: str = "eval",
                    first_index: int = 0) -> dict[str, float]:
    """Deterministic (ODE / arg-max) success on the held-out evaluation reset states (or on ``per_task`` states of
    another ``split`` from ``first_index`` on: the validation states of ``robotics.keep_best_adapters``).

    The flow head's ODE starts from Gaussian noise; each episode draws it from its own generator, seeded by
    (``seed``, its reset-state key), so an evaluation is a deterministic function of the weights, and one task's
    score does not move when only another task's policy changes (``run_episodes(episode_noise_seed=...)``).
    """
    keys, tasks = eval_keys(env_cfg, per_task, split, first_index)
    own = venv is None
    venv = venv or make_vector_env(env_cfg)
    mode = "ode" if policy.cfg.head == "flow" else "greedy"
    was_training = policy.training
    policy.eval()
    try:
        batch = run_episodes(policy, venv, keys, tasks, SamplingSettings(mode=mode, init_noise=init_noise), env_cfg.horizon,
                             torch.Generator().manual_seed(seed), record_frames=gif_dir is not None,
                             episode_noise_seed=seed)
    finally:
        policy.train(was_training)
        if own:
            venv.close()
    if gif_dir is not None:
        gif_dir.mkdir(parents=True, exist_ok=True)
        for task in env_cfg.tasks:
            i = tasks.index(task)
            ok = "ok" if batch.success_once[i] else "fail"
            write_gif(batch.frames[i], gif_dir / f"{tag}{task}-{ok}.gif")
    return success_by_task(batch, env_cfg.success_mode)


def run(cfg: dict, run_dir: Path, log=print) -> dict[str, float]:
    from shared_rl.config import from_dict

    c: BCConfig = from_dict(BCConfig, cfg, "robotics-bc")
    torch.set_num_threads(max(1, c.threads))
    torch.manual_seed(c.seed)
    rng = np.random.default_rng(c.seed)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
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
        from shared_rl.config import ConfigError

        raise ConfigError(f"{data_path} has no demos for env.tasks {c.env.tasks}")
    mcfg = c.model
    mcfg.image_channels = episodes[0].images.shape[-1]
    mcfg.proprio_dim = episodes[0].proprio.shape[-1]
    allp = np.concatenate([e.proprio for e in episodes])
    mcfg.proprio_mean = allp.mean(0).tolist()
    mcfg.proprio_std = (allp.std(0) + 1e-3).tolist()
    policy = TinyVLA(mcfg)
    data = ChunkDataset(episodes, mcfg.chunk, policy)
    n_params = sum(p.numel() for p in policy.parameters())
    log(f"bc: {len(data)} samples, model {n_params:,} params, head {mcfg.head}")
    # the ReinFlow noise head is trained by RL only
    params = [p for n, p in policy.named_parameters() if not n.startswith("flow.noise_std")]
    aux = None
    if c.aux_object_coef > 0:
        if data.objects is None:
            from shared_rl.config import ConfigError

            raise ConfigError(f"aux_object_coef={c.aux_object_coef} needs demos with Meta-World states; {data_path} "
                              f"has none (collect them with `grove robotics collect`)")
        obj_mean, obj_std = data.objects.mean(0), data.objects.std(0) + 1e-3
        aux = torch.nn.Linear(mcfg.feature_dim, 3)  # not part of the saved model
        params += list(aux.parameters())
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, c.train_steps)))))
    gen = torch.Generator().manual_seed(c.seed)
    metrics_f = open(run_dir / "metrics.jsonl", "w")
    history, t0, window = [], time.perf_counter(), []
    step = 0
    venv = make_vector_env(c.env)
    result: dict[str, float] = {}
    try:
        for step in range(1, c.train_steps + 1):
            idx = rng.integers(0, len(data), size=c.batch_size)
            imgs, pro, tids, chunks = data.batch(idx, c.augment_shift, rng)
            img = policy.image_features(imgs)  # once: the auxiliary head reads the same features
            loss = policy.bc_loss(policy.fuse_features(img, pro, tids), chunks, gen)
            if aux is not None:
                target = torch.from_numpy((data.objects[idx] - obj_mean) / obj_std)
                loss = loss + c.aux_object_coef * torch.nn.functional.mse_loss(aux(img), target)
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
        # saved before the final evaluation: a long run keeps its weights if the evaluation dies (e.g. out of memory)
        policy.save_pretrained(run_dir / "model")
        te = time.perf_counter()
        result = evaluate_policy(policy, c.env, c.eval_states_per_task, venv,
                                 gif_dir=run_dir / "gifs" if c.gifs else None, tag="bc-")
        result["time/eval"] = time.perf_counter() - te
        result["time/train"] = te - t0
        result["train_steps"] = step
        rec = {"step": step, **result}
        history.append(rec)
        metrics_f.write(json.dumps(rec) + "\n")
    finally:
        metrics_f.close()
        venv.close()
    if c.export_dir:
        dst = Path(c.export_dir)
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("model.safetensors", "config.json"):
            shutil.copy2(run_dir / "model" / f, dst / f)
        (dst / "eval.json").write_text(json.dumps({k: round(v, 4) for k, v in result.items()}, indent=1))
        log(f"bc: exported the model to {dst}")
    _plot(history, run_dir / "bc_curve.png")
    log("bc: " + " ".join(f"{k}={v:.3g}" for k, v in result.items() if k.startswith("eval/")))
    return result


def _plot(history: list[dict], path: Path) -> None:
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
