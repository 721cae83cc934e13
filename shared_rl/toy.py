"""A toy domain: a contextual categorical bandit with multi-step answers, small enough to read in one go.

Key k is a context; the policy is a logit table ``[K, A]``; a sequence is ``horizon`` actions sampled i.i.d. from
softmax(logits[k]); the reward is the fraction of actions equal to the context's target ``k mod A``. With
``tree_branch > 1`` a rollout is a tree: each node's edge is ``horizon`` actions and every node branches
``tree_branch`` ways for ``tree_depth`` levels (leaves carry the reward of their whole path), which exercises
the tree advantage estimators. It proves the trainer learns (``tests/core/test_trainer.py``) and is the demo
until a real domain exists.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .domain import DomainBase, RunContext, StepLogProbs
from .rollout import Rollout
from .toy_config import ToyConfig  # noqa: F401  (shared_rl.toy.ToyConfig, as before)


class LogitTable(torch.nn.Module):
    """The toy policy as a module (``forward``: log-softmax rows of the contexts), so that FSDP2 can shard it and
    its forward hooks gather the table."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, ctx: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.logits[ctx], -1)


class ToyDomain(DomainBase):
    config_class = ToyConfig

    def __init__(self, cfg: ToyConfig, ctx: RunContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        if ctx.device.type != "cpu":  # said once, so that device= is never silently ignored
            ctx.log(f"toy: the bandit's logit table stays on the CPU (device={ctx.device} applies to the other domains)")
        g = torch.Generator().manual_seed(ctx.seed)
        self.policy = LogitTable(cfg.init_scale * torch.randn(cfg.num_contexts, cfg.num_actions, generator=g))
        self.ref_logits = self.logits.detach().clone()
        self.targets = torch.arange(cfg.num_contexts) % cfg.num_actions

    @property
    def logits(self) -> torch.nn.Parameter:
        # read through the module every time: FSDP2 swaps the attribute between the shard and the gathered table
        return self.policy.logits

    def fsdp_modules(self) -> list[torch.nn.Module]:
        return [self.policy]

    def train_keys(self) -> list[int]:
        return list(range(self.cfg.num_contexts))

    def _sample(self, ctx: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.logits.detach()[ctx], -1)
        actions = torch.multinomial(probs, self.cfg.horizon, replacement=True, generator=generator)
        logp = torch.log(probs.gather(1, actions))
        return actions, logp

    def _reward(self, ctx: torch.Tensor, actions: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        r = (actions == self.targets[ctx][:, None]).float().mean(1)
        if self.cfg.reward_noise:
            r = r + self.cfg.reward_noise * torch.randn(r.shape, generator=generator)
        return r

    def rollout(self, keys: list[int], group_size: int, generator: torch.Generator, iteration: int) -> Rollout:
        if self.cfg.tree_branch > 1:
            return self._tree_rollout(keys, generator)
        gid = torch.arange(len(keys)).repeat_interleave(group_size)
        ctx = torch.tensor(keys)[gid]
        actions, logp = self._sample(ctx, generator)
        deferred = torch.full(logp.shape, self.cfg.deferred_logp)
        if self.cfg.deferred_logp:
            logp = torch.full_like(logp, float("nan"))  # placeholders: the trainer fills them
        return Rollout(keys=list(keys), group_ids=gid, rewards={"correct": self._reward(ctx, actions, generator)},
                       logp_old=logp, mask=torch.ones_like(logp, dtype=torch.bool),
                       payload={"ctx": ctx, "actions": actions}, nfe=len(ctx), logp_deferred=deferred)

    def _tree_rollout(self, keys: list[int], generator: torch.Generator) -> Rollout:
        from .tree import RolloutTree

        c, T = self.cfg, self.cfg.horizon
        tree = RolloutTree.roots(len(keys))
        ctx_of_group = torch.tensor(keys)
        actions = torch.zeros(len(keys), T, dtype=torch.long)
        logp = torch.zeros(len(keys), T)
        for _ in range(c.tree_depth):
            new = tree.expand(tree.frontier(), c.tree_branch)  # one batched "forward" per depth
            a, lp = self._sample(ctx_of_group[tree.group[new]], generator)
            actions, logp = torch.cat([actions, a]), torch.cat([logp, lp])
        ctx = ctx_of_group[tree.group]
        leaves = tree.leaves()
        # a leaf's reward is the accuracy over its whole path (root excluded)
        path_correct = torch.zeros(len(tree))
        for leaf in leaves.tolist():
            path = tree.path_to_root(leaf)[:-1]
            path_correct[leaf] = (actions[path] == self.targets[ctx[leaf]]).float().mean()
        tree.set_leaf_rewards("correct", leaves, path_correct[leaves])
        mask = (tree.parent >= 0)[:, None].expand(-1, T).clone()
        return Rollout(keys=list(keys), group_ids=tree.group, rewards=dict(tree.rewards), logp_old=logp, mask=mask,
                       parent=tree.parent, payload={"ctx": ctx, "actions": actions}, nfe=int((tree.parent >= 0).sum()))

    supports_step_subsets = True  # every step is computed; the trainer masks those of other chunks

    def log_probs(self, rollout: Rollout, idx: torch.Tensor, need_kl: bool, steps=None) -> StepLogProbs:
        p = rollout.index_payload(idx)
        logits = self.policy(p["ctx"])
        logp = logits.gather(1, p["actions"])
        ref = torch.log_softmax(self.ref_logits[p["ctx"]], -1).gather(1, p["actions"]) if need_kl else None
        entropy = -(logits.exp() * logits).sum(-1, keepdim=True).expand_as(logp)
        return StepLogProbs(logp=logp, ref_logp=ref, entropy=entropy, nfe=len(idx))

    def parameters(self) -> list[torch.nn.Parameter]:
        return [self.logits]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"logits": self.logits.detach().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.logits.copy_(state["logits"])

    def save_pretrained(self, out_dir: Path) -> None:
        """``final/``: the logit table (``model.safetensors``, tensor ``logits`` [num_contexts, num_actions]) and
        ``config.json`` (the ``toy`` section and each context's target action); ``load_pretrained`` reads it."""
        from safetensors.torch import save_file

        from .distributed import full_tensors

        # FSDP2 calls this on every process with the table sharded (a DTensor): gather it (collective, every
        # rank), then write on the first one only
        logits = full_tensors({"logits": self.logits.detach()})["logits"]
        if self.ctx.process_index != 0:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file({"logits": logits.cpu().contiguous()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({"domain": "toy", **asdict(self.cfg),
                                                     "targets": self.targets.tolist()}, indent=1) + "\n")

    @staticmethod
    def load_pretrained(path: str | Path) -> tuple[torch.Tensor, dict]:
        """(the logit table, the config) of a toy run's ``final/``."""
        from safetensors.torch import load_file

        path = Path(path)
        return load_file(str(path / "model.safetensors"))["logits"], json.loads((path / "config.json").read_text())

    def evaluate(self, iteration: int) -> dict[str, float]:
        greedy = self.logits.detach().argmax(-1)
        probs = torch.softmax(self.logits.detach(), -1)
        return {
            "eval/greedy_accuracy": float((greedy == self.targets).float().mean()),
            "eval/expected_reward": float(probs.gather(1, self.targets[:, None]).mean()),
        }
