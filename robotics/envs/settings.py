"""The ``env`` section of a robotics config (``EnvConfig``) and the task table it reads, in a module that imports
neither torch nor MuJoCo: ``grove config show`` and the config's checks build ``RoboticsConfig`` without the
simulator (issue 64). ``robotics.envs.vector`` (``EnvConfig``, ``DEFAULT_TASKS``) and
``robotics.envs.metaworld_env`` (``TASK_INSTRUCTIONS``, ``proprio_dim``, ``RenderSettings``) re-export them, where
they were defined before."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


# Task name -> natural-language instruction (the VLA's language input).
TASK_INSTRUCTIONS: dict[str, str] = {
    "reach-v3": "reach the red goal with the gripper",
    "push-v3": "push the puck to the green goal",
    "door-open-v3": "open the door by pulling the handle",
    "button-press-topdown-v3": "press the button from the top",
    "drawer-close-v3": "close the drawer",
    "drawer-open-v3": "open the drawer",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "button-press-v3": "press the button from the front",
    "door-close-v3": "close the door",
    "plate-slide-v3": "slide the plate into the goal",
    "handle-press-v3": "press the handle down",
    "faucet-open-v3": "turn the faucet open",
    "faucet-close-v3": "turn the faucet closed",
    "coffee-button-v3": "press the coffee machine button",
    "lever-pull-v3": "pull the lever up",
    "dial-turn-v3": "turn the dial",
    "sweep-into-v3": "sweep the puck into the hole",
    "point-reach": "move the white point to the red goal",  # the synthetic env in point.py
}


def proprio_dim(include_goal: bool, include_object: bool = False) -> int:
    return 4 + 3 * int(include_object) + 3 * int(include_goal)


@dataclass
class RenderSettings:
    """How frames are rendered. ``tuned=False`` keeps MuJoCo's default scene (the slow baseline of the bench)."""

    size: int = 64
    cameras: list[str] = field(default_factory=lambda: ["corner"])
    tuned: bool = True


LIBERO_CAMERAS = ("image", "image2")  # = libero_env.CAMERAS' keys (that module imports the simulator)
LIBERO_STATE_DIM = 8
LIBERO_ACTION_DIM = 7

DEFAULT_TASKS = ["reach-v3", "push-v3", "door-open-v3", "button-press-topdown-v3", "drawer-close-v3"]


@dataclass
class EnvConfig:
    """Simulator settings (the ``env`` section of a robotics config)."""

    kind: Literal["metaworld", "libero", "point"] = field(
        default="metaworld", metadata={"help": "metaworld | libero (LIBERO in LeRobot's conventions: 7-d actions, "
                                               "cameras image / image2, 8-d state) | point (the synthetic reaching "
                                               "env: tests, templates)"})
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS),
                             metadata={"help": "Meta-World v3 task names, e.g. [reach-v3, push-v3]; LIBERO: "
                                               "<suite>/<index or name>, or an index / name of env.suite"})
    suite: str = field(default="", metadata={
        "help": "LIBERO suite the tasks belong to when they name none (libero_spatial, libero_object, libero_goal, "
                "libero_10, libero_90)"})
    horizon: int = field(default=150, metadata={"help": "env steps per episode at most"})
    success_mode: Literal["once", "end"] = field(default="once", metadata={
        "help": "once: any successful step (ends the episode) | end: the last step succeeded"})
    image_size: int = field(default=64, metadata={"help": "rendered frame side in pixels"})
    cameras: list[str] = field(default_factory=lambda: ["corner"],
                               metadata={"help": "Meta-World cameras; their frames are stacked as channels"})
    render_tuned: bool = field(default=True, metadata={
        "help": "fast scene (no shadows, reflections, skybox); false = MuJoCo's default scene"})
    include_goal: bool = field(default=False, metadata={
        "help": "append the goal xyz to proprio (the reach goal is ~1 pixel at 64x64)"})
    include_object: bool = field(default=False, metadata={
        "help": "append the object's xyz (Meta-World state 4:7: puck, handle, button) to proprio, before the goal"})
    num_workers: int = field(default=0, metadata={
        "help": "env worker processes; 0 = in-process batched execution"})
    eval_batch: int = field(default=0, metadata={
        "help": "episodes an evaluation runs at once at most (0 = all): a LIBERO env holds ~0.35 GB (the first of a "
                "process ~1.1 GB), so 40 held-out episodes at once want ~15 GB; the results are the same either way"})

    def check(self, where: str = "env") -> None:
        from shared_rl.config import ConfigError

        if self.kind == "point" and self.tasks != ["point-reach"]:
            raise ConfigError(f"{where}.tasks must be [point-reach] when {where}.kind is point, got {self.tasks}")
        if not self.tasks:
            raise ConfigError(f"{where}.tasks must list at least one Meta-World task, e.g. [reach-v3]")
        if self.horizon < 1:
            raise ConfigError(f"{where}.horizon must be >= 1, got {self.horizon}")
        if not self.cameras:
            raise ConfigError(f"{where}.cameras must name at least one camera, e.g. [corner]")
        if self.num_workers < 0 or self.eval_batch < 0:
            raise ConfigError(f"{where}.num_workers and {where}.eval_batch must be >= 0, got {self.num_workers} and "
                              f"{self.eval_batch}")
        if self.kind == "point" and self.include_object:
            raise ConfigError(f"{where}.include_object needs Meta-World (the point env has no object); set it false")
        if self.kind == "libero":
            self._check_libero(where)

    def check_eval_states(self, per_task: int, where: str) -> None:
        """LIBERO's held-out states are the benchmark's 50 fixed init states per task."""
        from shared_rl.config import ConfigError

        if self.kind == "libero" and per_task > 50:
            raise ConfigError(f"{where}.eval_states_per_task is {per_task}; LIBERO holds out its 50 fixed init states "
                              f"per task (training draws fresh scenes), so at most 50")

    def _check_libero(self, where: str) -> None:
        from shared_rl.config import ConfigError

        from .libero_tasks import LiberoUnavailable, canonical_task, check_assets

        check_assets()
        try:
            self.tasks = [canonical_task(t, self.suite) for t in self.tasks]
        except LiberoUnavailable:
            raise
        except ValueError as e:
            raise ConfigError(f"{where}.tasks: {e}") from None
        unknown = [c for c in self.cameras if c not in LIBERO_CAMERAS]
        if unknown:
            raise ConfigError(f"{where}.cameras: LIBERO has no camera {unknown[0]!r}; its cameras are image (agentview) "
                              f"and image2 (the wrist), LeRobot's names")
        if self.include_goal or self.include_object:
            raise ConfigError(f"{where}.include_goal / include_object are Meta-World's; LIBERO's state is LeRobot's 8-d "
                              f"one (end-effector position, axis-angle, gripper)")
    @property
    def image_channels(self) -> int:
        return 3 * len(self.cameras)

    @property
    def proprio_dim(self) -> int:
        if self.kind == "libero":
            return LIBERO_STATE_DIM
        return proprio_dim(self.include_goal, self.include_object)

    @property
    def action_dim(self) -> int:
        """Meta-World and the point env: hand displacement xyz + gripper; LIBERO: LeRobot's 7-d OSC_POSE delta."""
        return LIBERO_ACTION_DIM if self.kind == "libero" else 4

    def render_settings(self) -> RenderSettings:
        return RenderSettings(size=self.image_size, cameras=list(self.cameras), tuned=self.render_tuned)
