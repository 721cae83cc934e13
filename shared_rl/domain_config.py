"""``DomainConfig``, the base of every domain's settings dataclass, in a module of its own that imports nothing
heavy: a config is read and checked (``grove config show``, the CLI's checks) without torch. Re-exported by
``shared_rl.domain``, where the rest of the domain contract lives."""
from __future__ import annotations


class DomainConfig:
    """Base of every domain's settings dataclass: the config hooks the loader calls, with their defaults. None of
    them may change the config (a config is what the user wrote; derived values are computed on demand)."""

    def check(self, where: str) -> None:
        """Validate this section's own fields; raise ``ConfigError`` with one line naming the key to change."""

    def check_with(self, train_cfg) -> None:
        """Cross-checks against the trainer's sections (``TrainConfig``); raise ``ConfigError``. Must not mutate."""

    def rollout_structure(self, train_cfg) -> str:
        """``"flat"`` or ``"tree"`` (``Rollout.parent`` set): whether rollouts under ``train_cfg`` are trees. The
        loader refuses a tree advantage estimator with flat rollouts, and a critic's with trees, in one line."""
        return "flat"

    def reward_names(self, train_cfg) -> list[str] | None:
        """The reward names a rollout will emit (None: not knowable before a rollout); the loader checks
        ``advantage.weights`` and ``selection.band_reward`` against them (without it only the first rollout would
        find a typo)."""
        return None

    def preflight(self, train_cfg) -> None:
        """Checks that read the run's small inputs (prompt files, datasets, importable ``module:function`` rewards,
        reward arguments) and whether the configured rewards can score them; run by ``shared_rl.preflight`` before
        any model loads and before the run directory exists; raise ``ConfigError``."""

    def default_reward_weights(self) -> dict[str, float]:
        """Reward name -> weight when ``advantage.weights`` is empty (e.g. ``llm.rewards[].weight``)."""
        return {}

    def parameter_groups(self, train_cfg):
        """The parameters the domain will hold, as ``shared_rl.memory_estimate.ParameterGroup`` s (trained or
        frozen, their dtype, whether fsdp2 shards them), counted without reading weights (on the meta device, from
        the model's config), for ``--dry-run``'s memory estimate; None when the domain cannot count them here."""
        return None

    def policy_loss(self, train_cfg):
        """The policy loss (a ``config.PolicyLossChoice``) the domain's own method implies, or None. Used when
        ``loss.policy_loss`` is null (``TrainConfig.policy_loss_choice``): visgen's likelihood-free objectives (NFT,
        AWM) bring their loss with them, so a recipe chooses the method once."""
        return None
