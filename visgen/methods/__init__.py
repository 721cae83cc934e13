"""visgen rollout methods, registered by name (LeRobot ``register_subclass`` / verl ``core_algos`` style).

A method decides the *shape* of one iteration's rollout on the one engine (``visgen.engine``): which forest to
grow from a batch of prompts and which steps of it are stochastic and trained, plus an optional hook after the
rewards are known (BranchGRPO's pruning). Every method is one small class in this package with its own settings
dataclass, chosen in YAML as a tagged union — only the chosen method's fields are valid::

    visgen:
      method: {name: flow_grpo, train_fraction: 0.3}          # flat: a forest of depth one
      method: {name: branch_grpo, split_steps: [0, 2, 4, 6], factor: [2]}

| name             | paper                                   | shape | file            |
|------------------|-----------------------------------------|-------|-----------------|
| ``flow_grpo``    | Flow-GRPO (Liu et al. 2025)             | flat  | ``flat.py``     |
| ``dance_grpo``   | DanceGRPO (Xue et al. 2025)             | flat  | ``flat.py``     |
| ``flow_grpo_fast`` | Flow-GRPO-Fast                        | flat  | ``flat.py``     |
| ``mix_grpo``     | MixGRPO (Li et al. 2025)                | flat  | ``flat.py``     |
| ``explicit``     | a given SDE/trained step list           | flat  | ``flat.py``     |
| ``ode``          | deterministic chains (for NFT / AWM)    | flat  | ``flat.py``     |
| ``branch_grpo``  | BranchGRPO (Li et al. 2025)             | tree  | ``branch.py``   |
| ``branch_grpo_mix`` | BranchGRPO-Mix                       | tree  | ``branch.py``   |
| ``tree_grpo``    | TreeGRPO (Ding & Ye 2025)               | tree  | ``tree_grpo.py``|
| ``egrpo``        | E-GRPO (Zhang et al. 2026)              | tree  | ``egrpo.py``    |

**Groups.** ``rollout.group_size`` is the one group-size knob of every method: images per prompt (flat), the
leaves of each tree (BranchGRPO/TreeGRPO: it must equal the product of the branch factors, checked up front) or
the members per consolidated step (E-GRPO). A method returns the key of every group it grew; E-GRPO grows several
groups per key (one per consolidated step), and the trainer counts, filters and trims by key.

Adding a method: subclass :class:`RolloutMethod` (``base.py``) in a new file, decorate it with
:func:`register_method`, import the file in this module, and write a YAML (``docs/architecture.md`` works one through).
Each built-in's settings and config-time checks live in its torch-free spec (``visgen.method_settings``, listed in
``METHOD_SPECS``), which the class here subclasses, so the config is checked without torch.
"""
from .base import METHODS, Grown, KernelSettings, RolloutMethod, method_from_config, register_method
from . import branch, egrpo, flat, tree_grpo  # noqa: E402,F401  (register the built-in methods)

__all__ = ["KernelSettings", "Grown", "RolloutMethod", "METHODS", "register_method", "method_from_config"]
