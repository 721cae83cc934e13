"""An array-based rollout tree (struct of arrays over nodes 0..N-1), shared by every domain.

Node i has ``parent[i]`` (−1 for a root), ``depth[i]``, ``group[i]`` (its root's group key index), the behaviour
log-prob of the edge into it, a ``trainable`` flag for that edge and, on leaves, rewards. The domain keeps the
payload (latents, token ids, observations) indexed by node id. A flat GRPO group of G samples is a root with G
independent chains; BranchGRPO / TreeGRPO / TreeRL branch at chosen depths and share prefixes.

Trees grow level by level so a domain can expand **all nodes of one depth in one batched forward**::

    tree = RolloutTree.roots(num_groups)
    frontier = tree.frontier()                       # node ids to expand next
    children = tree.expand(frontier, branch=2)       # ids of the new nodes, parent-major order
    ... sample the children's steps in one batch, then tree.set_edge_logp(children, logp) ...
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def tree_depth(parent: torch.Tensor) -> torch.Tensor:
    """Depth of every node (roots 0)."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    depth = torch.zeros_like(parent)
    has_parent = parent >= 0
    for _ in range(parent.numel()):
        new = torch.where(has_parent, depth[parent.clamp(min=0)] + 1, torch.zeros_like(depth))
        if torch.equal(new, depth):
            break
        depth = new
    return depth


def tree_roots(parent: torch.Tensor) -> torch.Tensor:
    """Root id of every node."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    root = torch.arange(parent.numel())
    for _ in range(parent.numel()):
        up = parent[root]
        new = torch.where(up >= 0, up, root)
        if torch.equal(new, root):
            break
        root = new
    return root


def is_leaf(parent: torch.Tensor) -> torch.Tensor:
    """True for nodes without children."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    leaf = torch.ones(parent.numel(), dtype=torch.bool)
    leaf[parent[parent >= 0]] = False
    return leaf


def leaf_counts(parent: torch.Tensor) -> torch.Tensor:
    """Number of leaves below every node (1 for a leaf)."""
    parent = torch.as_tensor(parent, dtype=torch.long)
    leaf = is_leaf(parent)
    cnt = leaf.long().clone()
    cur = parent[leaf]
    while (cur >= 0).any():
        live = cur >= 0
        cnt.index_add_(0, cur[live], torch.ones(int(live.sum()), dtype=torch.long))
        cur = torch.where(live, parent[cur.clamp(min=0)], cur)
    return cnt


@dataclass
class RolloutTree:
    """Growing forest of rollout nodes; see the module docstring."""

    parent: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    group: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    depth: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    logp_old: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    trainable: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    rewards: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def roots(cls, num_groups: int) -> "RolloutTree":
        n = num_groups
        return cls(
            parent=torch.full((n,), -1, dtype=torch.long),
            group=torch.arange(n),
            depth=torch.zeros(n, dtype=torch.long),
            logp_old=torch.zeros(n),
            trainable=torch.zeros(n, dtype=torch.bool),
        )

    def __len__(self) -> int:
        return int(self.parent.numel())

    def frontier(self) -> torch.Tensor:
        """Ids of the current leaves (the nodes a next level expands), in id order."""
        return torch.nonzero(is_leaf(self.parent)).flatten()

    def expand(self, nodes: torch.Tensor, branch: int | torch.Tensor = 1, trainable: bool = True) -> torch.Tensor:
        """Add ``branch`` children to each of ``nodes`` (parent-major order); return the new ids.

        ``branch`` may be a per-node tensor (e.g. different factors per tree).
        """
        nodes = torch.as_tensor(nodes, dtype=torch.long)
        counts = torch.as_tensor(branch, dtype=torch.long).expand(nodes.numel())
        par = torch.repeat_interleave(nodes, counts)
        start = len(self)
        k = par.numel()
        self.parent = torch.cat([self.parent, par])
        self.group = torch.cat([self.group, self.group[par]])
        self.depth = torch.cat([self.depth, self.depth[par] + 1])
        self.logp_old = torch.cat([self.logp_old, torch.zeros(k)])
        self.trainable = torch.cat([self.trainable, torch.full((k,), trainable)])
        for name, r in self.rewards.items():
            self.rewards[name] = torch.cat([r, torch.full((k,), float("nan"))])
        return torch.arange(start, start + k)

    def set_edge_logp(self, nodes: torch.Tensor, logp: torch.Tensor) -> None:
        self.logp_old[nodes] = logp.detach().float().cpu()

    def set_leaf_rewards(self, name: str, nodes: torch.Tensor, values: torch.Tensor) -> None:
        if name not in self.rewards:
            self.rewards[name] = torch.full((len(self),), float("nan"))
        self.rewards[name][nodes] = values.detach().float().cpu()

    def leaves(self) -> torch.Tensor:
        return torch.nonzero(is_leaf(self.parent)).flatten()

    def edges(self) -> torch.Tensor:
        """Ids of nodes that have an incoming edge (every non-root)."""
        return torch.nonzero(self.parent >= 0).flatten()

    def path_to_root(self, node: int) -> list[int]:
        """Node ids from ``node`` up to its root (inclusive), leaf first."""
        out = [int(node)]
        while self.parent[out[-1]] >= 0:
            out.append(int(self.parent[out[-1]]))
        return out

    def unique_nodes(self) -> int:
        """Nodes actually computed (prefix sharing: each node once)."""
        return len(self)

    # ---- edge masks (pruning) -------------------------------------------------------------------------------
    def mask_depth_window(self, lo: int, hi: int) -> None:
        """Depth pruning (BranchGRPO): edges into nodes with lo <= depth < hi are not trained."""
        self.trainable &= ~((self.depth >= lo) & (self.depth < hi))

    def mask_width(self, advantages: torch.Tensor, depth: int, keep: float | str) -> None:
        """Width pruning (BranchGRPO): among edges into depth ``depth`` of each tree, train only the top ``keep``
        fraction by |advantage|, or ``"best_worst"``: the highest and lowest advantage edge per tree."""
        for g in torch.unique(self.group):
            idx = torch.nonzero((self.group == g) & (self.depth == depth) & self.trainable).flatten()
            if idx.numel() == 0:
                continue
            a = advantages[idx]
            if keep == "best_worst":
                keep_idx = torch.unique(torch.stack([idx[a.argmax()], idx[a.argmin()]]))
            else:
                k = max(1, int(round(float(keep) * idx.numel())))
                keep_idx = idx[a.abs().argsort(descending=True, stable=True)[:k]]
            drop = torch.ones(idx.numel(), dtype=torch.bool)
            drop[torch.isin(idx, keep_idx)] = False
            self.trainable[idx[drop]] = False
