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
from .part_settings import BranchConfig  # noqa: F401  (torch-free, re-exported here)
from .policies.vla import TinyVLA


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
    """One tree of ``branch.leaves`` leaves per key (``tasks[i]`` = task of ``keys[i]``), all trees batched: at a
    branch point every live episode's env state is copied into its children's env slots, then every unfinished
    slot plans and executes the next chunk."""
    n_chunks = math.ceil(horizon / policy.cfg.chunk)
    schedule = branch.spawn_schedule()
    if any(c >= n_chunks for c in schedule):
        raise ConfigError(f"branch.at_chunks {branch.at_chunks} must be < the {n_chunks} chunks of a {horizon}-step episode")
    G = branch.leaves
    obs = venv.reset([kk for kk in keys for _ in range(G)])
    trees = _Trees(policy.cfg, tasks, G, n_chunks, schedule, obs)
    text_ids_slot = policy.text.token_ids([instruction_for(tasks[i // G]) for i in range(trees.b)])
    for c in range(n_chunks):
        if c in schedule:
            trees.spawn(schedule[c], venv)
        trees.step(c, policy, venv, text_ids_slot, sampling, generator, device)
    return trees.episodes()


class _Trees:
    """The growing trees of one ``run_branching_episodes`` call: per node (edge) its recorded chunks, per env slot
    (G per tree, a tree's live episodes spread over its slots) the node it extends and its episode state."""

    def __init__(self, cfg, tasks: list[str], G: int, n_chunks: int, schedule: dict[int, int], obs: dict):
        self.cfg, self.tasks, self.G, self.n_groups = cfg, tasks, G, len(tasks)
        steps = cfg.num_denoise_steps if cfg.head == "flow" else 1
        d = cfg.chunk * cfg.action_dim
        per_group, live_count = 1, 1
        for c in sorted(schedule):
            live_count *= schedule[c]
            per_group += live_count
        n_nodes = self.n_groups * per_group
        self.img, self.pro = obs["image"].copy(), obs["proprio"].copy()
        self.b = b = self.n_groups * G
        h_, w_, c_ = self.img.shape[1:]
        self.images = np.zeros((n_nodes, n_chunks, h_, w_, c_), np.uint8)
        self.proprio = np.zeros((n_nodes, n_chunks, self.pro.shape[1]), np.float32)
        self.chain = np.zeros((n_nodes, n_chunks, steps + 1 if cfg.head == "flow" else 1, d),
                              np.float32 if cfg.head == "flow" else np.int64)
        self.stochastic = np.zeros((n_nodes, n_chunks, steps), bool)
        self.logp = np.zeros((n_nodes, n_chunks, steps), np.float32)
        self.valid = np.zeros((n_nodes, n_chunks), bool)
        self.parent = np.full(n_nodes, -1, np.int64)
        self.group = np.zeros(n_nodes, np.int64)
        self.node_tasks = [""] * n_nodes
        # per slot: current node, done, success flags, best shaped reward
        self.slot_node = np.full(b, -1, np.int64)
        self.done = np.zeros(b, bool)
        self.s_once, self.s_end = np.zeros(b, bool), np.zeros(b, bool)
        self.dense_max = np.zeros(b, np.float64)
        self.live: list[list[int]] = []  # per group: live slots, in tree order
        self.next_node = 0
        for g in range(self.n_groups):  # the roots, one per tree, in its first slot
            self.parent[self.next_node], self.group[self.next_node], self.node_tasks[self.next_node] = -1, g, tasks[g]
            self.slot_node[g * G] = self.next_node
            self.live.append([g * G])
            self.next_node += 1
        self.env_steps = self.nfe = 0

    def spawn(self, f: int, venv) -> None:
        """Every live node gets ``f`` children, spread over its tree's slots; the env state (and the episode state)
        of a child in another slot is a copy of its parent's."""
        G = self.G
        src, dst = [], []
        for g in range(self.n_groups):
            base, old = g * G, self.live[g]
            stride = G // (len(old) * f)
            new = []
            for li, s in enumerate(old):
                for ci in range(f):
                    slot = base + (li * f + ci) * stride
                    node = self.next_node
                    self.next_node += 1
                    self.parent[node], self.group[node], self.node_tasks[node] = self.slot_node[s], g, self.tasks[g]
                    if slot != s:
                        src.append(s), dst.append(slot)
                    new.append((slot, node))
            for slot, node in new:
                self.slot_node[slot] = node
            self.live[g] = [slot for slot, _ in new]
        if dst:
            venv.set_states(dst, venv.get_states(src))
            for a_, b_ in zip(src, dst):
                self.img[b_], self.pro[b_], self.done[b_] = self.img[a_], self.pro[a_], self.done[a_]
                self.s_once[b_], self.s_end[b_], self.dense_max[b_] = self.s_once[a_], self.s_end[a_], self.dense_max[a_]

    def step(self, c: int, policy: TinyVLA, venv, text_ids_slot, sampling: SamplingSettings,
             generator: torch.Generator | None, device) -> None:
        """Chunk ``c`` of every live, unfinished slot: record its observation, sample, execute."""
        act_idx = np.array([s for g in range(self.n_groups) for s in self.live[g] if not self.done[s]], np.int64)
        if act_idx.size == 0:
            return
        img, pro = self.img, self.pro
        nodes = self.slot_node[act_idx]
        self.images[nodes, c], self.proprio[nodes, c] = img[act_idx], pro[act_idx]
        h = policy.encode(torch.from_numpy(img[act_idx]).to(device), torch.from_numpy(pro[act_idx]).to(device),
                          [text_ids_slot[i] for i in act_idx])
        acts, ch, st, lp, nfe_row = sample_chunk(policy, h, sampling, generator)
        self.nfe += nfe_row * len(act_idx)
        self.chain[nodes, c], self.stochastic[nodes, c], self.logp[nodes, c] = ch.cpu().numpy(), st.cpu().numpy(), lp.cpu().numpy()
        self.valid[nodes, c] = True
        full = np.zeros((self.b, self.cfg.chunk, self.cfg.action_dim), np.float32)
        full[act_idx] = acts.clamp(-1, 1).cpu().numpy()
        active = np.zeros(self.b, bool)
        active[act_idx] = True
        res = venv.step_chunk(full, active)
        self.env_steps += int(res.executed[act_idx].sum())
        self.dense_max[act_idx] = np.maximum(self.dense_max[act_idx],
                                             np.where(res.executed[act_idx], res.reward[act_idx], 0.0).max(1))
        self.done[act_idx] = res.done[act_idx]
        self.s_once[act_idx], self.s_end[act_idx] = res.success_once[act_idx], res.success_end[act_idx]
        img[act_idx], pro[act_idx] = res.image[act_idx], res.proprio[act_idx]

    def episodes(self) -> TreeEpisodes:
        """The finished trees: the last node of every live slot is a leaf with its episode's outcome."""
        n_nodes = len(self.parent)
        assert self.next_node == n_nodes, (self.next_node, n_nodes)
        leaf = np.zeros(n_nodes, bool)
        leaf_slot = np.full(n_nodes, -1, np.int64)
        so, se, dn = (np.full(n_nodes, np.nan, np.float32) for _ in range(3))
        for g in range(self.n_groups):
            for s in self.live[g]:
                n = self.slot_node[s]
                leaf[n], leaf_slot[n] = True, s
                so[n], se[n], dn[n] = float(self.s_once[s]), float(self.s_end[s]), self.dense_max[s] / 10.0
        return TreeEpisodes(parent=self.parent, group=self.group, tasks=self.node_tasks, images=self.images,
                            proprio=self.proprio, chain=self.chain, stochastic=self.stochastic, logp=self.logp,
                            chunk_valid=self.valid, leaf=leaf, success_once=so, success_end=se, dense=dn,
                            env_steps=self.env_steps, nfe=self.nfe, leaf_slot=leaf_slot)


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
