"""A drop-in for TRL's ``GRPOTrainer``: the model, reward functions, dataset and ``GRPOConfig`` you hold, grove's loop.

    from trl import GRPOConfig
    from shared_rl.llm.api import GRPOTrainer                  # instead of: from trl import GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=[accuracy, "path/to/reward-model"],
                          args=GRPOConfig(output_dir="runs/qwen", num_generations=8, max_completion_length=256),
                          train_dataset=dataset, peft_config=LoraConfig(r=16))
    out = trainer.train()                                      # transformers' TrainOutput
    trainer.state.log_history[-1]["train_loss"]; trainer.save_model("runs/qwen/final")

What each argument becomes:

- ``args``: a TRL ``GRPOConfig`` or a mapping of its field names, translated field by field (``trl_args.py``; the
  table in docs/methods/llm.md; a field grove cannot honour is one ``ConfigError`` line naming it), or, as before,
  grove's own config sections (``{"optim": {"lr": 1e-4}, "llm": {...}}``) or CLI-style strings. ``None`` = TRL's
  default ``GRPOConfig``. With a GRPOConfig, ``train()`` returns a ``TrainOutput`` and ``state.log_history`` holds
  TRL's metric names; with grove sections ``train()`` returns grove's metric records, as it always did.
- ``model``: a ``transformers`` causal LM object (trained in place) or a path / hub id (loaded with
  ``model_init_kwargs``); ``peft_config`` a peft config wrapping it (the reference policy is then the base model).
  ``processing_class``: its tokenizer (default: loaded from the model's path).
- ``reward_funcs``: callables with TRL's signature ``f(prompts, completions, completion_ids, **columns) -> list``
  (sync or ``async def``; a value per completion, ``None`` = not applicable), sequence-classification reward models
  (objects, paths or hub ids; scored on prompt + completion with ``reward_processing_classes``, logit 0, as TRL), or
  names of grove's built-in rewards (``numeric_match``, ``exact_match``, ``format``, ``length_penalty``,
  ``overlong``). ``reward_weights`` (or ``GRPOConfig.reward_weights``) their weights.
- ``train_dataset`` / ``eval_dataset``: a list of dicts, a ``datasets.Dataset`` / ``IterableDataset`` (a streamed
  one is read once, to ``max_steps`` generations' worth when it has no length) or a dict of named eval sets, with a
  ``prompt`` column (a string or a list of chat messages, which go through the tokenizer's chat template); other
  columns reach the reward functions by name. Written as JSONL beside the run (a temporary folder without
  ``run_dir`` / ``output_dir``).
"""
from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..api import load_config, merge, removed_if_refused
from ..config import ConfigError, TrainConfig, apply_overrides
from ..trainer import Trainer
from .rewards import BUILTIN_REWARDS

# warnings go to the logger TRL's GRPOTrainer uses, so a TRL user's log filters and handlers still see them
trl_logger = logging.getLogger("trl.trainer.grpo_trainer")
_registered: dict[str, Callable] = {}  # name in BUILTIN_REWARDS -> the caller's function it stands for
_counter = itertools.count()


def _register(fn: Callable) -> str:
    """The caller's reward function as a built-in reward name (the config names rewards; the name is unique per
    function object, so two functions both called ``reward`` do not collide)."""
    for name, known in _registered.items():
        if known is fn:
            return name
    name = f"python:{getattr(fn, '__name__', 'reward')}:{next(_counter)}"
    _registered[name] = fn
    BUILTIN_REWARDS[name] = lambda _fn=fn: _fn  # a factory without arguments returning the function itself
    return name


def _rows_of(data: Any, what: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows as dicts from a list, a ``datasets.Dataset`` or a (streamed) ``IterableDataset`` (at most ``limit``)."""
    rows = []
    for row in data:
        rows.append(dict(row))
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _write_rows(rows: Iterable[Mapping[str, Any]], path: Path, what: str) -> Path:
    rows = [dict(r) for r in rows]
    if not rows:
        raise ConfigError(f"{what} is empty: give a list of dicts with a 'prompt' column")
    missing = next((i for i, r in enumerate(rows) if "prompt" not in r), None)
    if missing is not None:
        raise ConfigError(f"{what} row {missing} has no 'prompt' column (columns: {sorted(rows[missing])})")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    return path


# ---- rewards as TRL takes them -------------------------------------------------------------------------------------
def _sync(fn: Callable) -> Callable:
    """An ``async def`` reward as a plain function (each call runs its coroutine to the end in a fresh event loop:
    grove calls a reward from its guard thread, where no loop runs)."""
    def run(**kwargs):
        return asyncio.run(fn(**kwargs))
    run.__name__ = getattr(fn, "__name__", "reward")
    return run


def _is_reward_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module)


def reward_model_function(model: torch.nn.Module, tokenizer, chat_template_kwargs: dict | None = None) -> Callable:
    """A sequence-classification reward model as a TRL-signature reward function, scored as TRL scores it: the
    prompt followed by the completion (for conversations, the messages through ``tokenizer``'s chat template),
    right-padded, no special tokens added, the first logit of each row."""
    cls = type(model).__name__
    if not cls.endswith("ForSequenceClassification") and not hasattr(model, "score"):
        raise ConfigError(f"reward model {cls} is not a sequence classifier (AutoModelForSequenceClassification): "
                          f"it has no score head to read a reward from")
    vocab = getattr(model.config.get_text_config(), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ConfigError(f"reward processing class has {len(tokenizer)} tokens, more than reward model {cls}'s "
                          f"vocabulary of {vocab}: pass the reward model's own tokenizer in reward_processing_classes")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.eval().requires_grad_(False)

    def reward_model(prompts, completions, **_):
        if isinstance(prompts[0], list):
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False, **(chat_template_kwargs or {}))
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        batch = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        device = next(model.parameters()).device
        with torch.inference_mode():
            return model(**{k: v.to(device) for k, v in batch.items()}).logits[:, 0].float().tolist()

    reward_model.__name__ = str(getattr(model.config, "_name_or_path", "") or cls).rstrip("/").split("/")[-1]
    return reward_model


def _load_reward_model(path: str, init_kwargs: dict, device):
    from transformers import AutoModelForSequenceClassification

    from .model import resolve_model_path

    return AutoModelForSequenceClassification.from_pretrained(resolve_model_path(path), num_labels=1,
                                                              **init_kwargs).to(device)


def _name_of(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


# ---- the TRL-shaped state --------------------------------------------------------------------------------------
class _Recorder:
    """TRL's metrics of the training rollouts, from the raw reward values (None as NaN) the domain hands over:
    ``rewards/<f>/mean`` and ``/std`` (over the samples the function scored), ``reward`` and ``reward_std`` (of the
    weighted nansum, a sample no function scored left out), ``frac_reward_zero_std``, completion lengths."""

    def __init__(self, weights: dict[str, float], group_size: int) -> None:
        self.weights, self.group_size = weights, group_size
        self.calls: list[tuple[dict[str, torch.Tensor], list[bool], list[int]]] = []

    def __call__(self, raw: dict[str, torch.Tensor], truncated: list[bool], completion_ids: list[list[int]]) -> None:
        self.calls.append(({k: v.clone() for k, v in raw.items()}, list(truncated), [len(c) for c in completion_ids]))
        unscored = ~torch.stack([torch.isfinite(r) for r in raw.values()]).any(0)
        if bool(unscored.any()):  # TRL's warning, word for word: that sample gets no update
            trl_logger.warning(f"All reward functions returned None for the following kwargs: completion "
                               f"{int(unscored.nonzero()[0])} of this batch. Please ensure that at least one reward "
                               f"function returns a valid reward.")

    def drain(self) -> dict[str, float]:
        if not self.calls:
            return {}
        raw = {k: torch.cat([c[0][k] for c in self.calls]) for k in self.calls[0][0]}
        truncated = [t for c in self.calls for t in c[1]]
        lengths = torch.tensor([n for c in self.calls for n in c[2]], dtype=torch.float32)
        self.calls = []
        return trl_reward_metrics(raw, self.weights, self.group_size, truncated, lengths)


def _nanstd(x: torch.Tensor) -> float:
    """The unbiased std of the finite values (TRL's ``nanstd``); NaN with fewer than two."""
    x = x[torch.isfinite(x)].double()
    return float(x.std()) if x.numel() > 1 else math.nan


def trl_reward_metrics(raw: dict[str, torch.Tensor], weights: dict[str, float], group_size: int,
                       truncated: list[bool], lengths: torch.Tensor) -> dict[str, float]:
    """TRL's reward and completion metrics of one generation (``_generate_and_score_completions``): rows are
    prompt-major groups of ``group_size``."""
    out: dict[str, float] = {}
    total = None
    for name, r in raw.items():
        finite = r[torch.isfinite(r)]
        out[f"rewards/{name}/mean"] = float(finite.double().mean()) if finite.numel() else math.nan
        out[f"rewards/{name}/std"] = _nanstd(r)
        term = torch.nan_to_num(r.double(), nan=0.0) * weights.get(name, 1.0)
        total = term if total is None else total + term
    scored = torch.stack([torch.isfinite(r) for r in raw.values()]).any(0)
    total = torch.where(scored, total, torch.full_like(total, math.nan))
    out["reward"] = float(total[scored].mean()) if scored.any() else math.nan
    out["reward_std"] = _nanstd(total)
    groups = total.view(-1, group_size)
    stds = torch.stack([torch.tensor(_nanstd(g)) for g in groups])
    out["frac_reward_zero_std"] = float(torch.isclose(torch.nan_to_num(stds, nan=0.0), torch.zeros(())).double().mean())
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/min_length"] = float(lengths.min())
    out["completions/max_length"] = float(lengths.max())
    cut = torch.tensor(truncated, dtype=torch.bool)
    out["completions/clipped_ratio"] = float(cut.double().mean())
    ended = lengths[~cut]
    out["completions/mean_terminated_length"] = float(ended.mean()) if ended.numel() else 0.0
    return out


def _trl_train_metrics(rec: dict[str, Any], kl_coef: float) -> dict[str, float]:
    """grove's record of one iteration in TRL's names (the optimizer-step averages grove logs); with an entropy
    bonus ``loss`` is the whole loss (policy + β·KL − coefficient·entropy) and ``policy_loss`` its policy part."""
    out = {}
    policy = rec.get("loss/policy")
    if policy is not None:
        out["loss"] = float(policy) + kl_coef * float(rec.get("loss/kl", 0.0))
        if "loss/entropy_bonus" in rec:
            out["loss"] -= float(rec["entropy_coef"]) * float(rec["loss/entropy_bonus"])
            out["policy_loss"] = float(policy)
            out["entropy_coef"] = float(rec["entropy_coef"])
    for ours, theirs in (("grad_norm", "grad_norm"), ("lr", "learning_rate"), ("entropy", "entropy"),
                         ("clip_frac", "clip_ratio/region_mean")):
        if isinstance(rec.get(ours), (int, float)):
            out[theirs] = float(rec[ours])
    if kl_coef != 0 and "loss/kl" in rec:
        out["kl"] = float(rec["loss/kl"])
    return out


class GRPOTrainer:
    """``GRPOTrainer(model, reward_funcs, args, train_dataset, ...).train()`` — see the module docstring."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Sequence[Any] | None = None, optimizers: tuple = (None, None), peft_config: Any = None,
                 reward_weights: Sequence[float] | None = None, run_dir: str | Path | None = None, log=print,
                 **unsupported: Any) -> None:
        given = {k for k, v in unsupported.items() if v is not None}
        if given:  # TRL's tools / rollout_func / environment_factory: agentic loops grove does not run
            raise ConfigError(f"GRPOTrainer: {sorted(given)} are not supported by grove (no tool calls, custom "
                              f"rollout functions or environments)")
        if any(o is not None for o in optimizers):
            raise ConfigError("GRPOTrainer: optimizers=(...) is not supported; grove builds AdamW from the config "
                              "(learning_rate, adam_beta1/2, weight_decay, lr_scheduler_type)")
        from .trl_args import from_mapping, is_grpo_config, translate, trl_field_names

        trl_mode = args is None or is_grpo_config(args)
        if isinstance(args, Mapping) and args and not trl_mode:
            grove_keys = {f for f in TrainConfig.__dataclass_fields__} | {"llm"}
            keys = set(args)
            if keys <= trl_field_names() and not keys <= grove_keys:
                args, trl_mode = from_mapping(dict(args)), True
        if args is None:
            from trl import GRPOConfig

            args = GRPOConfig(output_dir=str(run_dir or "trainer_output"), report_to="none",
                              use_cpu=not torch.cuda.is_available())
            if run_dir is None:
                run_dir = False  # TRL's defaults, nothing written unless the caller names a directory
        self.trl_mode = trl_mode
        self.log = log
        self._tmp = None
        self._logs = {"extra": {}}  # what reward functions logged with log_extra (TRL's completions table)
        self.callbacks = list(callbacks or [])
        self.eval_dataset = eval_dataset
        self.train_dataset = train_dataset
        if train_dataset is None:
            raise ConfigError("`train_dataset` is required: give a list of dicts or a datasets.Dataset with a "
                              "'prompt' column")
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            raise ConfigError("No reward source provided: give reward_funcs (functions, reward models or built-in "
                              "names)")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.args = args if trl_mode else None
        if trl_mode and not hasattr(train_dataset, "__len__") and getattr(args, "accelerator_config", None) is not None:
            # as TRL: a stream is read by each process itself, never dispatched (what args reports to callbacks)
            args.accelerator_config.dispatch_batches = False

        from .model import resolve_model_path

        t = None
        init_kwargs: dict[str, Any] = {}
        if trl_mode:
            t_rows = self._train_rows(train_dataset, args)
            t = translate(args, len(t_rows), has_peft=peft_config is not None or hasattr(model, "peft_config"))
            init_kwargs = dict(t.trainer["model_init_kwargs"])
            if t.trainer["trust_remote_code"]:
                init_kwargs["trust_remote_code"] = True
            for note in t.notes:
                log(f"grove: {note}")
                trl_logger.warning(note)
            if run_dir is None:
                run_dir = t.trainer["output_dir"]
        else:
            t_rows = None
        # ---- the policy (loaded here when named, so `model` and its parameters exist before train())
        if isinstance(model, (str, Path)) and (trl_mode or peft_config is not None):
            from transformers import AutoModelForCausalLM

            path = resolve_model_path(str(model))
            try:
                model = AutoModelForCausalLM.from_pretrained(path, **init_kwargs)
            except ValueError as e:
                raise ConfigError(f"model {path!r}: {str(e).splitlines()[0]}") from None
            if processing_class is None:
                from .model import load_tokenizer

                processing_class = load_tokenizer(path)
        if t is not None and t.trainer["disable_dropout"] and not isinstance(model, (str, Path)):
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
        if peft_config is not None:
            from peft import get_peft_model

            if not hasattr(peft_config, "task_type") or peft_config.task_type is None:
                peft_config.task_type = "CAUSAL_LM"
            gradient_checkpointing = bool(t and t.config["llm"]["gradient_checkpointing"])
            if gradient_checkpointing:
                model.enable_input_require_grads()  # frozen embeddings + checkpointed blocks still need input grads
            model = get_peft_model(model, peft_config)
        if processing_class is not None and trl_mode:
            processing_class.padding_side = "left"
            if processing_class.pad_token_id is None:
                processing_class.pad_token = processing_class.eos_token
        self.processing_class = processing_class
        # ---- rewards
        if reward_processing_classes is None:
            reward_processing_classes = [None] * len(funcs)
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != len(funcs):
            raise ConfigError(f"The number of reward processing classes ({len(reward_processing_classes)}) must "
                              f"match the number of reward functions ({len(funcs)})")
        reward_processing_classes = list(reward_processing_classes)
        weights = list(reward_weights) if reward_weights is not None else None
        if weights is None and t is not None and "_reward_weights" in t.config:
            weights = t.config.pop("_reward_weights")
        weights = weights if weights is not None else [1.0] * len(funcs)
        if t is not None:
            t.config.pop("_reward_weights", None)
        if len(weights) != len(funcs):
            raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
        chat_kwargs = (t.config["llm"].get("dataset", {}).get("chat_template_kwargs") if t else None) or {}
        rewards, self.reward_funcs = [], []
        for i, (fn, w) in enumerate(zip(funcs, weights)):
            if isinstance(fn, str) and (fn in BUILTIN_REWARDS or ":" in fn):
                rewards.append({"name": fn, "weight": float(w)})
                self.reward_funcs.append(fn)
                continue
            if isinstance(fn, (str, Path)):  # TRL: a string that is not a function is a reward model
                fn = _load_reward_model(str(fn), {k: v for k, v in init_kwargs.items() if k != "device_map"}, "cpu")
            if _is_reward_model(fn):
                tok = reward_processing_classes[i]
                if tok is None:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(resolve_model_path(fn.config._name_or_path))
                    reward_processing_classes[i] = tok
                call = reward_model_function(fn, tok, chat_kwargs)
            elif callable(fn):
                call = _sync(fn) if inspect.iscoroutinefunction(fn) else fn
            else:
                raise ConfigError(f"reward_funcs[{i}] is a {type(fn).__name__}: give a function, a reward model or a "
                                  f"built-in reward name ({sorted(k for k in BUILTIN_REWARDS if ':' not in k)})")
            self.reward_funcs.append(fn)
            rewards.append({"name": _register(call), "weight": float(w), "label": _name_of(call)})
        self.reward_processing_classes = reward_processing_classes
        self.reward_weights = {r.get("label") or r["name"]: r["weight"] for r in rewards}
        # ---- the llm section
        section: dict[str, Any] = {"rewards": rewards}
        held: dict[str, Any] = {}
        if isinstance(model, (str, Path)):
            section["model"] = str(model)
        else:  # an object: handed to the domain (RunContext.objects), its path only names it in logs
            held["model"] = model
            section["model"] = str(getattr(model, "name_or_path", "") or type(model).__name__)
        if processing_class is not None:
            held["tokenizer"] = processing_class
        run_dir = None if run_dir is False else run_dir
        folder = Path(run_dir) / "datasets" if run_dir else Path(self._tmpdir())
        with removed_if_refused(folder if run_dir else None):  # a refused config leaves no RUN/datasets
            rows = t_rows if t_rows is not None else _rows_of(train_dataset, "train_dataset")
            dataset: dict[str, Any] = {"source": "jsonl", "path": str(_write_rows(rows, folder / "train.jsonl",
                                                                                 "train_dataset")),
                                       "num_train": 0}
            if trl_mode:
                dataset.update(eval_fraction=0.0, num_eval=0, long_prompts="truncate")  # TRL trains on every row
            elif eval_dataset is not None:
                dataset["eval_path"] = str(_write_rows(_rows_of(eval_dataset, "eval_dataset"), folder / "eval.jsonl",
                                                       "eval_dataset"))
            section["dataset"] = dataset
            self._folder = folder
            base = {"domain": "llm", "llm": section}
            if trl_mode:
                data = merge(base, t.config)
                self._t = t.trainer
            else:
                data = merge(base, args) if isinstance(args, Mapping) else apply_overrides(base, list(args or ()))
                self._t = None
            self.config = load_config(data)
            self.run_dir = Path(run_dir) if run_dir else None
            self._recorder = _Recorder(self.reward_weights, self.config.rollout.group_size)
            if trl_mode:
                from transformers import TrainerControl, TrainerState

                self.state = TrainerState(max_steps=self._t["max_steps"], num_train_epochs=self._t["num_train_epochs"],
                                          logging_steps=self._t["logging_steps"])
                self.control = TrainerControl()
                held["trainer_state"] = self.state
                held["log_extra"] = self._log_extra
                held["on_train_scores"] = self._recorder
            self.trainer = _HookedTrainer(self.config, self.run_dir, log=log, objects=held, on_iteration=self._on_iteration,
                                          fused_adamw=bool(trl_mode and self._t["fused_adamw"]))
        self.aux_loss_enabled = False
        self._entropy_bonus_enabled = self.config.loss.entropy.enabled  # TRL's flag, read by its helper above
        self._buffer: list[dict[str, float]] = []
        self._losses: list[tuple[float, int]] = []
        self._last_logged_step = 0
        self._start_time = None

    # ---- the surface TRL users read ------------------------------------------------------------------------------
    @staticmethod
    def _train_rows(train_dataset: Any, args) -> list[dict[str, Any]]:
        has_len = hasattr(train_dataset, "__len__")
        limit = None
        if not has_len:  # a stream: as many rows as max_steps generations read, as TRL's dataloader would
            if not (args.max_steps and args.max_steps > 0):
                raise ConfigError("an IterableDataset has no length: set GRPOConfig.max_steps")
            per_gen = (args.generation_batch_size or args.per_device_train_batch_size * args.steps_per_generation)
            limit = max(1, per_gen // args.num_generations) * args.max_steps
        return _rows_of(train_dataset, "train_dataset", limit)

    def _log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a reward function adds a column to the completions table (``_logs['extra']``)."""
        self._logs["extra"].setdefault(column, []).extend(list(values))

    def _tmpdir(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="grove-llm-")
        return self._tmp.name

    @property
    def model(self):
        """The policy being trained (the caller's object, wrapped by peft when LoRA is on)."""
        return self.trainer.domain.model

    @property
    def ref_model(self):
        """The KL reference: a frozen copy of the start policy (beta > 0 without peft), else None (no KL, or the
        peft base model with the adapter disabled), as TRL holds it."""
        return self.trainer.domain.reference

    @property
    def tokenizer(self):
        return self.trainer.domain.tokenizer

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus's coefficient now (TRL's ``entropy_coef``: adaptive under use_adaptive_entropy)."""
        return self.trainer.optim.entropy.coef

    @entropy_coef.setter
    def entropy_coef(self, value: float) -> None:
        self.trainer.optim.entropy.coef = float(value)

    @property
    def use_adaptive_entropy(self) -> bool:
        return self.trainer.optim.entropy.adaptive

    @use_adaptive_entropy.setter
    def use_adaptive_entropy(self, value: bool) -> None:
        if bool(value) != self.use_adaptive_entropy:
            raise ConfigError("use_adaptive_entropy is fixed for a run: set it in the GRPOConfig")

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's static helper (DeepSeek-V3.2's off-policy sequence mask, ``[B, 1]``, 1 = keep): grove's
        ``shared_rl.losses.off_policy_sequence_mask``, which ``loss.off_policy_mask`` applies in training."""
        from ..losses import off_policy_sequence_mask

        return off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                        off_policy_threshold)

    def _get_per_token_logps_and_entropies(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, **_: Any):
        """TRL's helper, for subclasses that call it: the last ``logits_to_keep`` tokens' log-probs ``[B, K]`` at
        the run's temperature and their entropies (with grad while the entropy bonus is on, as TRL's), and no
        auxiliary loss."""
        from .policy import completion_log_probs

        out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1)
        ids = input_ids[:, -logits_to_keep:]
        logp, ent = completion_log_probs(out.logits[:, :-1], ids, attention_mask[:, -logits_to_keep:].to(
            torch.float32), self.trainer.domain.cfg.temperature, compute_entropy, self._entropy_bonus_enabled)
        return logp, ent, None

    def train(self, resume_from_checkpoint: Any = None):
        """Run every iteration (evaluation, checkpoints and export as configured). A GRPOConfig run returns
        transformers' ``TrainOutput(global_step, training_loss, metrics)``; a grove-config run its metric records."""
        if resume_from_checkpoint:
            if not self.trl_mode or self.run_dir is None:
                raise ConfigError("resume_from_checkpoint needs a GRPOConfig run with an output_dir")
            if not self.trainer.resume():
                raise ConfigError(f"resume_from_checkpoint: no usable grove checkpoint under {self.run_dir}")
        if not self.trl_mode:
            return self.trainer.fit()
        from transformers.trainer_utils import TrainOutput

        self._start_time = time.time()
        self._fire("on_train_begin")
        if self._t["eval_on_start"] and self.eval_dataset is not None:
            self.evaluate()
        self.trainer.fit(resume=bool(resume_from_checkpoint))
        runtime = time.time() - self._start_time
        steps = self.state.global_step
        loss = sum(v * n for v, n in self._losses) / max(1, sum(n for _, n in self._losses))
        done = {"train_runtime": runtime, "train_samples_per_second": 0.0, "train_steps_per_second": steps / runtime,
                "total_flos": 0.0, "train_loss": loss}
        samples = steps * self.config.optim.micro_batch_size * (self.args.gradient_accumulation_steps or 1)
        done["train_samples_per_second"] = samples / runtime
        pending = {k: v for k, v in self._drain_buffer().items() if k != "loss"}  # the Trainer logs loss itself
        done.update(pending, epoch=self.state.epoch, step=steps)
        self.state.log_history.append(done)
        self._fire("on_train_end")
        return TrainOutput(steps, loss, {k: v for k, v in done.items() if k not in ("epoch", "step")})

    def _drain_buffer(self) -> dict[str, float]:
        """The mean of each metric over the iterations since the last log (NaNs skipped, as TRL), emptied."""
        keys = {k for m in self._buffer for k in m}
        logs = {}
        for k in sorted(keys):
            vals = [m[k] for m in self._buffer if k in m and not math.isnan(m[k])]
            logs[k] = sum(vals) / len(vals) if vals else math.nan
        self._buffer = []
        return logs

    def _fire(self, event: str, **kwargs) -> None:
        for cb in self.callbacks:
            cb = cb() if isinstance(cb, type) else cb
            handler = getattr(cb, event, None)
            if handler is not None:
                handler(self.args, self.state, self.control, model=self.model, processing_class=self.processing_class,
                        **kwargs)

    def _on_iteration(self, it: int, record: dict[str, Any]) -> bool:
        """After grove's iteration ``it``: advance TRL's state by the iteration's optimizer steps, log TRL's metrics
        every ``logging_steps``, evaluate, sync the reference, fire the callbacks; True asks the run to stop."""
        if not self.trl_mode:
            return False
        t = self._t
        metrics = self._recorder.drain()
        metrics.update(_trl_train_metrics(record, self.config.loss.kl_coef))
        metrics.update({k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and "/" not in k
                        and k not in ("step", "nonfinite_total", "lr", "grad_norm", "entropy", "clip_frac",
                                      "samples_per_s")})  # log_metric values (flat names) as TRL merges them
        before = self.state.global_step
        for _ in range(t["steps_per_iteration"]):
            self.state.global_step += 1
            self._fire("on_step_end")
        steps = self.state.global_step - before
        self.state.epoch = self.state.global_step / max(1, t["max_steps"]) * t["num_train_epochs"]
        if "loss" in metrics:
            self._losses.append((metrics["loss"], steps))
        self._buffer.append(metrics)
        every = t["logging_steps"]
        every = max(1, math.ceil(every * t["max_steps"])) if every < 1 else int(every)
        crossed = self.state.global_step // every > before // every
        # at logging_steps multiples (and the first step), as transformers' DefaultFlowCallback; what the last
        # steps left unlogged goes into the train summary, as TRL's log() merges its pending metrics there
        if crossed or (t["logging_first_step"] and before == 0):
            logs = {**self._drain_buffer(), "epoch": self.state.epoch, "step": self.state.global_step}
            self.state.log_history.append(logs)
            self._fire("on_log", logs=logs)
        if t["eval_every"] and (it + 1) % t["eval_every"] == 0 and self.eval_dataset is not None:
            self.evaluate()
        if t["sync_ref_model"] and t["ref_sync_every"] and (it + 1) % t["ref_sync_every"] == 0:
            self._sync_reference(t["ref_model_mixup_alpha"])
        return bool(self.control.should_training_stop)

    @torch.no_grad()
    def _sync_reference(self, alpha: float) -> None:
        """TRL's ``sync_ref_model``: reference ← α·policy + (1 − α)·reference (TR-DPO's soft update)."""
        ref = self.trainer.domain.reference
        if ref is None:
            raise ConfigError("GRPOConfig.sync_ref_model needs a reference copy: beta > 0 without peft")
        for r, p in zip(ref.parameters(), self.model.parameters()):
            r.mul_(1.0 - alpha).add_(p.detach().to(r), alpha=alpha)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"):
        """TRL's evaluation: ``num_generations_eval`` samples per eval prompt at the training temperature and
        filters, scored by the reward functions; returns ``{prefix}_reward``, ``{prefix}_rewards/<f>/mean`` ...
        and ``{prefix}_loss``, the policy loss at ratio 1 (what TRL's evaluation computes when beta is 0: the
        negative advantage, aggregated as the loss type aggregates it). A dict of eval sets gives
        ``{prefix}_{name}_...`` per set."""
        data = self.eval_dataset if eval_dataset is None else eval_dataset
        if data is None:
            raise ConfigError("evaluate() needs an eval_dataset (here or at construction)")
        if isinstance(data, Mapping) and not isinstance(data, (list, tuple)) and "prompt" not in data:
            out = {}
            for name, part in data.items():
                out.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        metrics = self._evaluate_rows(_rows_of(data, "eval_dataset"))
        out = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        if self.trl_mode:
            self.state.log_history.append({**out, "epoch": self.state.epoch, "step": self.state.global_step})
            self._fire("on_evaluate", metrics=out)
        return out

    @torch.no_grad()
    def _evaluate_rows(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        from ..advantages import ESTIMATORS, AdvantageInputs
        from .tasks import format_prompt

        domain, cfg = self.trainer.domain, self.config
        c = cfg.domain_config
        n = self._t["num_generations_eval"] if self._t else cfg.rollout.group_size
        prompts = [format_prompt(domain.tokenizer, r["prompt"], c.dataset.system_prompt, c.chat_template,
                                 c.dataset.chat_template_kwargs) for r in rows]
        domain._sync_engine()
        was_training = domain.model.training
        gen = domain.engine.generate(prompts, n, c.max_new_tokens, c.temperature,
                                     torch.Generator().manual_seed(cfg.seed + 54321))
        if was_training:
            domain.model.train()
        truncated = [not f for f in gen.finished]
        recorder = _Recorder(self.reward_weights, n)
        rewards = domain.score([rows[i] for i in gen.prompt_index], gen.completion_ids, truncated,
                               self.state.global_step if self.trl_mode else 0, {}, recorder)
        out = recorder.drain()
        groups = torch.tensor(gen.prompt_index)
        est = ESTIMATORS[cfg.advantage.estimator.name]
        adv = est(AdvantageInputs(rewards, groups, self.trainer.reward_weights), cfg.advantage).advantages.double()
        lengths = torch.tensor([len(x) for x in gen.completion_ids], dtype=torch.float64)
        agg = cfg.loss.aggregation
        if agg == "seq-mean-token-mean":
            loss = -adv[lengths > 0].mean()
        elif agg == "seq-mean-token-sum-norm":
            loss = -(adv * lengths).sum() / (len(lengths) * (cfg.loss.max_steps_norm or c.max_new_tokens))
        else:
            loss = -(adv * lengths).sum() / lengths.sum().clamp(min=1)
        out["loss"] = float(loss)
        return out

    def save_model(self, output_dir: str | Path | None = None) -> Path:
        """Write the policy (the adapter with peft) and its tokenizer with ``save_pretrained``, as TRL does."""
        where = Path(output_dir or (self.args.output_dir if self.trl_mode else None) or self._tmpdir())
        self.trainer.domain.save_pretrained(where)
        return where

    def log_metrics(self, split: str, metrics: dict) -> None:
        self.log(f"***** {split} metrics *****\n" + "\n".join(f"  {k} = {v}" for k, v in metrics.items()))

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback)


class _HookedTrainer(Trainer):
    """grove's trainer with one hook after each iteration (the TRL surface's logging, evaluation and callbacks)."""

    def __init__(self, cfg, run_dir=None, log=print, objects=None, on_iteration=None, fused_adamw=False) -> None:
        super().__init__(cfg, run_dir, log=log, objects=objects)
        self.on_iteration = on_iteration
        self.fused_adamw = fused_adamw and self.fsdp is None   # (sharded DTensor parameters: the per-tensor loop)
        self._set_fused()

    def _set_fused(self) -> None:
        """TRL's ``optim="adamw_torch_fused"`` (transformers' default): the same AdamW update as one fused kernel per
        step (float rounding apart). A group option read at each step, so it is set again after a resume (the
        checkpoint's groups replace these)."""
        if self.fused_adamw:
            for group in self.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False

    def resume(self, checkpoints=None, exact: bool = True) -> bool:
        restored = super().resume(checkpoints, exact)
        self._set_fused()
        return restored

    def _run_one(self, it: int, logger, bar) -> bool:
        stop = super()._run_one(it, logger, bar)
        if self.on_iteration is not None and len(self.history) and self.history[-1].get("step") == it + 1:
            stop = bool(self.on_iteration(it, self.history[-1])) or stop
        return stop
