"""The optimiser side of the trainer: AdamW parameter groups, the learning-rate schedule, the weight average (EMA)
and the guarded optimizer step (sum over processes, clip, skip a non-finite step, domain hooks around the step).

``Trainer`` (``shared_rl/trainer.py``) builds one ``Optimizer`` and calls ``Optimizer.step(stats)`` once per
minibatch, after the micro-batches' backward passes.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from .errors import ConfigError, NonFiniteError
from .gather import StepStats
from .losses import EntropyCoefficient


class WeightEMA:
    """Weight averaging of the trained parameters (Polyak & Juditsky 1992; the EMA that diffusion training evaluates).
    After optimizer step t: ema ← d_t·ema + (1 − d_t)·w, d_t = min(decay, (1 + t) / (10 + t)), so the first steps are
    not tied to the starting weights for long. Rollouts and updates keep the live weights; ``swapped()`` puts the
    average into the parameters for evaluation and export and restores the live ones bitwise after."""

    PREFIX = "_ema/"  # its tensors travel in the checkpoint's model.safetensors under these keys

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        self.params, self.decay, self.steps = list(params), float(decay), 0
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.steps) / (10 + self.steps))
        for avg, p in zip(self.shadow, self.params):
            avg.lerp_(p.detach(), 1.0 - d)
        self.steps += 1

    @contextlib.contextmanager
    def swapped(self):
        live = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, avg in zip(self.params, self.shadow):
                p.copy_(avg)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, live):
                    p.copy_(w)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{self.PREFIX}{i}": avg for i, avg in enumerate(self.shadow)}

    def load(self, tensors: dict[str, torch.Tensor], steps: int) -> None:
        if len(tensors) != len(self.shadow):
            raise ConfigError(f"the checkpoint's weight average holds {len(tensors)} tensors, this policy trains "
                              f"{len(self.shadow)}: resume with the config the run was started with")
        with torch.no_grad():
            for i, avg in enumerate(self.shadow):
                avg.copy_(tensors[f"{self.PREFIX}{i}"])
        self.steps = int(steps)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``cfg.warmup_steps``, then constant, cosine or linear decay to 0 at ``total_steps``."""
    warm, kind = cfg.warmup_steps, cfg.schedule

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if kind == "constant" or total_steps <= warm:
            return 1.0
        frac = min(1.0, (step - warm) / max(1, total_steps - warm))
        return 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1.0 - frac

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def param_groups(params: list[torch.nn.Parameter], critic: list[torch.nn.Parameter],
                 critic_lr: float | None) -> list[dict[str, Any]]:
    """One AdamW group, or two when a critic has its own learning rate: the critic then steps at ``critic_lr``."""
    if critic_lr is None or not critic:
        return [{"params": params}]
    critic_ids = {id(p) for p in critic}
    policy = [p for p in params if id(p) not in critic_ids]
    value = [p for p in params if id(p) in critic_ids]
    return [g for g in ({"params": policy}, {"params": value, "lr": critic_lr}) if g["params"]]


class Optimizer:
    """AdamW + schedule + optional weight average, and the guarded step: gradients summed over processes, clipped
    to ``optim.grad_clip``, a non-finite step skipped (stopping after ``max_nonfinite_steps`` in a row), the
    domain's ``before_optimizer_step`` / ``after_optimizer_step`` hooks around the update."""

    def __init__(self, cfg, domain, params: list[torch.nn.Parameter], critic_lr: float | None, dist, fsdp,
                 log=print) -> None:
        self.cfg, self.domain, self.dist, self.fsdp, self.log = cfg, domain, dist, fsdp, log
        o = cfg.optim
        groups = param_groups(params, domain.critic_parameters(), critic_lr)
        self.adamw = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        self.steps_per_iteration = o.inner_epochs * o.minibatches_per_epoch
        self.scheduler = make_scheduler(self.adamw, o, cfg.iterations * self.steps_per_iteration)
        if o.ema_decay > 0 and fsdp is not None:
            raise ConfigError("optim.ema_decay keeps a whole copy of the trained weights per process; with "
                              "distributed.strategy: fsdp2 set optim.ema_decay: 0 (or use replicate)")
        self.ema = WeightEMA(params, o.ema_decay) if o.ema_decay > 0 else None
        self.nonfinite_steps = 0  # in a row
        self.nonfinite_total = 0
        # the entropy bonus's coefficient: a per-optimizer-step schedule like the learning rate's (loss.entropy)
        self.entropy = EntropyCoefficient(cfg.loss.entropy)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.adamw.param_groups for p in g["params"]]

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def averaged(self):
        """The weight average (optim.ema_decay) in the parameters, for evaluation and export; no-op when off."""
        return self.ema.swapped() if self.ema is not None else contextlib.nullcontext()

    def step(self, stats: StepStats) -> None:
        """Sum gradients over ranks, clip, then step (or skip a non-finite step, stopping after too many)."""
        cfg = self.cfg
        params = self.params
        self.dist.sum_gradients(params)  # FSDP2-sharded gradients (DTensors) are already summed: skipped
        clip = cfg.optim.grad_clip if cfg.optim.grad_clip is not None else float("inf")
        if self.fsdp is not None:
            from .distributed import clip_grad_norm_global_

            grad_norm = clip_grad_norm_global_(params, clip, self.dist)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        if not torch.isfinite(grad_norm):
            self.nonfinite_steps += 1
            self.nonfinite_total += 1
            stats.add("nonfinite_steps", 1.0, 0.0)
            self.adamw.zero_grad(set_to_none=True)
            self.log(f"WARNING: non-finite loss/gradient; optimizer step skipped ({self.nonfinite_steps} in a row)")
            if self.nonfinite_steps >= cfg.max_nonfinite_steps:
                raise NonFiniteError(
                    f"{self.nonfinite_steps} optimizer steps in a row had NaN/Inf gradients; lower optim.lr, set "
                    f"optim.grad_clip, or raise max_nonfinite_steps (now {cfg.max_nonfinite_steps})"
                )
            return
        self.nonfinite_steps = 0
        stats.add("grad_norm", float(grad_norm), 1.0)
        self.domain.before_optimizer_step()
        self.adamw.step()
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update()
        self.domain.after_optimizer_step()

    # ---- checkpoint pieces ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-serialisable: the schedule, the non-finite count and the average's step count."""
        return {"scheduler": self.scheduler.state_dict(), "nonfinite_total": self.nonfinite_total,
                **({"ema_steps": self.ema.steps} if self.ema is not None else {}),
                **({"entropy_coef": self.entropy.state()} if self.entropy.adaptive else {})}

    def load(self, opt_state: dict | None, state: dict[str, Any], ema_tensors: dict[str, torch.Tensor]) -> None:
        if self.ema is not None and ema_tensors:
            self.ema.load(ema_tensors, state.get("ema_steps", 0))
        elif self.ema is not None:  # a run started without optim.ema_decay: the average starts at its weights
            self.log("the checkpoint has no weight average (optim.ema_decay was 0): it starts at its weights")
            self.ema = WeightEMA(self.ema.params, self.ema.decay)
        if opt_state is not None:
            self.adamw.load_state_dict(opt_state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        if self.entropy.adaptive and "entropy_coef" in state:
            self.entropy.load(state["entropy_coef"])
        elif self.entropy.adaptive:  # a run started with a fixed coefficient: adaptation starts from loss.entropy.coef
            self.log("the checkpoint has no adaptive entropy coefficient: it starts at loss.entropy.coef")
