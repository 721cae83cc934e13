"""Tree rollouts for text: completions grow as trees of token segments that share prefixes.

TreePO (Li et al., "TreePO: Bridging the Gap of Policy Optimization and Efficacy and Inference Efficiency with
Heuristic Tree-based Modeling") branches at fixed segment boundaries; TreeRL (Hou et al., "TreeRL: LLM
Reinforcement Learning with On-Policy Tree Search", EPTree) forks at high-entropy tokens. Both are expressed
here: depth ``d`` nodes are expanded into ``branching[d]`` children, each a segment of at most
``segment_tokens`` new tokens (the last depth runs to the length cap); with ``branch_on: entropy`` a segment also
ends *before* a token whose next-token entropy exceeds ``entropy_threshold`` (after ``min_segment_tokens``), so
the children diverge exactly at the uncertain token.

Bookkeeping (one tree per prompt, nodes in creation order): node 0 of each tree is the root (the prompt, no
tokens); node i > root holds ``path[i]`` = all completion tokens from the root to the end of its segment and
``start[i]`` = where its own segment begins in that path; ``parent[i]`` indexes the node list (-1 for roots). A
node that sampled EOS, reached the length cap or sits at the last depth is a leaf. Children share their parent's
prefix: only the new segment is sampled (an engine with prefix caching, e.g. vLLM, re-uses the prefix's KV).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import LLMTreeSettings  # noqa: F401  (shared_rl.llm.tree.LLMTreeSettings, as before)
from .engine import RolloutEngine


@dataclass
class TokenTree:
    """Struct of arrays over all nodes of a batch of trees."""

    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    group: list[int] = field(default_factory=list)
    start: list[int] = field(default_factory=list)
    path: list[list[int]] = field(default_factory=list)
    segment_logprobs: list[list[float]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    expanded: list[bool] = field(default_factory=list)
    generated_tokens: int = 0
    nfe: int = 0

    def add(self, parent: int, depth: int, group: int, start: int, path: list[int], finished: bool,
            segment_logprobs: list[float] | None = None) -> int:
        self.parent.append(parent)
        self.segment_logprobs.append(list(segment_logprobs or []))
        self.depth.append(depth)
        self.group.append(group)
        self.start.append(start)
        self.path.append(path)
        self.finished.append(finished)
        self.expanded.append(False)
        return len(self.parent) - 1

    def __len__(self) -> int:
        return len(self.parent)

    @property
    def is_leaf(self) -> list[bool]:
        return [p >= 0 and not e for p, e in zip(self.parent, self.expanded)]


def grow_trees(engine: RolloutEngine, prompts: list[list[int]], settings: LLMTreeSettings, max_new_tokens: int,
               temperature: float, generator: torch.Generator) -> TokenTree:
    """Grow one tree per prompt, level by level (one batched engine call per depth)."""
    if any(b < 1 for b in settings.branching) or not settings.branching:
        raise ValueError(f"llm.tree.branching must be a non-empty list of positive ints, got {settings.branching}")
    if settings.branch_on not in ("fixed", "entropy"):
        raise ValueError(f"llm.tree.branch_on must be 'fixed' or 'entropy', got {settings.branch_on!r}")
    tree = TokenTree()
    frontier = [tree.add(-1, 0, g, 0, [], False) for g in range(len(prompts))]
    last_depth = len(settings.branching) - 1
    for depth, width in enumerate(settings.branching):
        expand = [i for i in frontier if not tree.finished[i] and len(tree.path[i]) < max_new_tokens]
        if not expand:
            break
        is_last = depth == last_depth
        caps = [max_new_tokens - len(tree.path[i]) if is_last
                else min(settings.segment_tokens, max_new_tokens - len(tree.path[i])) for i in expand]
        use_entropy = settings.branch_on == "entropy" and not is_last
        gen = engine.generate([prompts[tree.group[i]] + tree.path[i] for i in expand], width, max(caps),
                              temperature, generator,
                              stop_entropy=settings.entropy_threshold if use_entropy else None,
                              min_new_tokens_before_stop=settings.min_segment_tokens)
        tree.nfe += gen.nfe
        frontier = []
        for row, parent_pos in enumerate(gen.prompt_index):
            node = expand[parent_pos]
            tokens = gen.completion_ids[row]
            cap = caps[parent_pos]
            finished = gen.finished[row] and len(tokens) <= cap
            segment = tokens[:cap]        # a longer call for mixed caps; the prefix is still an exact sample
            tree.generated_tokens += len(segment)
            tree.expanded[node] = True
            logprobs = gen.sample_logprobs[row][:cap] if gen.sample_logprobs else None
            child = tree.add(node, depth + 1, tree.group[node], len(tree.path[node]), tree.path[node] + segment,
                             finished, logprobs)
            frontier.append(child)
    return tree
