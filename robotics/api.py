"""robotics from Python: the policy object you hold, the tasks, optional reward functions of episodes, grove's loop.

    from robotics.api import VLAGRPOTrainer
    from robotics.policies.vla import TinyVLA

    policy = TinyVLA.load_pretrained("assets/metaworld-vla-tiny")        # or a LeRobot SmolVLAPolicy (below)

    def quick(episodes):                                  # an EpisodeBatch -> a value per episode
        return 1.0 - episodes.length / 200

    trainer = VLAGRPOTrainer(policy=policy, tasks=["reach-v3", "push-v3"], reward_funcs=["success", quick],
                             reward_weights=[1.0, 0.1], args={"iterations": 20, "rollout": {"group_size": 8}})
    history = trainer.train()                             # trains `policy` itself
    print(trainer.evaluate()["eval/success"])

- ``policy``: grove's ``TinyVLA`` (e.g. ``TinyVLA.load_pretrained(dir)``), a LeRobot ``PreTrainedPolicy`` (SmolVLA:
  ``SmolVLAPolicy.from_pretrained(dir)``; pass LeRobot's ``preprocessor`` / ``postprocessor`` from
  ``make_pre_post_processors(policy.config, pretrained_path=dir)`` — its normalisation statistics and tokenizer),
  or a path: a tiny-VLA checkpoint directory (``robotics.checkpoint``) or a LeRobot policy directory / cached hub id
  (``robotics.policy: {type: lerobot, path}``). An object is trained in place (``RunContext.objects``,
  ``robotics/held.py``); with ``robotics.policy.lora.rank`` a LeRobot policy gets peft's LoRA layers injected.
- ``tasks``: the env's task names (``robotics.env.tasks``; default: the config's): Meta-World's (``reach-v3``), or
  LIBERO's (``libero_spatial/0``) with a LIBERO config (``config="configs/robotics/libero_grpo.yaml"`` or
  ``robotics.env.kind: libero`` in ``args``; ``grove list`` names both).
- ``reward_funcs``: what the advantage is computed from: ``"success"`` and ``"dense"`` (the domain's own rewards:
  success 0/1, best shaped reward / 10) and callables ``f(episodes) -> [B]`` of a ``robotics.episodes.EpisodeBatch``
  (``tasks``, ``success_once``, ``success_end``, ``dense``, ``length``, ``images``, ``proprio``, ...; a tensor,
  array or list, NaN = missing), each named by its ``__name__`` (metric ``reward/<name>/mean``); ``reward_weights``
  their weights (``advantage.weights``, default 1). The domain's rewards left out are logged, not trained on.
  Default: ``["success"]`` (the config's rewards). Callables need flat groups in the simulator
  (``robotics.rollout.name: flat``).
- ``args``: any part of the config (``{"optim": {"lr": 1e-4}, "robotics": {"env": {"horizon": 100}}}``) or CLI-style
  strings, validated as ``grove train`` does; ``domain: robotics`` is implied. ``config`` (a YAML path, e.g.
  ``configs/robotics/metaworld_grpo.yaml``) is the base ``args`` merge into (default: the robotics defaults).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from shared_rl.api import load_config, merge, removed_if_refused
from shared_rl.config import ConfigError, apply_overrides, load_yaml
from shared_rl.trainer import Trainer

from .held import HELD_PREFIX, is_lerobot_policy

BUILTIN_REWARDS = ("success", "dense")


def _is_lerobot_dir(path: str) -> bool:
    """A LeRobot policy directory (its ``config.json`` names a policy ``type``) or a hub id (not a local path)."""
    p = Path(path)
    if not p.exists():
        from .domain import resolve

        p = resolve(path)
    if p.is_dir():
        cfg = p / "config.json"
        return cfg.is_file() and "type" in json.loads(cfg.read_text())
    return not p.exists() and path.count("/") == 1 and not path.startswith((".", "/"))


def _policy_section(policy: Any) -> tuple[dict[str, Any], Any]:
    """(the ``robotics`` settings that name the policy, the held object or None)."""
    if isinstance(policy, (str, Path)):
        if _is_lerobot_dir(str(policy)):
            return {"policy": {"type": "lerobot", "path": str(policy)}}, None
        return {"checkpoint": str(policy)}, None
    from .policies.vla import TinyVLA

    label = f"{HELD_PREFIX}{type(policy).__name__}"
    if isinstance(policy, TinyVLA):
        return {"checkpoint": label}, policy
    if is_lerobot_policy(policy) or type(policy).__name__ == "LeRobotVLA":
        return {"policy": {"type": "lerobot", "path": label}}, policy
    raise ConfigError(f"robotics.api: policy must be grove's TinyVLA, a LeRobot PreTrainedPolicy or a path, not "
                      f"{type(policy).__name__}")


def _reward_settings(reward_funcs, reward_weights) -> tuple[dict[str, Any], dict[str, float], dict[str, Callable]]:
    """(robotics settings: dense_reward / rewards, advantage weights, the functions by name)."""
    funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
    if not funcs:
        raise ConfigError("reward_funcs is empty: give 'success', 'dense' and/or functions of episodes")
    weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
    section: dict[str, Any] = {}
    given: dict[str, Callable] = {}
    advantage: dict[str, float] = {}
    for fn, w in zip(funcs, weights):
        if isinstance(fn, str):
            if fn not in BUILTIN_REWARDS:
                from shared_rl.registry import did_you_mean

                raise ConfigError(f"reward_funcs: {fn!r} is not a robotics reward{did_you_mean(fn, BUILTIN_REWARDS)}; "
                                  f"the domain's are {list(BUILTIN_REWARDS)}, anything else is a function of episodes")
            name = fn
            if fn == "dense":
                section["dense_reward"] = True
        elif callable(fn):
            name = getattr(fn, "__name__", "reward")
            if name == "<lambda>":
                name = "reward"
            base, n = name, 2
            while name in given or name in BUILTIN_REWARDS or name == "return":
                name, n = f"{base}_{n}", n + 1
            given[name] = fn
        else:
            raise ConfigError(f"reward_funcs: {fn!r} is neither a function of episodes nor one of {list(BUILTIN_REWARDS)}")
        if name in advantage:
            raise ConfigError(f"reward_funcs names {name!r} twice")
        advantage[name] = float(w)
    if given:
        section["rewards"] = list(given)
    if "success" not in advantage:
        advantage["success"] = 0.0  # emitted by every rollout: logged, not trained on
    return section, advantage, given


class VLAGRPOTrainer:
    """``VLAGRPOTrainer(policy, tasks, reward_funcs, args, ...).train()`` — see the module docstring. The method is
    whatever ``args`` configures (GRPO with Flow-GRPO's SDE steps by default; any ``advantage`` / ``loss`` /
    ``robotics.rollout``)."""

    def __init__(self, policy: Any, tasks: Sequence[str] | None = None,
                 reward_funcs: Callable | str | Sequence[Callable | str] | None = None,
                 args: Mapping[str, Any] | Sequence[str] = (), reward_weights: Sequence[float] | None = None,
                 preprocessor: Any = None, postprocessor: Any = None, config: str | Path | None = None,
                 run_dir: str | Path | None = None, log=print) -> None:
        robotics, held = _policy_section(policy)
        if tasks is not None:
            tasks = [tasks] if isinstance(tasks, str) else list(tasks)
            if not tasks:
                raise ConfigError("tasks is empty: give the env's task names (e.g. ['reach-v3'], or ['libero_spatial/0'] "
                                  "with a LIBERO config)")
            robotics["env"] = {"tasks": tasks}
        base: dict[str, Any] = load_yaml(config) if config else {}
        if base.get("domain", "robotics") != "robotics":
            raise ConfigError(f"config {config} is a {base['domain']!r} recipe, not a robotics one")
        base = merge(base, {"domain": "robotics", "robotics": robotics})
        functions: dict[str, Callable] = {}
        if reward_funcs is not None:
            section, advantage, functions = _reward_settings(reward_funcs, reward_weights)
            base = merge(base, {"robotics": section, "advantage": {"weights": advantage}})
        elif reward_weights is not None:
            raise ConfigError("reward_weights weigh reward_funcs; give reward_funcs too")
        data = merge(base, args) if isinstance(args, Mapping) else apply_overrides(base, list(args))
        self.config = load_config(data)
        self.run_dir = Path(run_dir) if run_dir else None
        objects: dict[str, Any] = {"episode_rewards": functions}
        if held is not None:
            objects.update(policy=held, preprocessor=preprocessor, postprocessor=postprocessor)
        elif preprocessor is not None or postprocessor is not None:
            raise ConfigError("preprocessor / postprocessor go with a held LeRobot policy object; a policy path "
                              "brings its own processors")
        self._held = held
        with removed_if_refused(run_dir):  # a policy or env the domain refuses while building leaves no run_dir
            self.trainer = Trainer(self.config, self.run_dir, log=log, objects=objects)
        self._iteration = 0

    @property
    def policy(self):
        """The policy being trained: the caller's object when one was given (for a LeRobot policy, the
        ``PreTrainedPolicy`` itself; ``trainer.domain.policy`` is grove's wrapper around it)."""
        return self._held if self._held is not None else self.trainer.domain.policy

    @property
    def history(self) -> list[dict[str, Any]]:
        return self.trainer.history

    def train(self) -> list[dict[str, Any]]:
        """Run every iteration (evaluation, checkpoints and export as configured); returns the metric records."""
        out = self.trainer.fit()
        self._iteration = self.config.iterations
        return out

    def evaluate(self) -> dict[str, float]:
        """The held-out evaluation of the policy as it is now (deterministic episodes on the evaluation reset
        states: ``eval/success``, ``eval/success/<task>``), as the run's own evaluations compute it."""
        return self.trainer.evaluate(self._iteration)

    def close(self) -> None:
        """Stop the simulator's workers (also done when the process exits)."""
        self.trainer.domain.close()
