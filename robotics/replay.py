"""Replay of supervised data during RL (``robotics.replay``): the BC loss on demonstrations or on the run's successes.

``source: demos`` (``DemoReplay``): ``batch`` chunks of the demonstrations ``.npz`` at every optimizer step, an
anchor to the pretraining data (DAPG, Rajeswaran et al. 2018; the SFT term of VLA RL recipes).
``source: successes`` (``SuccessReplay``): every executed chunk of the run's own successful episodes of the last
``success_window`` iterations, drawn equally per task (self-imitation: SIL, Oh et al. 2018; filtered BC on the
policy's successes as iRe-VLA / ReST), which turns every success of a rarely solved task into supervised data for
its adapter.

Either way the loss is ``TinyVLA.bc_loss`` (flow matching, or cross-entropy over bins) on a batch drawn from
(seed, iteration, optimizer step) only, so a resumed run replays the same batches; the domain hands it to the
trainer as the auxiliary loss ``replay`` with weight ``coef`` (logged as ``loss/replay``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch

from shared_rl.errors import ConfigError

from .parts import Part
from .part_settings import ReplayConfig  # noqa: F401  (torch-free, re-exported here)
from .policies.vla import TinyVLA


def _generator(seed: list[int]) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence(seed).generate_state(1)[0]))


class DemoReplay(Part):
    """``source: demos``. ``encode(images, proprio, text_ids)``: the policy's fused features (the domain's)."""

    def __init__(self, cfg: ReplayConfig, path: Path, trained_tasks: list[str], policy: TinyVLA, seed: int,
                 device: torch.device, encode: Callable[..., torch.Tensor]):
        from .data import load_episodes
        from .datasets import ChunkDataset

        replayed = cfg.tasks or trained_tasks
        if set(replayed) - set(trained_tasks):
            raise ConfigError(f"robotics.replay.tasks {sorted(set(replayed) - set(trained_tasks))} are not trained "
                              f"tasks {trained_tasks}")
        demos = [e for e in load_episodes(path) if e.task in replayed]
        if not demos:
            raise ConfigError(f"robotics.replay.data {cfg.data!r} has no demos of the replayed tasks {replayed}")
        self.cfg, self.policy, self.seed, self.device, self._encode = cfg, policy, seed, device, encode
        self.data = ChunkDataset(demos, policy.cfg.chunk, policy)

    def loss(self, iteration: int, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """This rank's rows ``rank::world`` of the global batch, weighted by their share."""
        seed = [self.seed, iteration, step]
        idx = np.random.default_rng(seed).integers(0, len(self.data), size=self.cfg.batch)[rank::world]
        if idx.size == 0:
            return torch.zeros((), device=self.device)
        imgs, pro, tids, chunks = self.data.batch(idx, 0, None)
        gen = _generator(seed + [rank])
        self.policy.train()
        h = self._encode(imgs, pro, tids)
        return self.policy.bc_loss(h, chunks.to(self.device), gen) * (idx.size / self.cfg.batch)


class SuccessReplay(Part):
    """``source: successes``: per iteration (the last ``success_window``), per task index, the successful chunks.
    ``encode(images, proprio, text_ids)``: the policy's fused features; ``text_ids[t]``: task t's instruction ids."""

    state_prefix = "successes."

    def __init__(self, cfg: ReplayConfig, policy: TinyVLA, seed: int, encode: Callable[..., torch.Tensor],
                 text_ids: list[list[int]], success_mode: str, num_processes: int):
        if num_processes > 1:
            raise ConfigError("robotics.replay.source: successes imitates each process's own rollouts, which would "
                              "make N processes differ from one; launch one process or use source: demos")
        self.cfg, self.policy, self.seed, self._encode = cfg, policy, seed, encode
        self.text_ids, self.success_mode = text_ids, success_mode
        self.kept: dict[int, dict[int, dict[str, torch.Tensor]]] = {}

    def on_rollout(self, batch, payload: dict[str, Any], iteration: int) -> None:
        """Keep every executed chunk of this iteration's successful episodes (observation, instruction, and the chunk
        of actions the env executed: the chain's clamped end, or the sampled bins' centres), per task. Rollout calls
        within one iteration add to its set; sets older than success_window iterations are dropped."""
        succ = batch.success_once if self.success_mode == "once" else batch.success_end
        first_kept = iteration - self.cfg.success_window + 1
        self.kept = {it: v for it, v in self.kept.items() if first_kept <= it <= iteration}
        current = self.kept.setdefault(iteration, {})
        ep, ch = np.nonzero(batch.chunk_valid & succ[:, None])
        if ep.size == 0:
            return
        m = self.policy.cfg
        if m.head == "flow":
            acts = payload["chain"][ep, ch, -1].clamp(-1, 1)
        else:
            acts = self.policy.bin_centers(torch.device("cpu"))[payload["chain"][ep, ch, 0]]
        acts = acts.reshape(len(ep), m.chunk, m.action_dim)
        task_index = payload["task_index"][ep]
        for t in task_index.unique().tolist():
            rows = torch.nonzero(task_index == t).flatten()
            e, c = torch.from_numpy(ep)[rows], torch.from_numpy(ch)[rows]
            new = {"images": payload["images"][e, c], "proprio": payload["proprio"][e, c], "actions": acts[rows]}
            old = current.get(t)
            current[t] = new if old is None else {k: torch.cat([old[k], v]) for k, v in new.items()}

    def kept_tasks(self) -> list[int]:
        return sorted({t for per_task in self.kept.values() for t in per_task})

    def kept_chunks(self, task: int) -> dict[str, torch.Tensor]:
        """Task ``task``'s kept successful chunks, oldest iteration first."""
        sets = [self.kept[it][task] for it in sorted(self.kept) if task in self.kept[it]]
        return {k: torch.cat([s[k] for s in sets]) for k in ("images", "proprio", "actions")}

    def sample(self, rng: np.random.Generator):
        """``batch`` chunks of the kept successes: each row's task uniform over the tasks with kept successes (a solved
        task cannot crowd out a rare one), then a chunk uniform over that task's kept chunks."""
        tasks = self.kept_tasks()
        pick = rng.integers(0, len(tasks), size=self.cfg.batch)
        imgs, pro, tids, acts = [], [], [], []
        for j, t in enumerate(tasks):
            n_rows = int((pick == j).sum())
            if n_rows == 0:
                continue
            kept = self.kept_chunks(t)
            idx = torch.from_numpy(rng.integers(0, len(kept["actions"]), size=n_rows))
            imgs.append(kept["images"][idx])
            pro.append(kept["proprio"][idx])
            acts.append(kept["actions"][idx])
            tids += [self.text_ids[t]] * n_rows
        return torch.cat(imgs), torch.cat(pro), tids, torch.cat(acts)  # images uint8 [B, H, W, C], as rollouts

    def loss(self, iteration: int, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
        """0 (no gradient) when nothing succeeded. One process (checked), so ``rank`` and ``world`` are 0 and 1."""
        if not self.kept_tasks():
            return torch.zeros((), requires_grad=True)
        seed = [self.seed, iteration, step]
        imgs, pro, tids, chunks = self.sample(np.random.default_rng(seed))
        gen = _generator(seed)
        self.policy.train()
        h = self._encode(imgs, pro, tids)
        return self.policy.bc_loss(h, chunks.to(h.device), gen)

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.cfg.success_window == 1:  # this iteration's set is rebuilt by its own rollouts after a resume
            return {}
        return {f"{self.state_prefix}{it}.{t}.{k}": v.clone()
                for it, per_task in self.kept.items() for t, kept in per_task.items() for k, v in kept.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.kept = {}
        for k, v in state.items():
            if k.startswith(self.state_prefix):
                _, it, t, name = k.split(".")
                self.kept.setdefault(int(it), {}).setdefault(int(t), {})[name] = v
