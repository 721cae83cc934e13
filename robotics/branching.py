"""Branching (tree) rollouts for robot policies, in MuJoCo or in a world model: one tree core, three modalities
(``robotics.rollout: {name: tree, branch: ...}`` in the simulator, ``name: world_model`` with ``branch`` in
imagination).

A group of G episodes from one reset state shares a prefix and branches at chosen chunk boundaries
(``BranchConfig``: ``at_chunks`` with ``factors``, their product = G leaves). Branching copies the environment
state: MuJoCo's exact state restore (``envs.vector.BatchedMetaWorld.get_states``/``set_states``) or the world
model's latent copy (``world_model.env.WorldModelEnv``) — the runner only calls the batched env API, so both work
unchanged. A tree node is one edge (the chunks between two branch points) and is one ``Rollout`` sequence; its
``parent`` is the node it branched from, leaves carry the episode's rewards, internal edges NaN, and the shared
tree estimators (``shared_rl.advantages``: ``sibling``, ``leaf_global``, ``treerl``, ``depth_zscore``) give each
edge its own advantage — step-level credit from the TreeRL / BranchGRPO / TreeGRPO family, as in the image and
text domains. Prefix sharing also saves env steps: a prefix of P chunks is executed once instead of G times.

An episode that ends (success or horizon) before a branch point still branches: its children are empty edges that
inherit its outcome, so every tree has exactly G leaves and each outcome keeps its share of the group.

Payload layout = the flat domain's (``[N, chunks, ...]`` per sequence, data only in the edge's own chunks, the
mask selecting its stochastic steps), so ``RoboticsDomain.log_probs`` recomputes tree edges without change.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from shared_rl.errors import ConfigError
from shared_rl.rollout import Rollout

from .episodes import SamplingSettings, sample_chunk
from .envs.metaworld_env import instruction_for
from .policies.vla import TinyVLA


@dataclass
class BranchConfig:
    """``robotics.rollout.branch``: where a group branches. Empty ``at_chunks`` = flat groups (G independent
    episodes)."""

    at_chunks: list[int] = field(default_factory=list, metadata={
        "help": "chunk boundaries where every live episode of a group branches, increasing, e.g. [0, 8, 16]"})
    factors: list[int] = field(default_factory=list, metadata={
        "help": "children per branch point, e.g. [2, 2, 2]; their product = rollout.group_size leaves"})

    def check(self, where: str = "robotics.rollout.branch") -> None:
        if len(self.at_chunks) != len(self.factors):
            raise ConfigError(f"{where}: at_chunks {self.at_chunks} and factors {self.factors} need the same length")
        if any(c < 0 for c in self.at_chunks) or any(b <= a for a, b in zip(self.at_chunks, self.at_chunks[1:])):
            raise ConfigError(f"{where}.at_chunks must be increasing chunk indices >= 0, got {self.at_chunks}")
        if any(f < 1 for f in self.factors):
            raise ConfigError(f"{where}.factors must be >= 1, got {self.factors}")

    @property
    def enabled(self) -> bool:
        return bool(self.at_chunks)

    @property
    def leaves(self) -> int:
        return int(math.prod(self.factors)) if self.factors else 1

    def spawn_schedule(self) -> dict[int, int]:
        """chunk -> children per live node spawned before that chunk (a shared prefix is a factor-1 spawn at 0)."""
        out = {} if (self.at_chunks and self.at_chunks[0] == 0) else {0: 1}
        out.update(dict(zip(self.at_chunks, self.factors)))
        return out


@dataclass
class TreeEpisodes:
    """N tree nodes (roots included) over C chunks; arrays per node, data only in the node's own chunks."""

    parent: np.ndarray  # [N]
    group: np.ndarray  # [N]
    tasks: list[str]  # [N]
    images: np.ndarray  # [N, C, H, W, Ch]
    proprio: np.ndarray  # [N, C, P]
    chain: np.ndarray  # [N, C, S+1, D]
    stochastic: np.ndarray  # [N, C, S]
    logp: np.ndarray  # [N, C, S]
    chunk_valid: np.ndarray  # [N, C]
    leaf: np.ndarray  # [N] bool
    success_once: np.ndarray  # [N] (leaves)
    success_end: np.ndarray  # [N]
    dense: np.ndarray  # [N] best shaped reward / 10 along the leaf's path
    env_steps: int
    nfe: int
    leaf_slot: np.ndarray  # [N] the env slot a leaf ended in (-1 for internal nodes)


@torch.no_grad()
def run_branching_episodes(policy: TinyVLA, venv, keys: list[int], tasks: list[str], sampling: SamplingSettings,
                           horizon: int, branch: BranchConfig, generator: torch.Generator | None = None,
                           device: torch.device | str = "cpu") -> TreeEpisodes:
    """One tree of ``branch.leaves`` leaves per key (``tasks[i]`` = task of ``keys[i]``), all trees batched."""
    cfg = policy.cfg
    G, n_groups, k = branch.leaves, len(keys), cfg.chunk
    n_chunks = math.ceil(horizon / k)
    steps = cfg.num_denoise_steps if cfg.head == "flow" else 1
    d = cfg.chunk * cfg.action_dim
    schedule = branch.spawn_schedule()
    if any(c >= n_chunks for c in schedule):
        raise ConfigError(f"branch.at_chunks {branch.at_chunks} must be < the {n_chunks} chunks of a {horizon}-step episode")
    per_group, live_count = 1, 1
    for c in sorted(schedule):
        live_count *= schedule[c]
        per_group += live_count
    n_nodes = n_groups * per_group
    env_keys = [kk for kk in keys for _ in range(G)]
    obs = venv.reset(env_keys)
    img, pro = obs["image"].copy(), obs["proprio"].copy()
    b = len(env_keys)
    h_, w_, c_ = img.shape[1:]
    images = np.zeros((n_nodes, n_chunks, h_, w_, c_), np.uint8)
    proprio = np.zeros((n_nodes, n_chunks, pro.shape[1]), np.float32)
    chain = np.zeros((n_nodes, n_chunks, steps + 1 if cfg.head == "flow" else 1, d),
                     np.float32 if cfg.head == "flow" else np.int64)
    stochastic = np.zeros((n_nodes, n_chunks, steps), bool)
    logp = np.zeros((n_nodes, n_chunks, steps), np.float32)
    valid = np.zeros((n_nodes, n_chunks), bool)
    parent = np.full(n_nodes, -1, np.int64)
    group = np.zeros(n_nodes, np.int64)
    node_tasks = [""] * n_nodes
    # per slot: current node, done, success flags, best shaped reward
    slot_node = np.full(b, -1, np.int64)
    done = np.zeros(b, bool)
    s_once, s_end = np.zeros(b, bool), np.zeros(b, bool)
    dense_max = np.zeros(b, np.float64)
    live: list[list[int]] = []  # per group: live slots, in tree order
    next_node = 0
    for g in range(n_groups):
        parent[next_node], group[next_node], node_tasks[next_node] = -1, g, tasks[g]
        slot_node[g * G] = next_node
        live.append([g * G])
        next_node += 1
    text_ids_slot = policy.text.token_ids([instruction_for(tasks[i // G]) for i in range(b)])
    env_steps = nfe = 0
    for c in range(n_chunks):
        if c in schedule:
            f = schedule[c]
            src, dst = [], []
            for g in range(n_groups):
                base, old = g * G, live[g]
                stride = G // (len(old) * f)
                new = []
                for li, s in enumerate(old):
                    for ci in range(f):
                        slot = base + (li * f + ci) * stride
                        node = next_node
                        next_node += 1
                        parent[node], group[node], node_tasks[node] = slot_node[s], g, tasks[g]
                        if slot != s:
                            src.append(s), dst.append(slot)
                        new.append((slot, node))
                for slot, node in new:
                    slot_node[slot] = node
                live[g] = [slot for slot, _ in new]
            if dst:
                venv.set_states(dst, venv.get_states(src))
                for a_, b_ in zip(src, dst):
                    img[b_], pro[b_], done[b_] = img[a_], pro[a_], done[a_]
                    s_once[b_], s_end[b_], dense_max[b_] = s_once[a_], s_end[a_], dense_max[a_]
        act_idx = np.array([s for g in range(n_groups) for s in live[g] if not done[s]], np.int64)
        if act_idx.size == 0:
            continue
        nodes = slot_node[act_idx]
        images[nodes, c], proprio[nodes, c] = img[act_idx], pro[act_idx]
        h = policy.encode(torch.from_numpy(img[act_idx]).to(device), torch.from_numpy(pro[act_idx]).to(device),
                          [text_ids_slot[i] for i in act_idx])
        acts, ch, st, lp, nfe_row = sample_chunk(policy, h, sampling, generator)
        nfe += nfe_row * len(act_idx)
        chain[nodes, c], stochastic[nodes, c], logp[nodes, c] = ch.cpu().numpy(), st.cpu().numpy(), lp.cpu().numpy()
        valid[nodes, c] = True
        full = np.zeros((b, k, cfg.action_dim), np.float32)
        full[act_idx] = acts.clamp(-1, 1).cpu().numpy()
        active = np.zeros(b, bool)
        active[act_idx] = True
        res = venv.step_chunk(full, active)
        env_steps += int(res.executed[act_idx].sum())
        dense_max[act_idx] = np.maximum(dense_max[act_idx], np.where(res.executed[act_idx], res.reward[act_idx], 0.0).max(1))
        done[act_idx] = res.done[act_idx]
        s_once[act_idx], s_end[act_idx] = res.success_once[act_idx], res.success_end[act_idx]
        img[act_idx], pro[act_idx] = res.image[act_idx], res.proprio[act_idx]
    assert next_node == n_nodes, (next_node, n_nodes)
    leaf = np.zeros(n_nodes, bool)
    leaf_slot = np.full(n_nodes, -1, np.int64)
    so, se, dn = (np.full(n_nodes, np.nan, np.float32) for _ in range(3))
    for g in range(n_groups):
        for s in live[g]:
            n = slot_node[s]
            leaf[n], leaf_slot[n] = True, s
            so[n], se[n], dn[n] = float(s_once[s]), float(s_end[s]), dense_max[s] / 10.0
    return TreeEpisodes(parent=parent, group=group, tasks=node_tasks, images=images, proprio=proprio, chain=chain,
                        stochastic=stochastic, logp=logp, chunk_valid=valid, leaf=leaf, success_once=so,
                        success_end=se, dense=dn, env_steps=env_steps, nfe=nfe, leaf_slot=leaf_slot)


def tree_rollout(tree: TreeEpisodes, keys: list[int], env_tasks: list[str], success_mode: str, dense: bool) -> Rollout:
    """The trainer's view of a tree: one sequence per node (edge), parent array, rewards on leaves."""
    n, c, s = tree.chunk_valid.shape[0], tree.chunk_valid.shape[1], tree.stochastic.shape[2]
    mask = torch.from_numpy(tree.stochastic & tree.chunk_valid[..., None]).reshape(n, c * s)
    logp_old = torch.from_numpy(tree.logp).reshape(n, c * s) * mask
    succ = tree.success_once if success_mode == "once" else tree.success_end
    rewards = {"success": torch.from_numpy(succ.astype(np.float32))}
    if dense:
        rewards["dense"] = torch.from_numpy(tree.dense.astype(np.float32))
    payload = {"images": torch.from_numpy(tree.images), "proprio": torch.from_numpy(tree.proprio),
               "chain": torch.from_numpy(tree.chain), "task_index": torch.tensor([env_tasks.index(t) for t in tree.tasks])}
    return Rollout(keys=list(keys), group_ids=torch.from_numpy(tree.group), rewards=rewards, logp_old=logp_old.float(),
                   mask=mask, parent=torch.from_numpy(tree.parent), payload=payload, nfe=tree.nfe,
                   info={"env/steps": int(tree.env_steps), "env/episodes": int(tree.leaf.sum())})
