"""The trainable side of a visgen run: which weights of the pipeline's transformer train (LoRA or all of them), the
reference policy for KL, an EMA of the trained weights, checkpoint tensors and the diffusers/PEFT export.

- **LoRA** (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021) is injected with peft through
  diffusers' ``add_adapter`` on the unmodified transformer (the Flow-GRPO / DanceGRPO default: rank 32-64 on the
  attention projections). B starts at zero, so the adapted model equals the base model at step 0 (importance
  ratio 1, KL 0).
- **Reference policy** for the KL term: the base model is the adapter switched off (``disable_adapters``), so no
  second copy of the model is kept. Full fine-tuning has no adapter to switch off; there a frozen copy of the
  transformer is kept (optional, it doubles the transformer's memory).
- **EMA** of the trained weights (Flow-GRPO keeps one with decay 0.9 for evaluation): ``ema_weights()`` swaps the
  averaged weights in for evaluation and export, and back out.
- **Old policy** (DiffusionNFT's v_old and sampler, AWM's EMA-KL target): a lagging copy of the trained weights,
  soft-updated once per iteration before its rollout (``enable_old_policy`` / ``sync_old_policy``). A frozen
  **teacher** (on-policy distillation) takes the old copy's place: a second transformer of the same pipeline family
  and scheduler, loaded from its own checkpoint (``enable_old_policy(..., update=TeacherSource(path))``), never
  updated and never written to checkpoints. Further named **snapshots** on decay schedules of their own sit beside
  the old copy (``add_snapshot``; CRD's "old" model, while the old copy is its "sampling" model), set up through the
  ``Snapshots`` hook an objective hands to ``enable_old_policy`` and checkpointed as ``snap.<name>.<param>``.
- **Checkpoints**: ``state_dict`` holds the trained tensors by parameter name plus ``ema.<name>`` when EMA is on
  and ``old.<name>`` + ``old_synced_iteration`` with an old policy, so a resumed run continues exactly.
- **Export**: ``save_pretrained`` writes the LoRA in the diffusers layout (``pytorch_lora_weights.safetensors`` with
  the adapter metadata) that ``pipe.load_lora_weights(dir)`` loads; full fine-tuning writes ``transformer/``.
"""
from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path
from typing import Iterator

import torch

from shared_rl.config import ConfigError

# torch-free, so the config reads them without this module (visgen.policy.X as before)
from .part_settings import DEFAULT_LORA_TARGETS, EmaSettings, LoraSettings  # noqa: F401
# an old-policy schedule's ``update`` hooks: torch-free, the objectives' config-time half builds them
from .objective_settings import Snapshots, TeacherSource  # noqa: F401


def _scheduler_config(scheduler) -> dict:
    """A scheduler's settings without diffusers' bookkeeping keys (the version that saved it, the defaults it filled)."""
    return {k: v for k, v in dict(scheduler.config).items() if k not in ("_diffusers_version", "_use_default_values")}


def old_decay(steps: int, decay_max: float, ramp: float | None, flat: int = 0, start: float = 0.0) -> float:
    """The old copy's decay after ``steps`` optimizer steps: ``start`` before ``flat`` steps, then
    min(``decay_max``, ``start`` + ``ramp``·(steps − ``flat``)); ``ramp`` None: ``decay_max`` (DiffusionNFT's
    ``return_decay`` and AWM's linear / constant ``kl_ema_decay`` with start 0; Flow-Factory CRD's
    ``start_step-start_value-slope-end_value`` decays with a start value)."""
    if steps < flat:
        return start
    return decay_max if ramp is None else min(decay_max, start + ramp * (steps - flat))


class FlowPolicy:
    """Trainable weights of ``pipe.transformer`` (LoRA adapter or all), reference, EMA, checkpoint and export.

    Puts every pipeline module in eval mode (no dropout: recomputed log-probs must equal the rollout's) and freezes
    everything that is not trained. ``train_mode``: ``"lora"`` or ``"full"``.
    """

    ADAPTER = "default"
    OLD_SYNCED = "old_synced_iteration"  # state_dict entry: the iteration the old copy was last synced for

    def __init__(
        self,
        pipe,
        train_mode: str = "lora",
        lora: LoraSettings | None = None,
        ema: EmaSettings | None = None,
        gradient_checkpointing: bool = False,
        full_reference: bool = True,
    ) -> None:
        self.pipe = pipe
        self.transformer: torch.nn.Module = pipe.transformer
        self.train_mode = train_mode
        self.lora = lora or LoraSettings()
        self.ema_settings = ema or EmaSettings()
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.eval()
                component.requires_grad_(False)
        self.reference_copy: torch.nn.Module | None = None
        if train_mode == "lora":
            self._add_lora()
        elif train_mode == "full":
            if full_reference:
                self.reference_copy = copy.deepcopy(self.transformer).eval().requires_grad_(False)
            self.transformer.requires_grad_(True)
        else:
            raise ConfigError(f"train_mode must be 'lora' or 'full', got {train_mode!r}")
        # the optimizer updates float32 master weights even when the frozen model runs in bf16/fp16
        for p in self.trainable_parameters():
            if p.dtype != torch.float32:
                p.data = p.data.float()
        if gradient_checkpointing:
            if not hasattr(self.transformer, "enable_gradient_checkpointing"):
                raise ConfigError(f"{type(self.transformer).__name__} does not support gradient checkpointing")
            self.transformer.enable_gradient_checkpointing()
        self.transformer.eval()  # diffusers checkpoints blocks whenever grad is enabled, in eval mode too
        self._names = [n for n, p in self.transformer.named_parameters() if p.requires_grad]
        self.ema: dict[str, torch.Tensor] | None = None
        self.old: dict[str, torch.Tensor] | None = None  # DiffusionNFT's old policy (enable_old_policy)
        self.teacher: torch.nn.Module | None = None  # on-policy distillation's frozen teacher (enable_old_policy)
        # further lagging copies on schedules of their own (CRD's "old" model; add_snapshot), name -> (weights, schedule)
        self.snapshots: dict[str, tuple[dict[str, torch.Tensor], tuple]] = {}
        self._old_start = 0.0  # the old copy's decay before its flat steps (old_decay's start)
        self._old_refresh_every = 0  # > 0: the old copy is replaced at these step multiples instead (RefreshEvery)
        self._old_steps = 0
        self._old_synced = 0
        self._ema_steps = 0
        if self.ema_settings.enabled:
            self.ema = {n: p.detach().clone() for n, p in self._named_trainable()}

    # ------------------------------------------------------------------------------------------------ setup
    def _add_lora(self) -> None:
        from peft import LoraConfig

        config = LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=self.lora.dropout,
            target_modules=list(self.lora.target_modules),
            init_lora_weights=True if self.lora.init == "default" else "gaussian",
        )
        try:
            self.transformer.add_adapter(config, adapter_name=self.ADAPTER)
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise ConfigError(f"lora.target_modules {self.lora.target_modules} do not match "
                              f"{type(self.transformer).__name__} ({exc})") from None
        self.lora_config = config

    def _named_trainable(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        params = dict(self.transformer.named_parameters())
        for name in self._names:
            yield name, params[name]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._named_trainable()]

    # ------------------------------------------------------------------------------------------------ reference
    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference (base) model for KL: the adapter switched off, or the frozen copy under full tuning."""
        if self.train_mode == "lora":
            self.transformer.disable_adapters()  # peft: each LoRA layer skips its adapter
            try:
                yield self.transformer
            finally:
                self.transformer.enable_adapters()  # also restores requires_grad on the adapter weights
        else:
            if self.reference_copy is None:
                raise ConfigError("loss.kl_coef > 0 with train_mode: full needs full_reference: true (a frozen copy)")
            original = self.pipe.transformer
            self.pipe.transformer = self.reference_copy
            try:
                yield self.reference_copy
            finally:
                self.pipe.transformer = original

    @property
    def has_base_switch(self) -> bool:
        """Whether the base model is available without a copy (LoRA: disable the adapter)."""
        return self.train_mode == "lora"

    # ------------------------------------------------------------------------------------------------ EMA
    def update_ema(self) -> None:
        if self.ema is None:
            return
        self._ema_steps += 1
        if self._ema_steps % self.ema_settings.update_every:
            return
        with torch.no_grad():
            for name, p in self._named_trainable():
                self.ema[name].lerp_(p.detach(), 1.0 - self.ema_settings.decay)

    @contextlib.contextmanager
    def _swapped(self, shadow: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Swap ``shadow`` copies of the trainable weights in (no-op for None); the live weights come back on exit."""
        if shadow is None:
            yield
            return
        live = {}
        with torch.no_grad():
            for name, p in self._named_trainable():
                live[name] = p.detach().clone()
                p.copy_(shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self._named_trainable():
                    p.copy_(live[name])

    def ema_weights(self) -> contextlib.AbstractContextManager:
        """Swap the EMA weights in (no-op without EMA); the live weights come back on exit."""
        return self._swapped(self.ema)

    # ------------------------------------------------------------------------------------------------ old policy
    def enable_old_policy(self, decay_max: float, decay_ramp: float | None, decay_flat: int = 0,
                          update: str = "iteration") -> None:
        """Keep an "old" copy of the trainable weights (DiffusionNFT's old policy, AWM's EMA), soft-updated as
        θ_old ← d·θ_old + (1 − d)·θ with d = ``old_decay(k)`` after k optimizer steps: 0 for k < ``decay_flat``, then
        min(``decay_max``, ``decay_ramp``·(k − ``decay_flat``)) (``decay_ramp`` None: ``decay_max``), the
        references' ``return_decay``. ``update``: ``"iteration"`` — once per iteration, before its rollout
        (``sync_old_policy``; the references update after each epoch's training, with the same step count);
        ``"step"`` — after every optimizer step with d = old_decay(steps before it) (grove's earlier form)."""
        if hasattr(update, "enable"):  # an objective's own setup of its copies (a teacher, several snapshots)
            update.enable(self, float(decay_max), decay_ramp, int(decay_flat))
            return
        if update not in ("iteration", "step"):
            raise ValueError(f"old policy update must be 'iteration' or 'step', got {update!r}")
        self.old = {n: p.detach().clone() for n, p in self._named_trainable()}
        self._old_schedule = (float(decay_max), None if decay_ramp is None else float(decay_ramp), int(decay_flat),
                              update)
        self._old_steps = 0
        self._old_synced = 0

    def _enable_teacher(self, model: str) -> None:
        """Load the teacher's pipeline, refuse another family or scheduler (ConfigError, one line: it must replay the
        student's stored states on the student's noise grid, as verl-omni's worker init requires), keep its
        transformer frozen on the student's device in the student's base dtype. The old copy is then the teacher:
        ``old`` holds no lagging weights, ``sync_old_policy`` and ``old_policy_step`` never change it."""
        from .pipelines.load import load_pipeline

        frozen = [p for p in self.transformer.parameters() if not p.requires_grad]
        if not frozen and self.reference_copy is not None:  # full tuning: the frozen copy keeps the load dtype
            frozen = list(self.reference_copy.parameters())
        dtype = frozen[0].dtype if frozen else torch.float32
        device = next(self.transformer.parameters()).device
        try:
            teacher_pipe, _location, _local = load_pipeline(model, dtype)
        except ConfigError as exc:  # name the teacher: the message alone reads like visgen.model's
            raise ConfigError(f"visgen.objective teacher: {exc} (a trained run's final/ becomes one with "
                              "visgen.tiny.merge_teacher)") from None
        student, teacher = type(self.pipe).__name__, type(teacher_pipe).__name__
        if teacher != student:
            raise ConfigError(f"the teacher {model!r} is a {teacher}, the student a {student}: on-policy distillation "
                              "needs a teacher of the student's pipeline family")
        mine, theirs = _scheduler_config(self.pipe.scheduler), _scheduler_config(teacher_pipe.scheduler)
        mine["class"], theirs["class"] = type(self.pipe.scheduler).__name__, type(teacher_pipe.scheduler).__name__
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            raise ConfigError(f"the teacher {model!r} has another scheduler than the student (differs in {diff}): it "
                              "must replay the student's states on the same noise schedule")
        self.teacher = teacher_pipe.transformer.to(device).eval().requires_grad_(False)
        self.old = {}
        self._old_schedule = (0.0, None, 0, "teacher")
        self._old_steps = 0
        self._old_synced = 0

    @contextlib.contextmanager
    def _teacher_swapped(self) -> Iterator[None]:
        original = self.pipe.transformer
        self.pipe.transformer = self.teacher
        try:
            yield
        finally:
            self.pipe.transformer = original

    def add_snapshot(self, name: str, decay_max: float, ramp: float | None, flat: int = 0, start: float = 0.0) -> None:
        """A further named lagging copy of the trained weights beside the old copy (CRD's "old" model, whose decay
        has its own schedule, while the main old copy is its "sampling" model), soft-updated with the old copy in
        ``sync_old_policy`` with d = ``old_decay(steps, decay_max, ramp, flat, start)``; checkpointed as
        ``snap.<name>.<param>``; swapped in by ``snapshot_weights(name)``. Needs ``enable_old_policy`` first."""
        if self.old is None or self.teacher is not None:
            raise RuntimeError("add_snapshot() needs an old copy of the trained weights (enable_old_policy first)")
        self.snapshots[name] = ({n: p.detach().clone() for n, p in self._named_trainable()},
                                (float(decay_max), None if ramp is None else float(ramp), int(flat), float(start)))

    def snapshot_weights(self, name: str) -> contextlib.AbstractContextManager:
        """Swap the named snapshot's weights in (``add_snapshot`` first); the live weights come back on exit."""
        return self._swapped(self.snapshots[name][0])

    @property
    def _has_old_copy(self) -> bool:
        """A lagging copy of the trained weights (not a teacher): what checkpoints carry as ``old.<name>``."""
        return self.old is not None and self.teacher is None

    def old_decay(self, steps: int) -> float:
        if self._old_refresh_every:  # flow_grpo DPO's "ref" adapter: a copy at positive multiples, else kept
            return 0.0 if steps > 0 and steps % self._old_refresh_every == 0 else 1.0
        return old_decay(steps, *self._old_schedule[:3], start=self._old_start)

    def _lerp_old(self, decay: float) -> None:
        if self.teacher is not None:  # a teacher is never updated
            return
        with torch.no_grad():
            for name, p in self._named_trainable():
                self.old[name].lerp_(p.detach(), 1.0 - decay)

    def old_policy_step(self) -> None:
        """After every optimizer step: count it (and, with ``update: step``, soft-update the old copy)."""
        if self.old is None:
            return
        if self._old_schedule[3] == "step":
            self._lerp_old(self.old_decay(self._old_steps))
        self._old_steps += 1

    def sync_old_policy(self, iteration: int) -> bool:
        """Before iteration ``iteration``'s first rollout (``update: iteration``): soft-update the old copy once with
        d = old_decay(optimizer steps so far). Idempotent per iteration; the iteration it last synced for is part of
        ``state_dict`` (saved with the weights it describes). Returns whether it updated."""
        if self.old is None or self._old_schedule[3] != "iteration" or iteration <= self._old_synced:
            return False
        self._lerp_old(self.old_decay(self._old_steps))
        with torch.no_grad():
            for weights, schedule in self.snapshots.values():
                d = old_decay(self._old_steps, *schedule)
                for name, p in self._named_trainable():
                    weights[name].lerp_(p.detach(), 1.0 - d)
        self._old_synced = int(iteration)
        return True

    def old_weights(self) -> contextlib.AbstractContextManager:
        """Swap the old-policy weights in (``enable_old_policy`` first)."""
        if self.old is None:
            raise RuntimeError("old_weights() before enable_old_policy()")
        if self.teacher is not None:  # the teacher's own transformer replaces the student's for the block
            return self._teacher_swapped()
        return self._swapped(self.old)

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {name: p.detach().clone() for name, p in self._named_trainable()}
        if self.ema is not None:
            state.update({f"ema.{name}": t.clone() for name, t in self.ema.items()})
        if self._has_old_copy:
            state.update({f"old.{name}": t.clone() for name, t in self.old.items()})
            state[self.OLD_SYNCED] = torch.tensor([self._old_synced], dtype=torch.long)
        for snap, (weights, _schedule) in self.snapshots.items():
            state.update({f"snap.{snap}.{name}": t.clone() for name, t in weights.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        names = set(self._names) | ({f"ema.{n}" for n in self._names} if self.ema is not None else set())
        if self._has_old_copy:
            names |= {f"old.{n}" for n in self._names} | {self.OLD_SYNCED}
        names |= {f"snap.{snap}.{n}" for snap in self.snapshots for n in self._names}
        missing, unexpected = names - set(state), set(state) - names
        if missing or unexpected:
            raise ValueError(f"visgen policy state mismatch: missing {sorted(missing)[:3]}, unexpected "
                             f"{sorted(unexpected)[:3]} (was the checkpoint made with other lora/ema settings?)")
        with torch.no_grad():
            for name, p in self._named_trainable():
                p.copy_(state[name])
                if self.ema is not None:
                    self.ema[name].copy_(state[f"ema.{name}"])
                if self._has_old_copy:
                    self.old[name].copy_(state[f"old.{name}"])
                for snap, (weights, _schedule) in self.snapshots.items():
                    weights[name].copy_(state[f"snap.{snap}.{name}"])
        if self._has_old_copy:
            self._old_synced = int(state[self.OLD_SYNCED].reshape(-1)[0])

    def extra_state(self) -> dict:
        return {"ema_steps": self._ema_steps, "old_steps": self._old_steps}

    def load_extra_state(self, state: dict) -> None:
        self._ema_steps = int(state.get("ema_steps", 0))
        if self.old is not None:
            self._old_steps = int(state.get("old_steps", 0))

    # ------------------------------------------------------------------------------------------------ export
    def save_pretrained(self, out_dir: Path, use_ema: bool = True, info: dict | None = None) -> Path:
        """LoRA: the diffusers layout ``pipe.load_lora_weights(out_dir)`` reads; full: ``out_dir/transformer``.

        With EMA on (and ``use_ema``), the exported weights are the EMA weights (the ones evaluation uses).
        """
        out_dir = Path(out_dir)

        def write_lora(layers: dict[str, torch.Tensor]) -> None:
            layers = {k: v.detach().to("cpu").contiguous() for k, v in layers.items()}
            metadata = self.lora_config.to_dict()
            metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
            if hasattr(type(self.pipe), "save_lora_weights"):
                type(self.pipe).save_lora_weights(
                    out_dir, transformer_lora_layers=layers, transformer_lora_adapter_metadata=metadata,
                    safe_serialization=True,
                )
            else:  # a pipeline without a LoRA loader (HunyuanVideo 1.5 in diffusers 0.42): the transformer's own
                # PEFT export (unprefixed keys), which `pipe.transformer.load_lora_adapter(dir, prefix=None)` loads
                self.transformer.save_lora_adapter(out_dir, adapter_name=self.ADAPTER, safe_serialization=True)

        from .fsdp import is_sharded

        if is_sharded(self.transformer):  # FSDP2: every process gathers (collective), process 0 writes
            import torch.distributed as dist

            from .fsdp import save_sharded

            if dist.get_rank() == 0:
                out_dir.mkdir(parents=True, exist_ok=True)
            save_sharded(self, out_dir, write_lora)  # EMA is refused under FSDP2: the live weights are the export
            if dist.get_rank() != 0:
                return out_dir
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
            with self.ema_weights() if use_ema else contextlib.nullcontext():
                if self.train_mode == "lora":
                    from peft.utils import get_peft_model_state_dict

                    write_lora(get_peft_model_state_dict(self.transformer, adapter_name=self.ADAPTER))
                else:
                    self.transformer.save_pretrained(out_dir / "transformer", safe_serialization=True)
        meta = {"train_mode": self.train_mode, "ema": self.ema is not None and use_ema, **(info or {})}
        (out_dir / "grove_export.json").write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        return out_dir
