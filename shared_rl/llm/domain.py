"""The LLM domain: any ``AutoModelForCausalLM`` (optionally LoRA) trained on verifiable rewards.

One sequence of the ``Rollout`` is one completion (flat GRPO) or one tree edge (a token segment; TreePO /
TreeRL); its steps are completion tokens: ``logp_old[N, max_new_tokens]`` with ``mask`` = the tokens the
sequence owns. The payload keeps token ids and the padding layout, so ``log_probs`` recomputes the behaviour
log-probs bitwise on CPU (ratio exactly 1 before the first update), or the trainer takes them from its first loss
forward (``behaviour_logprobs: deferred``). The method (GRPO, Dr. GRPO, DAPO, GSPO, RLOO,
MC-GRPO, tree estimators) is chosen entirely by the trainer's config sections.
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..config import ConfigError
from ..domain import DomainBase, RunContext, StepLogProbs
from ..rewards import guarded_reward
from ..sharding import loads_on_meta
from ..rollout import Rollout
from .engine import RolloutEngine, TorchRolloutEngine
from .fast_train import fast_token_log_probs
from .model import load_causal_lm, load_tokenizer, prepare_causal_lm
from .policy import collate, collate_shared, reference_context, token_log_probs, token_log_probs_shared
from .rewards import build_reward, call_reward
from .tasks import load_task, prompt_token_ids
from .tree import grow_trees
from .config import LLMConfig, LLMEvalSettings, _context_length  # noqa: F401  (shared_rl.llm.domain.LLMConfig, as before)


def _pad_steps(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], 1)


class LLMDomain(DomainBase):
    """Causal-LM policy + text task + verifiable rewards, as the trainer's ``Domain``."""

    config_class = LLMConfig

    def __init__(self, cfg: LLMConfig, ctx: RunContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        train_loss = getattr(ctx.train_cfg, "loss", None)
        self._entropy_grad = bool(train_loss is not None and train_loss.entropy.enabled)
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.device = ctx.device
        held_model, held_tok = ctx.objects.get("model"), ctx.objects.get("tokenizer")  # shared_rl.llm.api
        self.tokenizer = held_tok if held_tok is not None else load_tokenizer(cfg.tokenizer or cfg.model)
        if held_model is not None:
            self.model = prepare_causal_lm(held_model, self.device, cfg.lora, cfg.gradient_checkpointing, cfg.model,
                                           cfg.lm_head_fp32)
        else:
            # under fsdp2 with several processes only process 0 reads the weights; the others build on the meta
            # device and receive their shards from it in the trainer's setup_fsdp (the reference copy's too: a
            # deepcopy of a meta model is a meta model, sharded as its own roots by fsdp_modules)
            self.model = load_causal_lm(cfg.model, cfg.dtype, self.device, cfg.lora, cfg.gradient_checkpointing,
                                        cfg.lm_head_fp32, meta=loads_on_meta(ctx))
        self.reference = None
        self._reference_units: list[torch.nn.Module] = []  # FSDP2: the reference's units (fsdp_modules)
        if cfg.keep_reference and not cfg.lora.enabled:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # EOS ids: the tokenizer's plus the model's generation config's (chat models end turns with their own)
        eos = [self.tokenizer.eos_token_id]
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if gen_eos is not None:
            eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = sorted({e for e in eos if e is not None})
        self.engine: RolloutEngine = self._make_engine()
        self._fast_train = self._use_fast_train()
        self.task = load_task(cfg.dataset)
        limit, why = cfg.prompt_limit(_context_length(self.model.config))
        # every prompt tokenised once, here: checked against the limit (hf sources are first seen here) and cached
        self._prompt_cache, cut = prompt_token_ids(self.task, self.tokenizer, cfg.dataset, cfg.chat_template, limit,
                                                   why)
        if cut:
            ctx.log(f"llm: {cut} prompts longer than {limit} tokens ({why}) are cut to their last {limit} tokens "
                    f"(llm.dataset.long_prompts: truncate)")
        self.rewards = [(build_reward(spec), spec.weight) for spec in cfg.rewards]
        self._guarded_calls = {
            label: guarded_reward(lambda *a, _label=label, _fn=fn: {_label: call_reward(_fn, _label, *a)}, label,
                                  cfg.reward_guard, lambda prompts, completions, *_: len(completions), log=ctx.log)
            for (label, fn), _w in self.rewards}
        self._sharded = False  # set by fsdp_modules(): the trainer shards the model with FSDP2
        self._weights_stepped = False  # an optimizer step since the engine's last snapshot (after_optimizer_step)
        ctx.log(f"llm: {cfg.model} ({sum(p.numel() for p in self.model.parameters()):,} params, "
                f"{sum(p.numel() for p in self.parameters()):,} trainable) | task {cfg.dataset.source}: "
                f"{len(self.task.train)} train / {len(self.task.eval)} eval prompts")

    def _use_fast_train(self) -> bool:
        """``llm.train_forward``: whether the loss log-probs come from ``fast_train`` (checked on the model)."""
        if self.cfg.train_forward == "hf":
            return False
        from .fast_train import unsupported_reason

        reason = unsupported_reason(self.model)
        if reason is None and self.reference is not None:
            reason = unsupported_reason(self.reference)
        if reason is None and self.cfg.train_forward == "auto" and self.device.type != "cpu":
            # its SDPA branch (accelerators) has had no run against the HF forward yet; fast still selects it
            reason = "measured and tested on the CPU only (set llm.train_forward: fast to use it here)"
        if reason is None:
            return True
        if self.cfg.train_forward == "fast":
            raise ConfigError(f"llm.train_forward: fast cannot run {self.cfg.model}: {reason}; use train_forward: hf "
                              f"(or auto)")
        self.ctx.log(f"llm: train_forward auto -> hf ({reason})")
        return False

    def _make_engine(self) -> RolloutEngine:
        filters = self.cfg.sampling_filters()
        if self.cfg.engine in ("fast", "auto"):
            from .fast_llama import FastLlamaEngine, unsupported_reason

            reason = unsupported_reason(self.model)
            if reason is None:
                engine = FastLlamaEngine(self.model, self.tokenizer.pad_token_id, self.eos_ids,
                                         self.cfg.engine_batch_rows)
                engine.sampling = filters
                return engine
            if self.cfg.engine == "fast":
                raise ConfigError(f"llm.engine: fast cannot run {self.cfg.model}: {reason}; use engine: torch (or auto)")
            self.ctx.log(f"llm: engine auto -> torch ({reason})")
        if self.cfg.engine in ("torch", "auto"):
            return TorchRolloutEngine(self.model, self.tokenizer.pad_token_id, self.eos_ids, self.cfg.engine_batch_rows,
                                      filters)
        from ..registry import import_object

        cls = import_object(self.cfg.engine, "llm.engine")
        engine = cls(model=self.model, tokenizer=self.tokenizer, config=self.cfg)
        if filters.active and not hasattr(engine, "sampling"):  # its own sampler would not apply them: say so
            raise ConfigError(f"llm.engine {self.cfg.engine} has no 'sampling' attribute, so llm.top_p / top_k / "
                              f"min_p / repetition_penalty cannot reach it; use engine torch or fast, or drop them")
        if hasattr(engine, "sampling"):
            engine.sampling = filters
        return engine

    # ---- prompts and rewards ---------------------------------------------------------------------------------
    def _examples(self, split: str) -> list[dict[str, Any]]:
        return self.task.train if split == "train" else self.task.eval

    def _prompt_ids(self, split: str, key: int) -> list[int]:
        return self._prompt_cache[(split, key)]  # tokenised once at start (prompt_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, examples: list[dict[str, Any]], completion_ids: list[list[int]], truncated: list[bool],
              iteration: int, info: dict[str, float] | None = None, on_scores=None) -> dict[str, torch.Tensor]:
        """Rewards of completions, TRL-style: one call per reward function over the whole batch. ``on_scores``
        (optional) receives the raw values per label, the truncation flags and the completion ids (``shared_rl.llm.api`` logs TRL's
        metrics from them); the ``trainer_state`` and ``log_extra`` the functions see are ``ctx.objects``' when the
        caller holds them (the TRL-shaped trainer's ``state`` and completions table), else the iteration and a no-op."""
        texts = [self._decode(c) for c in completion_ids]
        prompts = [ex["prompt"] for ex in examples]
        conversational = bool(prompts) and isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [ex.get(k) for ex in examples] for k in examples[0] if k != "prompt"} if examples else {}
        info = info if info is not None else {}

        def log_metric(name: str, value: float) -> None:
            info[name] = float(value)

        state = self.ctx.objects.get("trainer_state") or SimpleNamespace(global_step=iteration, epoch=0.0)
        extras = {"trainer_state": state,
                  "log_metric": log_metric, "log_extra": self.ctx.objects.get("log_extra") or (lambda *a, **k: None),
                  "max_completion_length": self.cfg.max_new_tokens, "truncated": truncated}
        out = {}
        for label, call in self._guarded_calls.items():
            out[label] = call(prompts, completions, completion_ids, columns, extras)[label]
        if on_scores is not None:  # the raw values (None as NaN), before none_rewards combines them
            on_scores(out, truncated, completion_ids)
        if self.cfg.none_rewards == "zero_unless_all" and len(out) > 1:
            # TRL sums the functions with nansum: a None term is 0 unless no function scored the sample
            scored = torch.stack([torch.isfinite(r) for r in out.values()]).any(0)
            out = {k: torch.where(scored & ~torch.isfinite(r), torch.zeros_like(r), r) for k, r in out.items()}
        return out

    # ---- log-probs -------------------------------------------------------------------------------------------
    def _token_logp(self, module, prompt_ids, completion_ids, layout, with_entropy: bool = False):
        """The one log-prob function of this domain (training, behaviour recompute, deferred fill, reference):
        the padding layout ``layout``, one-pass or prefix-shared (``share_prompt_forward``). The entropy carries
        grad when the trainer's loss has an entropy bonus (``loss.entropy``)."""
        pad = self.tokenizer.pad_token_id
        grad = self._entropy_grad and module is self.model
        if self._fast_train:
            batch = collate_shared(prompt_ids, completion_ids, layout, pad, self.device)
            return fast_token_log_probs(module, batch, self.cfg.temperature, with_entropy, grad)
        if self.cfg.share_prompt_forward:
            batch = collate_shared(prompt_ids, completion_ids, layout, pad, self.device)
            return token_log_probs_shared(module, batch, self.cfg.temperature, with_entropy, grad)
        return token_log_probs(module, collate(prompt_ids, completion_ids, layout, pad, self.device),
                               self.cfg.temperature, with_entropy, grad)

    def _forward_logp(self, prompt_ids, completion_ids, layout, grad: bool, with_entropy: bool = False):
        with torch.set_grad_enabled(grad):
            return self._token_logp(self.model, prompt_ids, completion_ids, layout, with_entropy)

    @torch.no_grad()
    def _behaviour_logp(self, prompt_ids: list[torch.Tensor], completion_ids: list[torch.Tensor],
                        layout: torch.Tensor) -> torch.Tensor:
        """Behaviour log-probs in the training layout (same function, no grad), so ratios start at exactly 1."""
        was_training = self.model.training
        if was_training:
            self.model.eval()  # dropout (e.g. LoRA dropout) off for the behaviour policy
        parts = []
        bs = self.cfg.logprob_batch_size
        try:
            for s in range(0, len(prompt_ids), bs):
                lp, _ = self._forward_logp(prompt_ids[s:s + bs], completion_ids[s:s + bs], layout[s:s + bs], False)
                parts.append(_pad_steps(lp.float().cpu(), self.cfg.max_new_tokens))
        finally:
            if was_training:
                self.model.train()
        return torch.cat(parts)

    def _engine_logp(self, segments: list[tuple[int, list[float]]]) -> torch.Tensor:
        """``logp_old`` from the sampler's log-probs: row i holds ``segments[i][1]`` from position ``segments[i][0]``."""
        out = torch.zeros((len(segments), self.cfg.max_new_tokens))
        for i, (start, lps) in enumerate(segments):
            if len(lps) != 0:
                out[i, start:start + len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return out

    @staticmethod
    def _deferred_logp(mask: torch.Tensor) -> torch.Tensor:
        """NaN placeholders on the trained tokens (marked in ``Rollout.logp_deferred``: the trainer fills them from
        its first forward), 0 elsewhere, so sequences without trained tokens (tree roots) never ask for a forward."""
        return torch.where(mask, torch.full(mask.shape, math.nan), torch.zeros(mask.shape))

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool) -> StepLogProbs:
        p = rollout.index_payload(idx)
        if not self.model.training:  # .train() walks every module; skip it when nothing changes
            self.model.train()
        # with grad unless the caller turned it off (the trainer's up-front fill of deferred behaviour log-probs)
        logp, ent = self._forward_logp(p["prompt_ids"], p["completion_ids"], p["layout"], torch.is_grad_enabled(),
                                       with_entropy=True)
        width = self.cfg.max_new_tokens
        ref = None
        nfe = len(idx)
        kl = None
        logp = _pad_steps(logp.float(), width)
        if need_kl:
            module, context = reference_context(self.model, self.reference)
            with torch.no_grad(), context:
                ref, _ = self._token_logp(module, p["prompt_ids"], p["completion_ids"], p["layout"])
            self._reshard_reference()
            ref = _pad_steps(ref.float(), width)
            nfe += len(idx)
            if self.cfg.kl_ratio_correction != "off":
                kl = self._ratio_corrected_k3(logp, ref, rollout.logp_old[idx].to(logp), rollout.mask[idx].to(logp))
        return StepLogProbs(logp=logp, ref_logp=ref, kl=kl,
                            entropy=_pad_steps(ent.float(), width) if ent is not None else None, nfe=nfe)

    def _ratio_corrected_k3(self, logp: torch.Tensor, ref: torch.Tensor, logp_old: torch.Tensor,
                            mask: torch.Tensor) -> torch.Tensor:
        """TRL's KL term with ``use_bias_correction_kl``: k3 = exp(ref − logp) − (ref − logp) − 1 per token (Schulman's
        estimator), times the importance ratio exp(logp − logp_old) of the token (``token``) or of the sequence's mean
        log-ratio (``sequence``), the ratio keeping its gradient. The samples come from the behaviour policy, so the
        ratio makes the estimate one of KL(current || reference)."""
        k3 = torch.exp(ref - logp) - (ref - logp) - 1.0
        log_ratio = (logp - logp_old) * mask
        if self.cfg.kl_ratio_correction == "sequence":
            log_ratio = (log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(logp)
        return k3 * torch.exp(log_ratio) * mask

    # ---- rollouts --------------------------------------------------------------------------------------------
    def train_keys(self) -> range:
        # a range (a read-only Sequence): built per iteration, a list of a 20k-prompt pool cost ~0.2 ms per step
        return range(len(self.task.train))

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        self._sync_engine()
        prompts = [self._prompt_ids("train", k) for k in keys]
        if self.cfg.tree.enabled:
            return self._tree_rollout(keys, prompts, generator, iteration)
        gen = self.engine.generate(prompts, group_size, self.cfg.max_new_tokens, self.cfg.temperature, generator)
        n = len(gen.completion_ids)
        prompt_rows = [torch.tensor(prompts[i], dtype=torch.long) for i in gen.prompt_index]
        completion_rows = [torch.tensor(c, dtype=torch.long) for c in gen.completion_ids]
        t_width = max([len(c) for c in gen.completion_ids] + [1])
        layout = torch.tensor([[max(len(p) for p in prompts), t_width]] * n, dtype=torch.long)
        truncated = [not f for f in gen.finished]
        info: dict[str, float] = {}
        t0 = time.perf_counter()
        rewards = self.score([self.task.train[keys[i]] for i in gen.prompt_index], gen.completion_ids, truncated,
                             iteration, info, self.ctx.objects.get("on_train_scores"))
        info["time/reward"] = time.perf_counter() - t0
        lengths = torch.tensor([len(c) for c in gen.completion_ids], dtype=torch.long)
        mask = torch.arange(self.cfg.max_new_tokens)[None] < lengths[:, None]
        trained_mask = mask
        if self.cfg.mask_truncated:  # no loss on (and no normaliser count for) completions cut by the length cap
            trained_mask = mask & ~torch.tensor(truncated, dtype=torch.bool)[:, None]
        if self.cfg.behaviour_logprobs == "engine":
            logp_old = self._engine_logp([(0, lp) for lp in gen.sample_logprobs])
        elif self.cfg.behaviour_logprobs == "deferred":
            logp_old = self._deferred_logp(mask)
        else:
            logp_old = self._behaviour_logp(prompt_rows, completion_rows, layout)
        info.update({"completion/tokens": float(mask.sum()), "completion/count": float(n),
                     "completion/truncated": float(sum(truncated))})
        return Rollout(keys=list(keys), group_ids=torch.tensor(gen.prompt_index, dtype=torch.long), rewards=rewards,
                       logp_old=logp_old, mask=trained_mask,
                       payload={"prompt_ids": prompt_rows, "completion_ids": completion_rows, "layout": layout},
                       nfe=gen.nfe + (n if self.cfg.behaviour_logprobs == "recompute" else 0), info=info,
                       logp_deferred=trained_mask.clone() if self.cfg.behaviour_logprobs == "deferred" else None)

    def _tree_rollout(self, keys, prompts, generator, iteration) -> Rollout:
        c = self.cfg
        tree = grow_trees(self.engine, prompts, c.tree, c.max_new_tokens, c.temperature, generator)
        n = len(tree)
        leaves = tree.is_leaf
        prompt_rows = [torch.tensor(prompts[g], dtype=torch.long) for g in tree.group]
        completion_rows = [torch.tensor(p, dtype=torch.long) for p in tree.path]
        t_width = max([len(p) for p in tree.path] + [1])
        layout = torch.tensor([[max(len(p) for p in prompts), t_width]] * n, dtype=torch.long)
        leaf_idx = [i for i in range(n) if leaves[i]]
        info: dict[str, float] = {}
        t0 = time.perf_counter()
        leaf_rewards = self.score([self.task.train[keys[tree.group[i]]] for i in leaf_idx],
                                  [tree.path[i] for i in leaf_idx], [not tree.finished[i] for i in leaf_idx],
                                  iteration, info)
        info["time/reward"] = time.perf_counter() - t0
        rewards = {}
        for name, r in leaf_rewards.items():
            full = torch.full((n,), math.nan)
            full[torch.tensor(leaf_idx, dtype=torch.long)] = r
            rewards[name] = full
        mask = torch.zeros((n, c.max_new_tokens), dtype=torch.bool)
        for i in range(n):
            mask[i, tree.start[i]:len(tree.path[i])] = True
        if c.behaviour_logprobs == "engine":
            logp_old = self._engine_logp(list(zip(tree.start, tree.segment_logprobs)))
        elif c.behaviour_logprobs == "deferred":
            logp_old = self._deferred_logp(mask)
        else:
            logp_old = self._behaviour_logp(prompt_rows, completion_rows, layout)
        info.update({"completion/tokens": float(tree.generated_tokens), "completion/count": float(len(leaf_idx)),
                     "completion/truncated": float(sum(not tree.finished[i] for i in leaf_idx)),
                     "tree/nodes": float(n)})
        return Rollout(keys=list(keys), group_ids=torch.tensor(tree.group, dtype=torch.long), rewards=rewards,
                       logp_old=logp_old, mask=mask, parent=torch.tensor(tree.parent, dtype=torch.long),
                       payload={"prompt_ids": prompt_rows, "completion_ids": completion_rows, "layout": layout},
                       nfe=tree.nfe + (n if c.behaviour_logprobs == "recompute" else 0), info=info,
                       logp_deferred=mask.clone() if c.behaviour_logprobs == "deferred" else None)

    # ---- evaluation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_text(self, split: str, keys: list[int], temperature: float, generator: torch.Generator | None = None,
                      what: str = ""):
        """Completions for prompts ``keys`` of ``split``: (completion ids, finished flags); a slow one reports its
        progress as ``what`` (``shared_rl.metrics.Progress``)."""
        from ..metrics import Progress

        gen_ids, finished = [], []
        generator = generator or torch.Generator().manual_seed(0)
        bs = self.cfg.eval.batch_size
        progress = Progress(self.ctx.log, what or f"generating ({split})", len(keys), "prompts")
        for s in range(0, len(keys), bs):
            prompts = [self._prompt_ids(split, k) for k in keys[s:s + bs]]
            g = self.engine.generate(prompts, 1, self.cfg.max_new_tokens, temperature, generator)
            gen_ids += g.completion_ids
            finished += g.finished
            progress.update(len(gen_ids))
        return gen_ids, finished

    def evaluate(self, iteration: int) -> dict[str, float]:
        self._sync_engine()
        keys = list(range(min(self.cfg.eval.num_prompts, len(self.task.eval))))
        if not keys:
            return {}
        examples = [self.task.eval[k] for k in keys]
        acc_name = self.cfg.eval.accuracy_reward or self.rewards[0][0][0]
        out: dict[str, float] = {}
        modes = [("", 0.0)] + ([("sampled_", self.cfg.temperature)] if self.cfg.eval.sampled else [])
        for prefix, temp in modes:
            # a fixed generator: every evaluation of a run samples with the same noise, so curves compare policies
            ids, finished = self.generate_text("eval", keys, temp, torch.Generator().manual_seed(self.ctx.seed + 12345),
                                               f"evaluation ({'greedy' if not prefix else 'sampled'})")
            rewards = self.score(examples, ids, [not f for f in finished], iteration)
            if acc_name not in rewards:
                raise ConfigError(f"llm.eval.accuracy_reward {acc_name!r} is not a reward label ({sorted(rewards)})")
            total = sum(w * rewards[label] for (label, _), w in self.rewards)
            out[f"eval/{prefix}accuracy"] = float(torch.nan_to_num(rewards[acc_name]).mean())
            out[f"eval/{prefix}reward"] = float(torch.nan_to_num(total).mean())
            if not prefix:
                out["eval/mean_length"] = sum(len(x) for x in ids) / len(ids)
                self._last_samples = [(ex["prompt"], self._decode(c), ex.get("answer"))
                                      for ex, c in zip(examples[:self.cfg.eval.num_samples_logged], ids)]
        return out

    # ---- FSDP2 -----------------------------------------------------------------------------------------------------
    def after_optimizer_step(self) -> None:
        # a fused optimizer kernel (AdamW fused=True) writes the weights without bumping the version counters the
        # fast engine's snapshot check reads, so the next rollout re-takes the snapshot on this flag instead
        self._weights_stepped = True

    def _sync_engine(self) -> None:
        if (self._sharded or getattr(self, "_weights_stepped", False)) and hasattr(self.engine, "_fingerprint"):
            # FSDP2 re-gathers the weights into reused buffers for every rollout round; rather than trust the
            # version counters of those buffers (or of weights a fused kernel updated) to flag an update, re-take
            # the snapshot (once per round)
            self.engine.sync_weights(force=True)
        else:
            self.engine.sync_weights()
        self._weights_stepped = False

    def fsdp_modules(self) -> list[torch.nn.Module]:
        """FSDP2 units (``distributed.strategy: fsdp2``): every decoder layer (the classes the transformers model
        lists in ``_no_split_modules``; with LoRA the adapters inside a layer are sharded with it), then the
        transformers model itself as the root (embeddings, final norm, output layer). With full fine-tuning the
        frozen KL reference copy (``llm.keep_reference``) is sharded the same way, as roots of its own on the same
        mesh, so no process holds a whole second model: its forward (no grad, ``log_probs``) all-gathers each layer
        and frees it after (``reshard`` after the forward whatever ``distributed.reshard_after_forward`` says)."""
        if self.cfg.share_prompt_forward:
            raise ConfigError("llm.share_prompt_forward runs a data-dependent number of forwards per micro-batch "
                              "(one when every prompt is one token), which FSDP2's per-forward collectives cannot "
                              "pair up across processes; set llm.share_prompt_forward: false with fsdp2")
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        units = self._units(base, "")
        if self.reference is not None:  # full fine-tuning's KL reference: sharded too, never whole per process
            self._reference_units = self._units(self.reference, "the reference copy of ")
            units += self._reference_units
        self._sharded = True
        if self._fast_train:  # FSDP2 gathers a unit's weights in its module's own forward, which fast_train bypasses
            self.ctx.log("llm: train_forward -> hf (distributed.strategy fsdp2 shards the modules)")
            self._fast_train = False
        return units

    def fsdp_sampling_modules(self) -> list[torch.nn.Module]:
        """The policy alone (with LoRA its adapter-off KL reference is the same modules): the rollout engine and
        evaluation sample from ``self.model``; the full-fine-tuning reference copy runs only in ``log_probs`` with
        KL (paired training forwards), so ``gathered()`` leaves it sharded."""
        return [self.model]

    def _reshard_reference(self) -> None:
        """FSDP2: free the reference copy's gathered layers after its forward (no backward reshards a frozen copy;
        a no-op under ``reshard_after_forward: true``, which already did, and with one process: nothing sharded)."""
        from torch.distributed.fsdp import FSDPModule

        for unit in self._reference_units:
            if isinstance(unit, FSDPModule):
                unit.reshard()

    def _units(self, model: torch.nn.Module, where: str) -> list[torch.nn.Module]:
        """``model``'s decoder layers (its ``_no_split_modules`` classes), then ``model`` itself."""
        names = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if not blocks:
            raise ConfigError(f"llm: cannot find the decoder layers of {where}{self.cfg.model} for FSDP2 "
                              f"(_no_split_modules={sorted(names)}); use distributed.strategy: replicate")
        return blocks + [model]

    # ---- parameters and export -------------------------------------------------------------------------------
    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        missing = [n for n in state if n not in params]
        if missing:
            raise KeyError(f"checkpoint has weights this model lacks: {missing[:5]}")
        with torch.no_grad():
            for n, v in state.items():
                params[n].copy_(v)

    def save_pretrained(self, out_dir: Path) -> None:
        state = None
        if self._sharded:  # called on every process: gather (collective), then write on the first one
            state = self._full_state_for_export()
            if self.ctx.process_index != 0:
                return
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if state is None:
            self.model.save_pretrained(out_dir)
        else:
            self.model.save_pretrained(out_dir, state_dict=state)
        self.tokenizer.save_pretrained(out_dir)

    def _full_state_for_export(self) -> dict[str, torch.Tensor]:
        """Full CPU tensors of what ``save_pretrained`` writes: the adapter with LoRA (trainable parameters, keys as
        in ``model.state_dict()``), else the whole model (``get_model_state_dict``: gathered to rank 0's CPU)."""
        from ..distributed import full_tensors

        if getattr(self.model, "peft_config", None):
            return full_tensors({n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad})
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def on_train_end(self, run_dir: Path | None, history: list[dict[str, float]]) -> None:
        samples = getattr(self, "_last_samples", None)
        if run_dir is None or not samples:
            return
        lines = [f"{p!r} -> {c!r} (answer {a!r})" for p, c, a in samples]
        (Path(run_dir) / "samples.txt").write_text("\n".join(lines) + "\n")
