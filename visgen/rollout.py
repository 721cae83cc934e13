"""One rollout call of any visgen method, and the recomputation of its log-probs: the glue between the trainer's
``Domain`` contract and the engine.

``rollout``: encode the prompts → the method grows its forest on the engine (``visgen.engine``) → decode the
leaves → score them → the method's after-rewards hook (pruning) → a ``shared_rl.rollout.Rollout`` whose
sequences are the leaf chains (flat methods) or every node's edge with the parent array (tree methods).
``log_probs``: ``visgen.recompute.recompute_edges`` on the rows asked for. ``VisgenDomain`` owns one of these; tests
build one around a tiny pipeline and a toy reward.
"""
from __future__ import annotations

import time
from typing import Any, Callable, ContextManager

import torch

from shared_rl.domain import StepLogProbs
from shared_rl.rollout import Rollout

from .engine import forest_payload
from .methods import KernelSettings, RolloutMethod
from .pipelines import Conditioning
from .recompute import recompute_edges

__all__ = ["VisgenRollouts"]


class VisgenRollouts:
    """Rollouts of ``method`` for prompts ``prompts[key]`` scored by ``score(images, prompts, metas) -> {name: [N]}``.

    ``reference``: a context-manager factory under which the adapter computes the reference velocity (the LoRA
    adapter switched off), used for the KL when ``log_probs(..., need_kl=True)``.
    """

    def __init__(self, adapter, method: RolloutMethod, kernel: KernelSettings, prompts: list[str], metas: list[dict],
                 score: Callable[..., dict[str, torch.Tensor]], num_inference_steps: int, guidance_scale: float = 1.0,
                 sample_kwargs: dict[str, Any] | None = None, reference: Callable[[], ContextManager] | None = None,
                 kl_type: str = "mean") -> None:
        self.adapter, self.method, self.kernel = adapter, method, kernel
        self.prompts, self.metas, self.score = prompts, metas, score
        self.num_inference_steps, self.guidance_scale = num_inference_steps, guidance_scale
        self.sample_kwargs = dict(sample_kwargs or {})
        self.reference, self.kl_type = reference, kl_type
        self._cond_meta: dict[str, Any] | None = None
        self._next_forward = 0  # forward ids stay unique across rollout calls (refills concatenate payloads)

    @torch.no_grad()
    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        """Grow the configured method's forest for prompts ``keys`` (one batched forward per level and step),
        decode and score its leaves, let the method prune, and return the trainable edges as a ``Rollout``: the
        leaf chains for flat methods, every node (parents, rewards on leaves) for tree methods."""
        method = self.method
        t0 = time.perf_counter()
        cond = self.adapter.encode_prompts([self.prompts[k] for k in keys], num_images_per_prompt=1,
                                           guidance_scale=self.guidance_scale, **self.sample_kwargs)
        sigmas, timesteps = self.adapter.schedule(self.num_inference_steps, cond)
        grown = method.grow(self.adapter, cond, list(keys), group_size, sigmas, timesteps, generator, iteration,
                            self.kernel, self._next_forward)
        forest, tree = grown.forest, grown.forest.tree
        self._next_forward += forest.forwards + 1
        leaves = forest.leaves()
        leaf_root = tree.group[leaves]
        x = forest.node_latent[leaves.to(forest.node_latent.device)]
        size = self.kernel.micro_batch or x.shape[0]
        images = torch.cat([self.adapter.decode(x[i:i + size], grown.root_cond[leaf_root[i:i + size]])
                            for i in range(0, x.shape[0], size)])
        t1 = time.perf_counter()
        leaf_keys = [grown.group_keys[g] for g in grown.root_group[leaf_root].tolist()]
        scores = self.score(images, [self.prompts[k] for k in leaf_keys], [self.metas[k] for k in leaf_keys])
        for name, value in scores.items():
            tree.set_leaf_rewards(name, leaves, torch.as_tensor(value).float().reshape(-1))
        t2 = time.perf_counter()
        info = {**grown.info, **method.after_rewards(forest, tree.rewards, iteration)}
        c = grown.root_cond
        self._cond_meta = {"guidance_scale": c.guidance_scale, "do_cfg": c.do_cfg, "height": c.height,
                           "width": c.width, "shared": c.shared, "options": c.options}
        mask = forest.train & tree.trainable[:, None] & forest.sde
        flat = method.structure == "flat"
        rows = leaves if flat else torch.arange(len(tree))
        node_cond = {k: v[tree.group[rows].to(v.device)] for k, v in c.tensors.items()}
        info.update({"time/sample": t1 - t0, "time/reward": t2 - t1})
        if not flat:
            n_leaves = int(leaves.numel())
            info.update({"tree/nodes": float(len(tree)), "tree/leaves": float(n_leaves),
                         "tree/trained_edges": float(mask.any(1).sum()),
                         "nfe/rollout_per_leaf": forest.nfe / max(n_leaves, 1)})
        return Rollout(keys=list(grown.group_keys), group_ids=grown.root_group[tree.group[rows]].clone(),
                       rewards={k: v[rows] for k, v in tree.rewards.items()}, logp_old=forest.logp[rows].clone(),
                       mask=mask[rows], parent=None if flat else tree.parent.clone(),
                       payload=forest_payload(forest, node_cond, rows), nfe=forest.nfe, info=info,
                       key_index=grown.key_index.clone())

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool) -> StepLogProbs:
        """Recompute the trained steps of edges ``idx`` with grad (``visgen.recompute``), plus the KL when asked."""
        if self._cond_meta is None:
            raise RuntimeError("log_probs before any rollout: the prompt-conditioning settings are unknown")
        p = rollout.index_payload(idx)
        rec = recompute_edges(self.adapter, p, rollout.mask[idx], Conditioning(p["cond"], **self._cond_meta),
                              self.kernel.kernel, self.kernel.reduction,
                              reference=self.reference if need_kl else None, kl_type=self.kl_type)
        dev = rollout.logp_old.device
        return StepLogProbs(logp=rec.logp.to(dev), kl=None if rec.kl is None else rec.kl.to(dev),
                            entropy=rec.entropy.to(dev), nfe=rec.nfe)
