"""One rollout call of any visgen method, and the recomputation of its log-probs: the glue between the trainer's
``Domain`` contract and the engine.

``rollout``: encode the prompts → the method grows its forest on the engine (``visgen.engine``) → decode the
leaves → score them → the method's after-rewards hook (pruning) → a ``shared_rl.rollout.Rollout`` whose
sequences are the leaf chains (flat methods) or every node's edge with the parent array (tree methods).
``log_probs``: ``visgen.recompute.recompute_edges`` on the rows asked for. ``VisgenDomain`` owns one of these, built
by :meth:`VisgenRollouts.from_config` from its config; tests build one around a tiny pipeline and a toy reward.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager

import torch

from shared_rl.domain import StepLogProbs
from shared_rl.rollout import Rollout
from shared_rl.two_stage import kept_agreement, select_candidates, spearman

from .engine import flat_forest, forest_payload
from .methods import Grown, KernelSettings, RolloutMethod
from .objectives import LogProbObjective, Objective
from .pipelines import Conditioning
from .recompute import recompute_edges

__all__ = ["VisgenRollouts"]


class VisgenRollouts:
    """Rollouts of ``method`` for prompts ``prompts[key]`` scored by ``score(images, prompts, metas) -> {name: [N]}``.

    ``reference``: a context-manager factory under which the adapter computes the reference velocity (the LoRA
    adapter switched off), used for the KL when ``log_probs(..., need_kl=True)``. ``old``: the same for the old
    policy's weights (DiffusionNFT). ``two_stage``: ``(TwoStageSettings, LowPrecisionExplorer)`` for Sol-RL
    rollouts. ``score_chunks`` / ``overlap_rewards``: overlapped scoring (``_chunked_rollout`` at the end of this
    module).
    """

    def __init__(self, adapter, method: RolloutMethod, kernel: KernelSettings, prompts: list[str], metas: list[dict],
                 score: Callable[..., dict[str, torch.Tensor]], num_inference_steps: int, guidance_scale: float = 1.0,
                 sample_kwargs: dict[str, Any] | None = None, reference: Callable[[], ContextManager] | None = None,
                 kl_type: str = "mean", objective: Objective | None = None,
                 old: Callable[[], ContextManager] | None = None, *, two_stage: tuple[Any, Any] | None = None,
                 score_chunks: int = 1, overlap_rewards: bool = False, granular_outputs: list[str] | None = None
                 ) -> None:
        self.adapter, self.method, self.kernel = adapter, method, kernel
        self.prompts, self.metas, self.score = prompts, metas, score
        self.num_inference_steps, self.guidance_scale = num_inference_steps, guidance_scale
        self.sample_kwargs = dict(sample_kwargs or {})
        self.reference, self.kl_type = reference, kl_type
        self.objective = objective or LogProbObjective(None)
        self.old = old
        self.two_stage = two_stage
        self.score_chunks, self.overlap_rewards = score_chunks, overlap_rewards
        # outputs scored again at coarse granularities (E-GRPO); None: every output the score function returns
        self.granular_outputs = None if granular_outputs is None else list(granular_outputs)
        self.epoch = 0  # the trainer's inner epoch (set by the domain; NFT draws fresh noise per epoch)
        # FSDP2 (set by visgen.fsdp): agrees each log_probs call's transformer forwards with the other processes
        self.forward_pad = None
        # the trained reward outputs and their advantage weights, for an objective that selects the rows that train
        # from the rewards (DPO's pairs; set by the domain); None: every leaf trains
        self.reward_weights: dict[str, float] | None = None
        # the trained reward with the graph to the images, ``(images, prompts, metas) -> [n]`` (DiffusionOPSD; set by
        # the domain)
        self.grad_reward: Callable[..., torch.Tensor] | None = None
        self._cond_meta: dict[str, Any] | None = None
        self._next_forward = 0  # forward ids stay unique across rollout calls (refills concatenate payloads)

    @classmethod
    def from_config(cls, cfg, adapter, policy, method: RolloutMethod, objective: Objective, prompts: list[str],
                    metas: list[dict], score: Callable[..., dict[str, torch.Tensor]],
                    sample_kwargs: dict[str, Any], granular_outputs: list[str] | None = None) -> "VisgenRollouts":
        """The rollouts a ``VisgenConfig`` ``cfg`` describes, around the domain's pipeline ``adapter``, its
        ``policy`` (``visgen.policy.FlowPolicy``: the KL reference, and the old weights once the objective enabled
        them), the configured ``method`` and ``objective``, the training prompts and the reward call: the kernel
        and its noise level, the step count and guidance, the KL type, the Sol-RL explorer and score chunking all
        come from ``cfg`` here; ``granular_outputs``: the trained reward outputs a multi-granularity method
        (E-GRPO) scores again (``VisgenConfig.granular_base_outputs``; None: all)."""
        two_stage = None
        if cfg.two_stage.enabled:  # Sol-RL: the explorer copy, re-synced from the live weights every rollout call
            from .lowprec import LowPrecisionExplorer

            two_stage = (cfg.two_stage, LowPrecisionExplorer(adapter.pipe, cfg.two_stage.precision))
        return cls(adapter, method, cfg.kernel_settings(), prompts, metas, score, cfg.num_inference_steps,
                   cfg.guidance_scale, sample_kwargs, reference=policy.reference, kl_type=cfg.kl_type,
                   objective=objective, old=policy.old_weights if policy.old is not None else None,
                   two_stage=two_stage, score_chunks=cfg.score_chunks, overlap_rewards=cfg.overlap_rewards,
                   granular_outputs=granular_outputs)

    @torch.no_grad()
    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        """Grow the configured method's forest for prompts ``keys`` (one batched forward per level and step),
        decode and score its leaves, let the method prune, and return the trainable edges as a ``Rollout``: the
        leaf chains for flat methods, every node (parents, rewards on leaves) for tree methods. With
        ``score_chunks > 1`` the keys are sampled in sub-chunks, each scored (in a worker thread when
        ``overlap_rewards``) while the next one samples."""
        if self.score_chunks > 1 and len(keys) > 1:
            return _chunked_rollout(self, list(keys), group_size, generator, iteration)
        steps = self._rollout_steps(keys, group_size, generator, iteration)
        return _resume(steps, self.score(*next(steps)))

    @torch.no_grad()
    def _rollout_steps(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int):
        """``rollout`` as a generator: sample and decode, yield ``(images, prompts, metas)`` once, receive their
        scores, finish and return the ``Rollout`` (so a caller can score while the next chunk samples)."""
        method = self.method
        t0 = time.perf_counter()
        cond = self.adapter.encode_prompts([self.prompts[k] for k in keys], num_images_per_prompt=1,
                                           guidance_scale=self.guidance_scale, **self.sample_kwargs)
        sigmas, timesteps = self.adapter.schedule(self.num_inference_steps, cond)
        # DiffusionNFT samples with the old policy's weights (swapped in for the whole no-grad rollout)
        with self.old() if self.objective.samples_with_old else contextlib.nullcontext():
            if self.two_stage is not None:
                grown = self._two_stage(cond, list(keys), group_size, sigmas, timesteps, generator, iteration)
            else:
                grown = method.grow(self.adapter, cond, list(keys), group_size, sigmas, timesteps, generator,
                                    iteration, self.kernel, self._next_forward)
        forest, tree = grown.forest, grown.forest.tree
        self._next_forward += forest.forwards + 1
        leaves = forest.leaves()
        leaf_root = tree.group[leaves]
        x = forest.node_latent[leaves.to(forest.node_latent.device)]
        size = self.kernel.micro_batch or x.shape[0]
        strides = sorted(grown.granular_latents)
        # the leaves' images, then (E-GRPO) the same leaves by each coarser ODE tail: one scoring call for all
        x = torch.cat([x] + [grown.granular_latents[g].to(x) for g in strides])
        root_of = leaf_root.repeat(1 + len(strides))
        images = torch.cat([self.adapter.decode(x[i:i + size], grown.root_cond[root_of[i:i + size]])
                            for i in range(0, x.shape[0], size)])
        t1 = time.perf_counter()
        leaf_keys = [grown.group_keys[g] for g in grown.root_group[leaf_root].tolist()] * (1 + len(strides))
        scores = yield images, [self.prompts[k] for k in leaf_keys], [self.metas[k] for k in leaf_keys]
        n_leaves = int(leaves.numel())
        for name, value in scores.items():
            value = torch.as_tensor(value).float().reshape(-1)
            tree.set_leaf_rewards(name, leaves, value[:n_leaves])
            if self.granular_outputs is None or name in self.granular_outputs:
                for j, g in enumerate(strides, start=1):
                    tree.set_leaf_rewards(f"{name}@g{g}", leaves, value[j * n_leaves:(j + 1) * n_leaves])
        t2 = time.perf_counter()
        info = {**grown.info, **method.after_rewards(forest, tree.rewards, iteration)}
        if self.two_stage is not None:  # how well the explorer's ranking of the kept seeds survives full precision
            fp = scores[self._kept_reward].reshape(self._kept_explore.shape)
            info["two_stage/rank_spearman"] = spearman(self._kept_explore, fp)
            info["two_stage/kept_agreement"] = kept_agreement(self._kept_explore, fp)
        c = grown.root_cond
        self._cond_meta = {"guidance_scale": c.guidance_scale, "do_cfg": c.do_cfg, "height": c.height,
                           "width": c.width, "shared": c.shared, "options": c.options}
        mask = forest.train & tree.trainable[:, None] & forest.sde
        flat = method.structure == "flat"
        rows = leaves if flat else torch.arange(len(tree))
        node_cond = {k: v[tree.group[rows].to(v.device)] for k, v in c.tensors.items()}
        payload = forest_payload(forest, node_cond, rows)
        logp_old = forest.logp[rows].clone()
        deferred = None
        if self.objective.likelihood_free:  # NFT / AWM / DGPO: each leaf's clean sample at drawn grid timesteps
            is_leaf = torch.zeros(len(tree), dtype=torch.bool)
            is_leaf[leaves] = True
            groups = grown.root_group[tree.group[rows]]
            mask, extra = self.objective.training_slots(is_leaf[rows], forest.node_latent[rows.to(forest.node_latent.device)],
                                                        mask.shape[1], sigmas, timesteps, generator, groups)
            payload.update(extra)
            if self.objective.builds_targets:  # DiffusionOPSD: targets from the rollout's states and the reward gradient
                if self.grad_reward is None:
                    raise RuntimeError(f"visgen.objective {self.objective.name} needs a differentiable reward "
                                       "(VisgenRollouts.grad_reward, set by the domain)")
                row_keys = [grown.group_keys[g] for g in groups.tolist()]
                targets, target_info = self.objective.rollout_targets(
                    self.adapter, forest.latents[rows.to(forest.latents.device)], payload, mask,
                    Conditioning(node_cond, **self._cond_meta), self.old, self.grad_reward,
                    [self.prompts[k] for k in row_keys], [self.metas[k] for k in row_keys], self.kernel.micro_batch)
                payload.update(targets)
                info.update(target_info)
            named = [n for n in (self.reward_weights or {}) if n in tree.rewards]
            if named:  # DPO: only each group's best and worst sample trains
                score = sum(self.reward_weights[n] * tree.rewards[n][rows].float().cpu() for n in named)
                score[~is_leaf[rows]] = float("nan")  # a tree's inner nodes are no candidates
                keep = self.objective.select_rows(score, groups.cpu())
                if keep is not None:
                    mask[~keep] = False
            logp_old = torch.zeros(mask.shape)
            if self.objective.deferred_logp:  # AWM / DGPO: behaviour log p from the trainer's first forward
                deferred = mask.clone()
                logp_old[deferred] = float("nan")
            rows_mask = mask
        else:
            rows_mask = mask[rows]
        info.update({"time/sample": t1 - t0, "time/reward": t2 - t1})
        if not flat:
            n_leaves = int(leaves.numel())
            info.update({"tree/nodes": float(len(tree)), "tree/leaves": float(n_leaves),
                         "tree/trained_edges": float(mask.any(1).sum()),
                         "nfe/rollout_per_leaf": forest.nfe / max(n_leaves, 1)})
        return Rollout(keys=list(grown.group_keys), group_ids=grown.root_group[tree.group[rows]].clone(),
                       rewards={k: v[rows] for k, v in tree.rewards.items()}, logp_old=logp_old,
                       mask=rows_mask, parent=None if flat else tree.parent.clone(),
                       payload=payload, nfe=forest.nfe, info=info, info_reduce=_info_reduce(info),
                       logp_deferred=deferred,
                       key_index=grown.key_index.clone(),
                       fusion_logit=None if flat else method.fusion_logit(forest))

    def _two_stage(self, cond, keys: list[int], group_size: int, sigmas: torch.Tensor, timesteps: torch.Tensor,
                   generator: torch.Generator, iteration: int) -> Grown:
        """Sol-RL ("FP4 Explore, BF16 Train"): stage 1 samples ``candidates`` chains per prompt by ODE with the
        low-precision explorer, each from its own recorded seed, and scores them; the selector keeps
        ``group_size`` per prompt; stage 2 regenerates exactly those seeds with the full-precision policy (same
        initial noise; SDE noise from each candidate's own generator, so the regeneration is replayable) under the
        method's step plan. Only stage 2 becomes the rollout; stage 1's forwards are ``nfe/explore``."""
        settings, explorer = self.two_stage
        P, N, G = len(keys), settings.candidates, group_size
        T = int(timesteps.numel())
        seeds = torch.randint(0, 2**62, (P, N), generator=generator)
        explorer.sync()
        cand_cond = cond[torch.arange(P).repeat_interleave(N)]
        gens = [torch.Generator().manual_seed(int(x)) for x in seeds.flatten().tolist()]
        x = self.adapter.prepare_latents(P * N, cand_cond, gens)
        off = torch.zeros(P * N, T, dtype=torch.bool)
        explore = flat_forest(explorer.adapter, cand_cond, x, off, off, sigmas, timesteps, None, "ode", 0.0,
                              micro_batch=self.kernel.micro_batch)
        leaves = explore.leaves()
        z = explore.node_latent[leaves.to(explore.node_latent.device)]
        size = self.kernel.micro_batch or z.shape[0]
        images = torch.cat([self.adapter.decode(z[i:i + size], cand_cond[torch.arange(i, min(i + size, z.shape[0]))])
                            for i in range(0, z.shape[0], size)])
        cand_keys = [k for k in keys for _ in range(N)]
        scores = self.score(images, [self.prompts[k] for k in cand_keys], [self.metas[k] for k in cand_keys])
        name = settings.select_reward or next(iter(scores))
        r_explore = scores[name].reshape(P, N)
        keep = select_candidates(r_explore, G, settings.selector)  # [P, G]
        kept_seeds = seeds.gather(1, keep).flatten().tolist()
        kept_cond = cond[torch.arange(P).repeat_interleave(G)]
        gens = [torch.Generator().manual_seed(int(x)) for x in kept_seeds]  # replay: the same streams
        x = self.adapter.prepare_latents(P * G, kept_cond, gens)
        plan = self.method.settings.build(T, P * G, generator, iteration)
        forest = flat_forest(self.adapter, kept_cond, x, plan.sde, plan.train, sigmas, timesteps, gens,
                             self.kernel.kernel, self.kernel.noise_level, self.kernel.reduction, self.kernel.micro_batch,
                             self._next_forward)
        self._kept_explore = r_explore.gather(1, keep)  # compared with the regenerated rewards after scoring
        self._kept_reward = name
        info = {"nfe/explore": float(explore.nfe), "two_stage/quantized_fraction": explorer.quantized_fraction}
        return Grown(forest, kept_cond, torch.arange(P).repeat_interleave(G), list(keys), torch.arange(P), info)

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool, steps: torch.Tensor | None = None
                  ) -> StepLogProbs:
        """Recompute the trained steps of edges ``idx`` with grad (``visgen.recompute``), plus the KL when asked;
        only those of ``steps`` (a subset of ``rollout.mask[idx]``, the trainer's ``optim.backward_steps``) when
        given, so a backward per step holds one step's graph. Each step's forwards see the same rows either way."""
        if self._cond_meta is None:
            raise RuntimeError("log_probs before any rollout: the prompt-conditioning settings are unknown")
        p = rollout.index_payload(idx)
        trained = rollout.mask[idx] if steps is None else rollout.mask[idx] & steps.to(rollout.mask.device)
        if self.objective.likelihood_free:
            p = self.objective.redraw_slots(p, self.epoch)
            out = self.objective.terms(self.adapter, p, trained, Conditioning(p["cond"], **self._cond_meta),
                                       self.reference, self.old, need_kl)
            dev = rollout.logp_old.device
            return StepLogProbs(logp=out.logp.to(dev), kl=None if out.kl is None else out.kl.to(dev), nfe=out.nfe,
                                objective_pos=out.objective_pos.to(dev),
                                objective_neg=None if out.objective_neg is None else out.objective_neg.to(dev),
                                group=rollout.group_ids[idx].to(dev),  # DGPO's group sums
                                logp_old=None if out.logp_old is None else out.logp_old.to(dev))  # DGPO's EMA
        rec = recompute_edges(self.adapter, p, trained, Conditioning(p["cond"], **self._cond_meta),
                              self.kernel.kernel, self.kernel.reduction,
                              reference=self.reference if need_kl else None, kl_type=self.kl_type,
                              old=self.old if self.objective.needs_old_means else None,  # Flow-DPPO's mask
                              pad=self.forward_pad)
        dev = rollout.logp_old.device
        return StepLogProbs(logp=rec.logp.to(dev), kl=None if rec.kl is None else rec.kl.to(dev),
                            entropy=rec.entropy.to(dev), nfe=rec.nfe, step_std=rec.std.to(dev),
                            old_kl=None if rec.old_kl is None else rec.old_kl.to(dev))


# ---------------------------------------------------------------------------------------------- overlapped scoring
def _resume(steps, scores) -> Rollout:
    """Send the scores into a suspended ``_rollout_steps`` generator and return its ``Rollout``."""
    try:
        steps.send(scores)
    except StopIteration as done:
        return done.value
    raise RuntimeError("_rollout_steps yielded twice")


_SUMMED_INFO = ("tree/nodes", "tree/leaves", "tree/trained_edges", "nfe/opsd_targets", "opsd/reward_grads")


def _info_reduce(info: dict) -> dict[str, str]:
    """How the trainer combines these metrics over the rollout calls of an iteration (``Rollout.info_reduce``):
    times and tree sizes add up, the rest (scores, rank agreements, per-leaf NFE) is the mean over calls."""
    return {k: "sum" if k.startswith("time/") or k in _SUMMED_INFO else "mean" for k in info}


def _chunked_rollout(r: VisgenRollouts, keys: list[int], group_size: int, generator: torch.Generator,
                     iteration: int) -> Rollout:
    """One rollout call in ``r.score_chunks`` contiguous sub-chunks of ``keys``. Sub-chunk i samples with its own
    generator, seeded from ``generator`` up front, so the result does not depend on when each chunk is scored:
    with ``r.overlap_rewards`` chunk i is scored in a worker thread while chunk i+1 samples, and the metrics equal
    the sequential sub-chunked run bit for bit (tests/visgen/test_rewards_overlap.py). ``time/reward`` is the
    reward compute time, ``time/reward_wait`` the part the sampler waited for."""
    import concurrent.futures as cf

    n = min(r.score_chunks, len(keys))
    chunks = [c.tolist() for c in torch.tensor_split(torch.tensor(keys), n)]
    seeds = torch.randint(0, 2**62, (n,), generator=generator, device=generator.device).tolist()
    gens = [torch.Generator(device=generator.device).manual_seed(int(s)) for s in seeds]
    compute = [0.0] * n

    def score(i: int, request):
        with torch.no_grad():  # grad mode is per thread
            t = time.perf_counter()
            out = r.score(*request)
            compute[i] = time.perf_counter() - t
            return out

    parts: list[Rollout] = []
    wait = 0.0
    pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grove-overlap") if r.overlap_rewards else None
    try:
        pending = None
        for i, chunk in enumerate(chunks):
            steps = r._rollout_steps(chunk, group_size, gens[i], iteration)
            request = next(steps)  # samples and decodes chunk i
            if pool is None:
                parts.append(_resume(steps, score(i, request)))
                wait += compute[i]  # sequential: the sampler waits for every reward call
                continue
            future = pool.submit(score, i, request)
            if pending is not None:
                t = time.perf_counter()
                scores = pending[1].result()
                wait += time.perf_counter() - t
                parts.append(_resume(pending[0], scores))
            pending = (steps, future)
        if pending is not None:
            t = time.perf_counter()
            scores = pending[1].result()
            wait += time.perf_counter() - t
            parts.append(_resume(pending[0], scores))
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    merged = Rollout.cat(parts)
    offsets = [0]
    for c in chunks[:-1]:
        offsets.append(offsets[-1] + len(c))
    merged.key_index = torch.cat([p.key_index + o for p, o in zip(parts, offsets)])
    info: dict[str, float] = {}
    for key in parts[0].info:
        values = [p.info[key] for p in parts if isinstance(p.info.get(key), (int, float))]
        if values:
            summed = key.startswith("time/") or key in _SUMMED_INFO
            info[key] = float(sum(values)) if summed else float(sum(values) / len(values))
    if "nfe/rollout_per_leaf" in info and info.get("tree/leaves"):
        info["nfe/rollout_per_leaf"] = merged.nfe / info["tree/leaves"]
    info.update({"time/reward": float(sum(compute)), "time/reward_wait": wait, "score_chunks": float(n)})
    merged.info = info
    merged.info_reduce = _info_reduce(info)
    return merged
