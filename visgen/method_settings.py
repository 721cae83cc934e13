"""The rollout methods of ``visgen.methods`` as a config needs them — each method's settings (the step plans of
the flat methods, BranchGRPO's, TreeGRPO's, E-GRPO's), its structure and its config-time checks — in a module that
imports no torch, so ``grove config show`` and the config's checks answer without the tensor code (issue 64).

One definition of each: the tensor classes subclass these (``visgen.methods.RolloutMethod`` is a
:class:`MethodSpec` with ``grow`` / ``after_rewards``; ``visgen.plans.FlowGRPOPlan`` is a
:class:`FlowGRPOPlanSettings` with ``build``), and the settings dataclasses are re-exported where they were defined
(``visgen.methods.branch.BranchSettings``, ...). ``METHOD_SPECS`` names the built-ins; ``visgen.config`` builds a
method from it while ``visgen.methods`` is not imported, and from the live ``visgen.methods.METHODS`` once it is (a
Python caller that registered a method of its own, a training run). tests/core/test_part_index.py checks the two
agree (names, structure, settings fields) and that ``config show`` of a visgen recipe imports no torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from shared_rl.config import from_dict
from shared_rl.errors import ConfigError
from shared_rl.kernel_settings import DEFAULT_NOISE_LEVEL
from shared_rl.part_index import estimator_names


def require(condition: bool, message: str) -> None:
    """A settings check: ``ConfigError(message)`` (one actionable line) unless ``condition``."""
    if not condition:
        raise ConfigError(message)


@dataclass
class KernelSettings:
    """How stochastic steps are drawn and scored (the domain's sampling settings, the same for every method)."""

    kernel: str = "sde"
    noise_level: float = DEFAULT_NOISE_LEVEL
    reduction: str = "mean"
    micro_batch: int = 0  # samples per transformer forward while sampling (0: the whole level)
    shared_noise: bool = False  # flat methods: one initial noise per prompt for its whole group


# ------------------------------------------------------------------------------------------- step plans (flat)
def check_masks(sde: list[bool], train: list[bool], where: str = "visgen.method[explicit]") -> None:
    """The invariants of every plan, as the config check states them (one line, exit 2; ``visgen.plans.StepPlan``
    checks them on its tensors too): a trained step is stochastic, and the final step is never trained (its near-zero
    noise makes the density explode)."""
    if any(t and not s for s, t in zip(sde, train)):
        bad = [i for i, (s, t) in enumerate(zip(sde, train)) if t and not s]
        raise ConfigError(f"{where} trains deterministic (ODE) steps {bad}; trained steps must be SDE steps (list them "
                          "in sde_steps too)")
    if train and train[-1]:
        raise ConfigError(f"{where} trains the final denoising step {len(train) - 1}; its near-zero noise makes the "
                          "density explode: leave it out of train_steps")


class PlanSettings:
    """Base class of the step plans' settings: a dataclass with a registered ``name``; ``check_fits`` raises when
    the plan cannot be built on a grid of ``num_steps``, ``trains_any`` says whether it trains a step there."""

    name: ClassVar[str] = ""

    @staticmethod
    def _need_steps(num_steps: int, minimum: int = 2) -> None:
        require(num_steps >= minimum, f"a step plan needs at least {minimum} denoising steps, got {num_steps}")

    def check_fits(self, num_steps: int) -> None:
        self._need_steps(num_steps)

    def trains_any(self, num_steps: int) -> bool:
        return True  # the SDE plans train at least one step whenever they fit


@dataclass
class ODEPlanSettings(PlanSettings):
    """Deterministic sampling: no SDE step, nothing trained."""

    name: ClassVar[str] = "ode"
    ode_solver: ClassVar[str] = "euler"

    def check_fits(self, num_steps: int) -> None:
        """Any grid fits (nothing is stochastic)."""

    def trains_any(self, num_steps: int) -> bool:
        return False


@dataclass
class DPM2PlanSettings(ODEPlanSettings):
    """Deterministic sampling by the multistep DPM-Solver++(2M) (``shared_rl.flow_kernels.dpm2_step``): DiffusionOPSD's
    and DiffusionNFT's reference rollout sampler (``solver: dpm2``); no SDE step, nothing trained."""

    name: ClassVar[str] = "dpm2"
    ode_solver: ClassVar[str] = "dpm2"


@dataclass
class FlowGRPOPlanSettings(PlanSettings):
    """All steps SDE; train ``min(int(train_fraction * T), T - 1)`` steps per sample.

    select: ``"first"`` trains the first (high-noise) steps as Flow-GRPO's ``timestep_fraction`` does;
    ``"random"`` trains a random subset per sample (drawn from the first T - 1 steps).
    """

    name: ClassVar[str] = "flow_grpo"
    train_fraction: float = field(default=1.0,
                                  metadata={"help": "fraction of the T denoising steps trained per sample (capped at "
                                                    "T-1)"})
    select: Literal["first", "random"] = field(default="first",
                                               metadata={"help": "'first': the first (high-noise) steps, as "
                                                                 "Flow-GRPO's timestep_fraction; 'random': a random "
                                                                 "subset per sample"})

    def __post_init__(self) -> None:
        require(0.0 < self.train_fraction <= 1.0, f"flow_grpo.train_fraction must be in (0, 1], got {self.train_fraction}")
        require(self.select in ("first", "random"), f"flow_grpo.select must be 'first' or 'random', got {self.select!r}")

    def num_trained(self, num_steps: int) -> int:
        return max(1, min(int(self.train_fraction * num_steps), num_steps - 1))


@dataclass
class DanceGRPOPlanSettings(PlanSettings):
    """All steps SDE; each sample trains its own random ``train_fraction`` of the steps (DanceGRPO: 0.6)."""

    name: ClassVar[str] = "dance_grpo"
    train_fraction: float = field(default=0.6,
                                  metadata={"help": "fraction of the steps trained, a fresh random subset per sample "
                                                    "(DanceGRPO: 0.6)"})

    def __post_init__(self) -> None:
        require(0.0 < self.train_fraction <= 1.0, f"dance_grpo.train_fraction must be in (0, 1], got {self.train_fraction}")


@dataclass
class FlowGRPOFastPlanSettings(PlanSettings):
    """SDE (trained) only in a random window of ``min_window..max_window`` steps, ODE elsewhere.

    The window lies inside ``[range_start, range_end)`` (``range_end`` None: the first half of the schedule, at
    least ``max_window`` steps) and never touches the final step.
    """

    name: ClassVar[str] = "flow_grpo_fast"
    min_window: int = field(default=1, metadata={"help": "smallest SDE window (consecutive steps)"})
    max_window: int = field(default=3, metadata={"help": "largest SDE window"})
    range_start: int = field(default=0, metadata={"help": "first grid step a window may start at"})
    range_end: int | None = field(default=None,
                                  metadata={"help": "windows end before this grid step (null: half the schedule)"})
    per_sample: bool = field(default=False,
                             metadata={"help": "draw a window per sample instead of one per rollout call"})

    def __post_init__(self) -> None:
        require(1 <= self.min_window <= self.max_window,
               f"flow_grpo_fast needs 1 <= min_window <= max_window, got {self.min_window}, {self.max_window}")
        require(self.range_start >= 0, f"flow_grpo_fast.range_start must be >= 0, got {self.range_start}")

    def bounds(self, num_steps: int) -> tuple[int, int]:
        end = self.range_end if self.range_end is not None else max(num_steps // 2, self.range_start + self.max_window)
        end = min(end, num_steps - 1)  # the final step is never in the window
        require(end - self.range_start >= self.max_window,
               f"flow_grpo_fast: range [{self.range_start}, {end}) of {num_steps} steps cannot hold a window of "
               f"{self.max_window}; lower max_window or widen the range")
        return self.range_start, end

    def check_fits(self, num_steps: int) -> None:
        self._need_steps(num_steps)
        self.bounds(num_steps)


@dataclass
class MixGRPOPlanSettings(PlanSettings):
    """MixGRPO sliding window: SDE (trained) inside ``[start, start + window_size)``, ODE elsewhere.

    The window moves inside ``[left_boundary, right_boundary)`` (None: the last step is excluded).
    progressive: ``start = left + shift * (iteration // iters_per_shift)``, clamped at the right end (or wrapped
    back to the left boundary with ``roll_back``); random: a uniform start drawn from ``generator`` per iteration.
    """

    name: ClassVar[str] = "mix_grpo"
    window_size: int = field(default=4, metadata={"help": "SDE steps in the sliding window"})
    shift: int = field(default=1, metadata={"help": "steps the window moves toward low noise per move"})
    iters_per_shift: int = field(default=25, metadata={"help": "iterations between moves (progressive schedule)"})
    schedule: Literal["progressive", "random"] = field(default="progressive",
                                                       metadata={"help": "'progressive': slide with the iteration; "
                                                                         "'random': a uniform start every iteration"})
    left_boundary: int = field(default=0, metadata={"help": "the window's first possible start step"})
    right_boundary: int | None = field(default=None,
                                       metadata={"help": "the window's last possible end step (null: T-1)"})
    roll_back: bool = field(default=False,
                            metadata={"help": "restart at the left boundary after reaching the right one (else stay "
                                              "there)"})

    def __post_init__(self) -> None:
        require(self.window_size >= 1, f"mix_grpo.window_size must be >= 1, got {self.window_size}")
        require(self.shift >= 1, f"mix_grpo.shift must be >= 1, got {self.shift}")
        require(self.iters_per_shift >= 1, f"mix_grpo.iters_per_shift must be >= 1, got {self.iters_per_shift}")
        require(self.schedule in ("progressive", "random"),
               f"mix_grpo.schedule must be 'progressive' or 'random', got {self.schedule!r}")
        require(self.left_boundary >= 0, f"mix_grpo.left_boundary must be >= 0, got {self.left_boundary}")

    def bounds(self, num_steps: int) -> tuple[int, int]:
        right = num_steps - 1 if self.right_boundary is None else min(self.right_boundary, num_steps - 1)
        require(right - self.left_boundary >= self.window_size,
               f"mix_grpo: window_size {self.window_size} does not fit in steps [{self.left_boundary}, {right}) of "
               f"{num_steps} (the final step is never trained); lower window_size or raise num_inference_steps")
        return self.left_boundary, right

    def check_fits(self, num_steps: int) -> None:
        self._need_steps(num_steps)
        self.bounds(num_steps)


@dataclass
class ExplicitPlanSettings(PlanSettings):
    """Given step indices: ``sde_steps`` (None: all) and ``train_steps`` (None: all SDE steps but the last)."""

    name: ClassVar[str] = "explicit"
    sde_steps: list[int] | None = field(default=None, metadata={"help": "grid steps that are SDE (null: all)"})
    train_steps: list[int] | None = field(default=None,
                                          metadata={"help": "grid steps that are trained (null: every SDE step but the "
                                                            "last)"})

    def masks(self, num_steps: int) -> tuple[list[bool], list[bool]]:
        """``(sde, train)``: one flag per grid step (what ``visgen.plans.ExplicitPlan.build`` broadcasts)."""
        if self.sde_steps is None:
            sde = [True] * num_steps
        else:
            require(all(0 <= s < num_steps for s in self.sde_steps), f"explicit.sde_steps out of range 0..{num_steps - 1}")
            sde = [i in set(self.sde_steps) for i in range(num_steps)]
        if self.train_steps is None:
            train = sde[:-1] + [False]
        else:
            require(all(0 <= s < num_steps for s in self.train_steps),
                    f"explicit.train_steps out of range 0..{num_steps - 1}")
            train = [i in set(self.train_steps) for i in range(num_steps)]
        return sde, train

    def check_fits(self, num_steps: int) -> None:
        sde, train = self.masks(num_steps)
        check_masks(sde, train)

    def trains_any(self, num_steps: int) -> bool:
        return any(self.masks(num_steps)[1])



# ------------------------------------------------------------------------------------------- method settings
@dataclass
class BranchSettings:
    """BranchGRPO. ``split_steps`` branch ``factor`` ways (one number for all, or one per split)."""

    split_steps: list[int] = field(default_factory=lambda: [0, 2, 4, 6],
                                   metadata={"help": "grid steps where every node branches (strictly increasing, "
                                                     "before the final step)"})
    factor: list[int] = field(default_factory=lambda: [2],
                              metadata={"help": "children per split: one number for all splits, or one per split"})
    split_noise_scale: float = field(default=1.0,
                                     metadata={"help": "noise-level multiplier on split steps (the stored log-prob "
                                                       "uses the scaled std)"})
    fusion: Literal["mean", "logp_softmax"] = field(default="mean",
                                                    metadata={"help": "node value from the leaves below: 'mean' of "
                                                                      "their rewards (the reference's default), or "
                                                                      "'logp_softmax' (its --tree_prob_weighted: "
                                                                      "children weighted by a softmax of their split "
                                                                      "step's log-prob / fusion_temperature)"})
    fusion_temperature: float = field(default=1.0,
                                      metadata={"help": "logp_softmax: softmax temperature over siblings' split-step "
                                                        "log-probs (the reference's 1); larger = closer to the "
                                                        "mean"})
    width_prune: Literal["none", "ratio", "best_worst"] = field(default="none",
                                                                metadata={"help": "train only some leaf edges: 'ratio' "
                                                                                  "(top width_keep by |advantage|) or "
                                                                                  "'best_worst'"})
    width_keep: float = field(default=0.5,
                              metadata={"help": "fraction of leaf edges trained per tree with width_prune: ratio"})
    depth_prune: list[int] = field(default_factory=list,
                                   metadata={"help": "[lo, hi): edges into depths lo..hi-1 are not trained ([] = none)"})
    depth_prune_slide_every: int = field(default=0,
                                         metadata={"help": "> 0: the depth window moves one depth deeper every this "
                                                           "many iterations"})
    prune_reward: Optional[str] = field(default=None,
                                        metadata={"help": "reward output pruning ranks by (null: the first)"})
    # tree estimator that pruning ranks edges by; None: advantage.estimator (BranchGRPO.with_trainer)
    prune_estimator: Optional[str] = field(default=None,
                                           metadata={"help": "tree estimator pruning ranks edges by (null: "
                                                             "advantage.estimator)"})

    def factors(self) -> list[int]:
        f = list(self.factor)
        return f * len(self.split_steps) if len(f) == 1 else f

    def leaves(self) -> int:
        return math.prod(self.factors())

    def check(self, where: str) -> None:
        require(len(self.split_steps) >= 1, f"{where}.split_steps must list at least one grid step, e.g. [0, 2, 4, 6]")
        require(sorted(set(self.split_steps)) == list(self.split_steps),
             f"{where}.split_steps must be strictly increasing, got {self.split_steps}")
        require(len(self.factor) in (1, len(self.split_steps)),
             f"{where}.factor must be one number or one per split step ({len(self.split_steps)}), got {self.factor}")
        require(all(f >= 1 for f in self.factor), f"{where}.factor values must be >= 1, got {self.factor}")
        require(self.split_noise_scale > 0, f"{where}.split_noise_scale must be > 0, got {self.split_noise_scale}")
        require(0 < self.width_keep <= 1, f"{where}.width_keep must be in (0, 1], got {self.width_keep}")
        require(len(self.depth_prune) in (0, 2), f"{where}.depth_prune must be [] or [lo, hi), got {self.depth_prune}")
        if self.depth_prune:
            require(1 <= self.depth_prune[0] < self.depth_prune[1],
                 f"{where}.depth_prune must be [lo, hi) with 1 <= lo < hi (depth 1 = the first edges), got {self.depth_prune}")
        require(self.fusion_temperature > 0, f"{where}.fusion_temperature must be > 0, got {self.fusion_temperature}")
        if self.prune_estimator is not None:
            require(self.prune_estimator in estimator_names("tree"), f"{where}.prune_estimator must be a tree estimator "
                 f"({estimator_names('tree')}), got {self.prune_estimator!r}")


@dataclass
class BranchMixSettings(BranchSettings):
    """BranchGRPO-Mix: SDE (trained) only at split steps and in ``sde_windows``; ODE (untrained) elsewhere."""

    sde_windows: list[list[int]] = field(default_factory=list,
                                         metadata={"help": "[[lo, hi), ...] extra SDE (trained) grid steps besides the "
                                                           "split steps"})

    def check(self, where: str) -> None:
        super().check(where)
        for w in self.sde_windows:
            require(len(w) == 2 and 0 <= w[0] < w[1], f"{where}.sde_windows entries must be [lo, hi), got {w}")


@dataclass
class TreeGRPOSettings:
    branch: list[int] = field(default_factory=lambda: [2, 2, 2, 2],
                              metadata={"help": "branch factor of each SDE-window step (leaves = their product = "
                                                "rollout.group_size)"})
    window_start: Optional[int] = field(default=None,
                                        metadata={"help": "first window step (null: random per rollout call within the "
                                                          "range)"})
    range_start: int = field(default=0, metadata={"help": "first grid step a random window may start at"})
    range_end: Optional[int] = field(default=None,
                                     metadata={"help": "random windows end before this grid step (null: the first half "
                                                       "of the schedule)"})

    def check(self, where: str) -> None:
        require(len(self.branch) >= 1 and all(b >= 1 for b in self.branch),
             f"{where}.branch must list factors >= 1 (one per window step), got {self.branch}")
        require(self.range_start >= 0, f"{where}.range_start must be >= 0, got {self.range_start}")

    def leaves(self) -> int:
        return math.prod(self.branch)

    def bounds(self, num_steps: int, where: str = "visgen.method[tree_grpo]") -> tuple[int, int]:
        size = len(self.branch)
        end = self.range_end if self.range_end is not None else max(num_steps // 2, self.range_start + size)
        end = min(end, num_steps - 1)
        require(end - self.range_start >= size, f"{where}: a window of {size} steps does not fit in grid steps "
             f"[{self.range_start}, {end}) of {num_steps} (the final step is never trained)")
        return self.range_start, end


@dataclass
class EGRPOSettings:
    threshold: Optional[float] = field(default=None,
                                       metadata={"help": "per-element entropy tau in nats a merged step must reach "
                                                         "(null: the first eligible step's entropy)"})
    max_merge: int = field(default=4, metadata={"help": "at most this many grid steps per consolidated step"})
    start: int = field(default=0, metadata={"help": "first eligible grid step"})
    train_fraction: float = field(default=0.5,
                                  metadata={"help": "consolidated steps start in the first ceil(fraction * T) grid "
                                                    "steps"})
    max_groups: int = field(default=0, metadata={"help": "keep only the first N consolidated steps (0: all)"})
    schedule: list[list[int]] = field(default_factory=list,
                                      metadata={"help": "manual [[i, k], ...]: SDE step sigma_i -> sigma_{i+k} "
                                                        "(overrides the threshold)"})
    granularities: list[int] = field(default_factory=lambda: [1, 2], metadata={
        "help": "ODE strides of the tails each member is scored by (the reference's granular_list [1, 2]): 1 is "
                "the image itself, g > 1 a coarser tail scored as <output>@g<g>; the advantage sums their z-scores "
                "(advantage.multi_reward: normalize_then_sum). [1]: one granularity"})

    def check(self, where: str) -> None:
        if self.max_merge < 1:
            raise ConfigError(f"{where}.max_merge must be >= 1, got {self.max_merge}")
        if not 0 < self.train_fraction <= 1:
            raise ConfigError(f"{where}.train_fraction must be in (0, 1], got {self.train_fraction}")
        if self.start < 0 or self.max_groups < 0:
            raise ConfigError(f"{where}.start and max_groups must be >= 0")
        for item in self.schedule:
            if len(item) != 2 or item[0] < 0 or item[1] < 1:
                raise ConfigError(f"{where}.schedule entries must be [grid step i >= 0, merged steps k >= 1], got {item}")
        g = list(self.granularities)
        if not g or g[0] != 1 or len(set(g)) != len(g) or any(x < 1 for x in g):
            raise ConfigError(f"{where}.granularities must start with 1 (the image itself) and list distinct strides "
                              f">= 1, e.g. [1, 2]; got {self.granularities}")

    def check_steps(self, num_steps: int, where: str) -> None:
        if self.schedule:
            end = -1
            for i, k in self.schedule:
                if i < end:
                    raise ConfigError(f"{where}.schedule steps overlap or are out of order: {self.schedule}")
                if i + k > num_steps - 1:
                    raise ConfigError(f"{where}.schedule step {[i, k]} reaches the final grid step {num_steps - 1}, "
                                      "which is never trained")
                end = i + k
        elif self.start >= num_steps - 1:
            raise ConfigError(f"{where}.start must be < {num_steps - 1}, got {self.start}")


# ------------------------------------------------------------------------------------------- methods
class MethodSpec:
    """A rollout method as the config sees it: ``name``, its ``settings_class``, whether its rollouts are trees,
    and its checks. ``visgen.methods.RolloutMethod`` adds the sampling (``grow``) and the hooks after the rewards."""

    name: ClassVar[str] = ""
    structure: ClassVar[Literal["flat", "tree"]] = "tree"
    settings_class: ClassVar[type] = object

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        """Validate against the denoising-step count and ``rollout.group_size`` (ConfigError, one line)."""

    def with_trainer(self, train_cfg, where: str) -> "MethodSpec":
        """This method as the trainer's sections ``train_cfg`` complete it (a new method, or ``self``; the config
        is never changed), checked against them (ConfigError, one line)."""
        return self

    def trains_steps(self, num_steps: int) -> bool:
        """Whether the rollouts have trained SDE steps (what the log-prob objective recomputes)."""
        return True

    def reward_granularities(self) -> list[int]:
        """ODE strides > 1 at which the leaves are scored again (``Grown.granular_latents``; E-GRPO), none by
        default."""
        return []

    def describe(self) -> str:
        return self.name


class FlatSpec(MethodSpec):
    """``group_size`` independent chains per prompt, every chain running the plan's SDE/ODE steps."""

    structure = "flat"

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        self.settings.check_fits(num_steps)  # raises if the plan cannot be built on this grid

    def trains_steps(self, num_steps: int) -> bool:
        """Whether the plan trains any SDE step (the log-prob objective needs one; NFT/AWM do not)."""
        return self.settings.trains_any(num_steps)


# one flat method per plan, named by the plan (``ode``: the sampler of the likelihood-free objectives, NFT / AWM;
# ``dpm2``: the same by DPM-Solver++(2M), DiffusionOPSD's)
FLAT_PLANS: tuple[type[PlanSettings], ...] = (FlowGRPOPlanSettings, DanceGRPOPlanSettings, FlowGRPOFastPlanSettings,
                                              MixGRPOPlanSettings, ExplicitPlanSettings, ODEPlanSettings,
                                              DPM2PlanSettings)
FLAT_SPECS: dict[str, type[FlatSpec]] = {
    p.name: type(f"{p.__name__[:-len('PlanSettings')]}Spec", (FlatSpec,),
                 {"name": p.name, "settings_class": p, "__doc__": p.__doc__}) for p in FLAT_PLANS}


class BranchGRPOSpec(MethodSpec):
    """BranchGRPO: one tree per prompt, branching at ``split_steps``; SDE on every non-final step."""

    name = "branch_grpo"
    settings_class = BranchSettings
    mix = False

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        s = self.settings
        require(all(0 <= st < num_steps - 1 for st in s.split_steps),
             f"{where}.split_steps must lie in 0..{num_steps - 2} (the final step cannot branch), got {s.split_steps}")
        require(group_size is None or group_size == s.leaves(), f"rollout.group_size is {group_size} but {where} grows {s.leaves()} leaves per "
             f"tree (factors {s.factors()}); set rollout.group_size: {s.leaves()}")

    def with_trainer(self, train_cfg, where: str) -> "BranchGRPOSpec":
        """Width pruning without its own ``prune_estimator`` ranks edges by the training estimator (pruning =
        training), which must then be a tree estimator."""
        s = self.settings
        if s.prune_estimator is not None or s.width_prune == "none":
            return self
        if train_cfg.advantage.kind != "tree":
            raise ConfigError(f"{where}.width_prune ranks edges by a tree estimator; advantage.estimator is "
                              f"{train_cfg.advantage.estimator.name!r}: set prune_estimator (one of "
                              f"{estimator_names('tree')})")
        return type(self)(dataclasses.replace(s, prune_estimator=train_cfg.advantage.estimator.name))


class BranchGRPOMixSpec(BranchGRPOSpec):
    """BranchGRPO-Mix: SDE only at split steps and in ``sde_windows``; ODE (untrained) elsewhere."""

    name = "branch_grpo_mix"
    settings_class = BranchMixSettings
    mix = True


class TreeGRPOSpec(MethodSpec):
    """TreeGRPO: shared initial noise per prompt, branching inside one SDE window."""

    name = "tree_grpo"
    settings_class = TreeGRPOSettings

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        s = self.settings
        s.bounds(num_steps, where)
        if s.window_start is not None:
            lo = s.window_start
            require(0 <= lo and lo + len(s.branch) <= num_steps - 1,
                 f"{where}.window_start {lo} + {len(s.branch)} steps must end before the final step")
        require(group_size is None or group_size == s.leaves(), f"rollout.group_size is {group_size} but {where} grows {s.leaves()} leaves per "
             f"tree (branch {s.branch}); set rollout.group_size: {s.leaves()}")


class EGRPOSpec(MethodSpec):
    """E-GRPO: one group of ``rollout.group_size`` members per (prompt, consolidated SDE step)."""

    name = "egrpo"
    settings_class = EGRPOSettings

    def check(self, num_steps: int, group_size: int, where: str) -> None:
        self.settings.check_steps(num_steps, where)
        if group_size is not None and group_size < 2:
            raise ConfigError(f"rollout.group_size must be >= 2 (members per consolidated step), got {group_size}")

    def reward_granularities(self) -> list[int]:
        return [g for g in self.settings.granularities if g > 1]


METHOD_SPECS: dict[str, type[MethodSpec]] = {
    **FLAT_SPECS, **{c.name: c for c in (BranchGRPOSpec, BranchGRPOMixSpec, TreeGRPOSpec, EGRPOSpec)}}

# names that earlier configs used, and what replaced them (a one-line error beats a silent default)
RENAMED = {"branch": "branch_grpo", "tree": "tree_grpo", "none": "flow_grpo"}


def method_from_registry(registry: dict[str, type], config: dict[str, Any] | str,
                         where: str = "visgen.method") -> Any:
    """``{"name": ..., **that method's fields}`` -> the method of ``registry`` (``METHOD_SPECS`` or the live
    ``visgen.methods.METHODS``) with its settings; unknown names/fields are ConfigErrors."""
    if isinstance(config, str):
        config = {"name": config}
    if not isinstance(config, dict):
        raise ConfigError(f"{where} must be a mapping like {{name: flow_grpo, train_fraction: 0.3}}, got {config!r}")
    config = dict(config)
    name = config.pop("name", None)
    if name not in registry:
        if name in RENAMED:
            raise ConfigError(f"{where}.name {name!r} is now {RENAMED[name]!r}")
        close = difflib.get_close_matches(str(name), list(registry), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{where}.name {name!r} is unknown{hint}; choose one of {sorted(registry)}")
    cls = registry[name]
    return cls(from_dict(cls.settings_class, config, f"{where}[{name}]"))
