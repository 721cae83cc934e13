"""``grove train configs/robotics/world_model.yaml`` (kind: supervised, domain: robotics-wm): real data -> world model.

1. Real data (``data``; collected when the file does not exist): demonstrations — Meta-World's scripted experts
   (``collect.collect_demos``, noisy, failures kept) or per-step episode files (``collect.demo_files``: the LIBERO
   demos of ``grove robotics collect`` / the LIBERO bench) — and rollouts of the VLA checkpoint on *training* reset
   states (the unchanged ``episodes.run_episodes`` on a ``RecordingEnv``, which also records simulator states at
   every chunk boundary where the state codec knows the env's state: the keyframes of imagined GRPO and the audit's
   replay starts). Every env step is counted.
2. World model (``model.WorldModel``): windows of ``window`` chunks, Adam, ``train_steps`` steps (or
   ``time_budget_s``); the ensemble's disagreement is calibrated on held-out episodes (95th percentile).
3. Success model (``reward.SuccessModel``) on the same real episodes; precision/recall on the held-out ones.
4. Held-out report: per-step image error of open-loop imagination from real starts with the real actions, and
   (``heldout_rollout``) k-step open-loop rollouts from real keyframes of the held-out episodes: image MSE per
   camera, proprio error and the imagined success flags against the real ones, beside the copy-the-last-frame
   baseline.

The model's observation sizes (``model.image_channels``, ``proprio_dim``, ``action_dim``, ``chunk``) come from
the data; the env settings say what the VLA will see (LIBERO: two cameras stacked as 6 channels, the 8-d state,
7-d actions), and a data file that disagrees with them — or with a size set explicitly under ``model`` — is a
one-line ``ConfigError`` rather than a model the policy cannot use.

Writes ``export_dir`` (the few-MB asset: ``world_model.*``, ``success_model.*``, ``meta.json``) and
``run_dir/metrics.jsonl``.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from shared_rl.errors import ConfigError
from shared_rl.flow_kernels import DEFAULT_NOISE_LEVEL

from ..envs.vector import EnvConfig
from .data import ChunkEpisode, WindowSampler, episodes_from_demos, load_chunk_episodes, save_chunk_episodes
from .heldout import keyframe_rollouts, success_report
from .model import WorldModel, WorldModelConfig
from .reward import calibrate_threshold, evaluate_success_model, fit_success_model

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CollectSettings:
    """What real interaction the world model gets (every env step is counted in ``meta.json``)."""

    demos_per_task: int = field(default=10, metadata={"help": "scripted-expert episodes per task (failures kept)"})
    demo_noise: float = field(default=0.3, metadata={"help": "Gaussian action noise of the expert demos"})
    policy: str = field(default="assets/metaworld-vla-tiny", metadata={"help": "VLA checkpoint whose rollouts are recorded; '' = none"})
    rollout_states_per_task: int = field(default=24, metadata={"help": "training reset states (indices 0..n-1) per task"})
    rollouts_per_state: int = field(default=2, metadata={"help": "policy episodes per reset state"})
    head_mode: str = field(default="sde_one_step", metadata={"help": "the policy's sampling mode (as in GRPO rollouts)"})
    noise_level: float = field(default=DEFAULT_NOISE_LEVEL, metadata={"help": "Flow-GRPO noise level of the rollouts"})
    seed: int = field(default=0, metadata={"help": "seed of the demo noise and the policy sampling"})
    demo_files: list[str] = field(default_factory=list, metadata={
        "help": "per-step episode .npz files (grove robotics collect, the LIBERO bench's demos) cut into chunks of "
                "model.chunk; used instead of scripted demos (LIBERO has no scripted expert here)"})
    rollout_start_index: int = field(default=0, metadata={
        "help": "first training reset index of the policy rollouts (keep them off the demos' scenes)"})
    rollout_batch: int = field(default=16, metadata={
        "help": "policy episodes run at once; LIBERO: one env each (~0.35 GB, the first ~1.1 GB) and one env pool "
                "per task, so 2 keeps the recording near 2 GB"})
    state_max_chunk: int = field(default=0, metadata={
        "help": "record the simulator state (what a keyframe restores) at chunk boundaries 0..n of the policy "
                "rollouts only; 0 = every boundary. A LIBERO state is ~37 KB, so its recipes keep the boundaries "
                "keyframes are drawn from"})


@dataclass
class WorldModelTrainConfig:
    """The ``kind: supervised`` world-model job (``domain: robotics-wm``)."""

    kind: str = field(default="supervised", metadata={"help": "supervised (this job)"})
    domain: str = field(default="robotics-wm", metadata={"help": "robotics-wm"})
    data: str = field(default="runs/robotics-wm/data.npz", metadata={"help": "real chunk episodes; collected when missing"})
    collect: CollectSettings = field(default_factory=CollectSettings, metadata={"help": "how the data is collected"})
    env: EnvConfig = field(default_factory=lambda: EnvConfig(tasks=["door-open-v3"]), metadata={"help": "simulator settings"})
    model: WorldModelConfig = field(default_factory=WorldModelConfig, metadata={"help": "world-model sizes"})
    train_steps: int = field(default=1500, metadata={"help": "world-model optimizer steps"})
    time_budget_s: float = field(default=0.0, metadata={"help": "stop world-model training after this many seconds (0 = off)"})
    batch_size: int = field(default=16, metadata={"help": "windows per step"})
    window: int = field(default=3, metadata={"help": "chunks per training window (window - 1 open-loop model steps)"})
    lr: float = field(default=1e-3, metadata={"help": "Adam learning rate (cosine decay)"})
    success_steps: int = field(default=600, metadata={"help": "success-model optimizer steps"})
    holdout_fraction: float = field(default=0.15, metadata={"help": "episodes held out for calibration and metrics"})
    holdout_stratify: bool = field(default=False, metadata={
        "help": "hold out the same fraction of each (source, succeeded) group, so sparse successes and failures "
                "both reach the held-out metrics (false = one random draw over all episodes)"})
    report_depth: int = field(default=8, metadata={"help": "held-out keyframe rollouts: open-loop model steps (chunks)"})
    report_stride: int = field(default=4, metadata={"help": "held-out keyframe rollouts: every n-th chunk boundary starts one"})
    seed: int = field(default=0, metadata={"help": "seed"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    export_dir: str = field(default="assets/metaworld-wm-tiny", metadata={"help": "where the asset is written"})

    def check(self, where: str = "robotics-wm") -> None:
        if self.env.kind == "metaworld" and self.model.image_size != self.env.image_size:
            raise ConfigError(f"{where}: model.image_size {self.model.image_size} != env.image_size {self.env.image_size}")
        if self.window < 2:
            raise ConfigError(f"{where}.window must be >= 2 (one history chunk plus at least one model step)")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ConfigError(f"{where}.holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.train_steps < 0 or self.batch_size < 1:
            raise ConfigError(f"{where}: train_steps must be >= 0 and batch_size >= 1")
        if self.report_depth < 1 or self.report_stride < 1 or self.collect.rollout_batch < 1:
            raise ConfigError(f"{where}: report_depth, report_stride and collect.rollout_batch must be >= 1")
        if self.collect.demo_files and self.collect.demos_per_task and self.env.kind == "metaworld":
            raise ConfigError(f"{where}.collect: demo_files and demos_per_task both give demonstrations; set "
                              f"demos_per_task: 0 to use the files")


def resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


# ---------------------------------------------------------------------------------------------------------------
def collect_policy_episodes(policy, venv, keys: list[int], tasks: list[str], head_mode: str, noise_level: float,
                            horizon: int, generator: torch.Generator, record_states: bool = True,
                            state_max_chunk: int | None = None) -> list[ChunkEpisode]:
    """Rollouts of ``policy`` recorded at chunk resolution (the unchanged episode runner on a ``RecordingEnv``)."""
    from ..episodes import SamplingSettings, run_episodes
    from .data import RecordingEnv

    rec = RecordingEnv(venv, record_states=record_states, state_max_chunk=state_max_chunk)
    was = policy.training
    policy.eval()
    try:
        run_episodes(policy, rec, keys, tasks, SamplingSettings(mode=head_mode, noise_level=noise_level), horizon, generator,
                     device=next(policy.parameters()).device)
    finally:
        policy.train(was)
    return rec.episodes("policy")


def collect_real_data(c: WorldModelTrainConfig, log=print) -> tuple[list[ChunkEpisode], dict[str, int]]:
    from ..collect import collect_demos
    from ..data import load_episodes
    from ..envs.metaworld_env import make_key
    from ..envs.vector import make_vector_env
    from ..policies.vla import TinyVLA

    episodes: list[ChunkEpisode] = []
    steps = {"demo_env_steps": 0, "policy_env_steps": 0}
    if c.collect.demo_files:
        for f in c.collect.demo_files:
            demos = [d for d in load_episodes(resolve(f)) if d.task in c.env.tasks]
            steps["demo_env_steps"] += int(sum(len(d) for d in demos))
            episodes += episodes_from_demos(demos, c.model.chunk)
            log(f"world model data: {len(demos)} demonstrations from {f}")
            del demos  # the episodes are views of the file's whole image array; the chunk frames are copies
    elif c.collect.demos_per_task > 0 and c.env.kind == "metaworld":
        demos = collect_demos(c.env, c.collect.demos_per_task, c.collect.demo_noise, c.collect.seed,
                              only_successful=False, max_attempts_factor=1, log=log)
        steps["demo_env_steps"] = int(sum(len(d) for d in demos))
        episodes += episodes_from_demos(demos, c.model.chunk)
    if c.collect.policy:
        policy = TinyVLA.load_pretrained(resolve(c.collect.policy))
        if episodes and policy.cfg.chunk != c.model.chunk:  # one data file holds one chunk length
            raise ConfigError(f"robotics-wm: the policy {c.collect.policy} acts in chunks of {policy.cfg.chunk}, the "
                              f"demonstrations are cut into model.chunk {c.model.chunk}; set model.chunk: {policy.cfg.chunk}")
        keys, tasks = [], []
        for t, task in enumerate(c.env.tasks):
            for i in range(c.collect.rollout_states_per_task):
                for _ in range(c.collect.rollouts_per_state):
                    keys.append(make_key(t, "train", c.collect.rollout_start_index + i)), tasks.append(task)
        gen = torch.Generator().manual_seed(c.collect.seed)
        bs = c.collect.rollout_batch
        # Meta-World: one env for all batches (its pool is cheap); LIBERO: one env per task, closed after it, since
        # the pool keeps every task's envs alive (~0.35 GB each)
        groups = [list(range(len(keys)))] if c.env.kind != "libero" else \
            [[i for i, tk in enumerate(tasks) if tk == task] for task in c.env.tasks]
        for group in groups:
            venv = make_vector_env(c.env)
            try:
                for a in range(0, len(group), bs):
                    idx = group[a:a + bs]
                    eps = collect_policy_episodes(policy, venv, [keys[i] for i in idx], [tasks[i] for i in idx],
                                                  c.collect.head_mode, c.collect.noise_level, c.env.horizon, gen,
                                                  state_max_chunk=c.collect.state_max_chunk or None)
                    episodes += eps
                    steps["policy_env_steps"] += sum(e.env_steps for e in eps)
                    log(f"world model data: {len(episodes)} episodes, {sum(steps.values())} env steps "
                        f"({sum(e.succeeded for e in episodes if e.source == 'policy')} policy successes)")
            finally:
                venv.close()
                del venv
    return episodes, steps


# ---------------------------------------------------------------------------------------------------------------
def fit_world_model(wm: WorldModel, episodes: list[ChunkEpisode], steps: int, batch: int, window: int, lr: float,
                    seed: int, time_budget_s: float = 0.0, log=None, opt: torch.optim.Optimizer | None = None,
                    metrics_file=None) -> list[dict]:
    """Train the world model on windows of real episodes (also used by co-evolution refits)."""
    sampler = WindowSampler(episodes, window)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = opt or torch.optim.Adam(wm.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, steps)))))
    wm.train()
    history, t0 = [], time.perf_counter()
    with torch.enable_grad():  # refits run inside the trainer's no-grad rollout
        _fit_loop(wm, sampler, steps, batch, rng, gen, opt, sched, history, t0, time_budget_s, log, metrics_file)
    wm.eval()
    return history


def _fit_loop(wm, sampler, steps, batch, rng, gen, opt, sched, history, t0, time_budget_s, log, metrics_file) -> None:
    for s in range(steps):
        wb = sampler.sample(batch, rng)
        loss, parts = wm.loss(wb.frames, wb.proprio, wb.actions, wb.valid, gen)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(wm.parameters(), 1.0)
        opt.step()
        sched.step()
        if (s + 1) % 50 == 0 or s == steps - 1:
            parts.update(step=s + 1, time_s=time.perf_counter() - t0)
            history.append(parts)
            if metrics_file is not None:
                metrics_file.write(json.dumps(parts) + "\n")
                metrics_file.flush()
            if log is not None and (s + 1) % 250 == 0:
                log(f"world model: step {s + 1}/{steps} loss {parts['loss']:.5f} pixel {parts['pixel']:.5f} "
                    f"({parts['time_s']:.0f}s)")
        if time_budget_s and time.perf_counter() - t0 > time_budget_s:
            break


@torch.no_grad()
def open_loop_report(wm: WorldModel, episodes: list[ChunkEpisode], depth: int = 12) -> dict:
    """Imagine each held-out episode from its start with its real actions: per-step image MSE and disagreement."""
    err = [[] for _ in range(depth)]
    unc = []
    for ep in episodes:
        if ep.num_chunks < 1:
            continue
        z = wm.encode(torch.from_numpy(ep.frames[:1]))
        z_prev, p = z, torch.from_numpy(ep.proprio[:1])
        for c in range(min(depth, ep.num_chunks)):
            pred = wm.step(z, z_prev, p, torch.from_numpy(ep.actions[c:c + 1]))
            img = wm.decode_float(pred.z)
            real = wm.to_float(torch.from_numpy(ep.frames[c + 1:c + 2]))
            err[c].append(float((img - real).pow(2).mean()))
            if c == 0:
                unc.append(float(pred.uncertainty[0]))
            z_prev, z, p = z, pred.z, pred.proprio
    return {"image_mse_by_step": [float(np.mean(e)) if e else float("nan") for e in err], "one_step_uncertainty": unc}


@torch.no_grad()
def calibrate_uncertainty(wm: WorldModel, episodes: list[ChunkEpisode], quantile: float = 0.95) -> float:
    """The ``quantile`` of the one-step ensemble disagreement on real transitions (teacher-forced)."""
    vals = []
    for ep in episodes:
        if ep.num_chunks < 1:
            continue
        z = wm.encode(torch.from_numpy(ep.frames))
        z_prev = torch.cat([z[:1], z[:-1]])
        pred = wm.step(z[:-1], z_prev[:-1], torch.from_numpy(ep.proprio[:-1]), torch.from_numpy(ep.actions))
        vals.append(pred.uncertainty.numpy())
    return float(np.quantile(np.concatenate(vals), quantile)) if vals else 1.0


def split_episodes(episodes: list[ChunkEpisode], fraction: float, seed: int, stratify: bool = False):
    """(train, held-out) whole episodes. ``stratify``: the fraction of each (source, succeeded) group, at least one
    of a group of two or more, so a handful of real failures or successes is not all on one side by chance."""
    rng = np.random.default_rng(seed)
    if not stratify:
        order = rng.permutation(len(episodes))
        n_hold = int(round(fraction * len(episodes)))
        hold = set(order[:n_hold].tolist())
    else:
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, e in enumerate(episodes):
            groups.setdefault((e.source, e.succeeded), []).append(i)
        hold = set()
        for _, members in sorted(groups.items()):
            n = int(round(fraction * len(members)))
            n = max(n, 1) if fraction > 0 and len(members) >= 2 else n
            hold |= set(rng.permutation(members)[:n].tolist())
    return [e for i, e in enumerate(episodes) if i not in hold], [e for i, e in enumerate(episodes) if i in hold]


def data_dims(episodes: list[ChunkEpisode]) -> dict[str, int]:
    """The observation / action sizes of chunk episodes (all episodes must agree)."""
    def dims(e: ChunkEpisode) -> dict[str, int]:
        return {"image_size": int(e.frames.shape[1]), "image_channels": int(e.frames.shape[-1]),
                "proprio_dim": int(e.proprio.shape[-1]), "action_dim": int(e.actions.shape[2]),
                "chunk": int(e.actions.shape[1])}

    out = dims(episodes[0])
    for e in episodes[1:]:
        if e.num_chunks and dims(e) != out:
            bad = next(k for k, v in dims(e).items() if out[k] != v)
            raise ConfigError(f"world-model data mixes episodes of {bad} {out[bad]} and {dims(e)[bad]} (task {e.task}); "
                              f"one data file holds one observation layout")
    return out


def set_model_dims(mc: WorldModelConfig, env: EnvConfig, episodes: list[ChunkEpisode], data_path: Path,
                   explicit: dict) -> None:
    """Set the model's observation sizes from the data, after checking the data against what the env settings say
    the policy will observe (camera count x 3 channels, the proprio / state size, the action size) and against any
    size written explicitly under ``model``: a mismatch is one line naming the size and both values."""
    have = data_dims(episodes)
    want: dict[str, tuple[int, str]] = {}
    if env.kind != "point":  # the point env's proprio and frame are its own, whatever the env settings say
        want = {"image_channels": (env.image_channels, f"env.cameras {list(env.cameras)} (3 channels each)"),
                "proprio_dim": (env.proprio_dim, f"env.kind {env.kind}'s proprio"),
                "action_dim": (env.action_dim, f"env.kind {env.kind}'s actions"),
                "image_size": (env.image_size, "env.image_size")}
    for k in ("image_channels", "proprio_dim", "action_dim", "chunk", "image_size"):
        if k in explicit and int(explicit[k]) != have[k]:
            want[k] = (int(explicit[k]), f"model.{k}")
    for k, (v, what) in want.items():
        if have[k] != v:
            raise ConfigError(f"world-model data {data_path} has {k} {have[k]} but {what} gives {v}; make the settings "
                              f"match the data or point `data` at a new file to collect")
    mc.image_channels, mc.proprio_dim, mc.action_dim, mc.chunk = (have[k] for k in ("image_channels", "proprio_dim",
                                                                                     "action_dim", "chunk"))


def run(cfg: dict, run_dir: Path, log=print) -> dict[str, float]:
    from shared_rl.config import from_dict

    c: WorldModelTrainConfig = from_dict(WorldModelTrainConfig, cfg, "robotics-wm")
    torch.set_num_threads(max(1, c.threads))
    torch.manual_seed(c.seed)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    data_path = resolve(c.data)
    if data_path.is_file():
        episodes = load_chunk_episodes(data_path)
        meta_path = data_path.with_suffix(".steps.json")
        steps = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        log(f"world model: {len(episodes)} real episodes from {data_path}")
    else:
        t0 = time.perf_counter()
        episodes, steps = collect_real_data(c, log)
        save_chunk_episodes(episodes, data_path)
        data_path.with_suffix(".steps.json").write_text(json.dumps(steps))
        log(f"world model: collected {len(episodes)} episodes ({sum(steps.values())} env steps) in "
            f"{time.perf_counter() - t0:.0f}s -> {data_path}")
    episodes = [e for e in episodes if e.task in c.env.tasks or c.env.kind == "point"]
    if not episodes:
        raise ConfigError(f"{data_path} has no episodes for env.tasks {c.env.tasks}")
    mc = c.model
    set_model_dims(mc, c.env, episodes, data_path, explicit=cfg.get("model") or {})
    train, hold = split_episodes(episodes, c.holdout_fraction, c.seed, stratify=c.holdout_stratify)
    wm = WorldModel(mc)
    log(f"world model: {sum(p.numel() for p in wm.parameters()):,} parameters, {len(train)} train / {len(hold)} "
        f"held-out episodes")
    t0 = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "w") as mf:
        hist = fit_world_model(wm, train, c.train_steps, c.batch_size, c.window, c.lr, c.seed, c.time_budget_s, log,
                               metrics_file=mf)
    wm_time = time.perf_counter() - t0
    wm.cfg.uncertainty_ref = calibrate_uncertainty(wm, hold or train)
    success = fit_success_model(wm, train, c.success_steps, seed=c.seed, log=log)
    calibrate_threshold(wm, success, hold or train)
    sm_hold = evaluate_success_model(wm, success, hold) if hold else {}
    report = open_loop_report(wm, hold or train)
    keyed = keyframe_rollouts(wm, hold or train, success, c.report_depth, c.report_stride)
    sm_report = success_report(wm, success, hold) if hold else {}
    # the threshold above was chosen on these held-out episodes; at a fixed 0.5 nothing was tuned on them
    sm_report_fixed = success_report(wm, success, hold, threshold=0.5) if hold else {}
    out = resolve(c.export_dir)
    wm.save(out)
    success.save(out)
    real_steps = int(sum(steps.values())) if steps else int(sum(e.env_steps for e in episodes))
    meta = {"data": str(c.data), "episodes": len(episodes), "real_env_steps": real_steps, **steps,
            "successful_policy_episodes": int(sum(e.succeeded for e in episodes if e.source == "policy")),
            "policy_episodes": int(sum(e.source == "policy" for e in episodes)),
            "train_steps_done": hist[-1]["step"] if hist else 0, "train_time_s": wm_time,
            "final_loss": hist[-1] if hist else {}, "uncertainty_ref": wm.cfg.uncertainty_ref,
            "success_model_heldout": sm_hold, "success_threshold": success.cfg.threshold,
            "open_loop_image_mse_by_step": report["image_mse_by_step"],
            "heldout_episodes": len(hold), "heldout_keyframe_rollouts": keyed, "success_heldout_report": sm_report,
            "success_heldout_report_at_0.5": sm_report_fixed,
            "data_dims": data_dims(episodes),
            "tasks": c.env.tasks, "config": asdict(c)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=float))
    (run_dir / "result.json").write_text(json.dumps(meta, indent=1, default=float))
    log(f"world model: {meta['train_steps_done']} steps in {wm_time:.0f}s; held-out image MSE by step "
        f"{[round(x, 4) for x in report['image_mse_by_step'][:6]]}; success model held-out {sm_hold}; -> {out}")
    ep_report = sm_report.get("episode", {})
    return {"wm/real_env_steps": float(real_steps), "wm/heldout_mse_step1": report["image_mse_by_step"][0],
            "wm/success_precision": float(sm_hold.get("precision", float("nan"))),
            "wm/success_recall": float(sm_hold.get("recall", float("nan"))),
            "wm/keyframe_mse_step1": keyed["image_mse"][0], "wm/keyframe_copy_mse_step1": keyed["copy_mse"][0],
            "wm/keyframe_mse_last": keyed["image_mse"][-1], "wm/keyframe_copy_mse_last": keyed["copy_mse"][-1],
            "wm/episode_success_precision": float(ep_report.get("precision", float("nan"))),
            "wm/episode_success_recall": float(ep_report.get("recall", float("nan")))}
