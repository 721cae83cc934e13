"""Demonstrations from scripted experts with Gaussian action noise: Meta-World's (``metaworld.policies``) and grove's
LIBERO pick-and-place expert (``envs/libero_expert.py``: libero_spatial, libero_object).

``collect_demos`` runs the expert of each task from training reset states reserved for demonstrations (train
split, indices from ``DEMO_INDEX_OFFSET`` on, so RL training states and evaluation states are never demos),
adds N(0, noise_std²) to every action (then clips to [-1, 1]) and records frames, proprio, state, action and
success. With noise σ=0.3 the experts still solve reach, push, door-open, button-press-topdown and drawer-close
(noisy demos differ in path, not outcome; DESIGN.md §7). ``grove robotics collect`` is ``main(argv)``.
"""
from __future__ import annotations

import time
import warnings

import numpy as np

from shared_rl.errors import ConfigError

from .data import LIBERO_FPS, Episode, export_lerobot, save_episodes
from .envs.metaworld_env import instruction_for, make_key
from .envs.vector import DEFAULT_TASKS, EnvConfig, make_renderer, make_task_env, observed_vectors  # noqa: E402

DEMO_INDEX_OFFSET = 100_000


def expert_for(task: str):
    from metaworld.policies import ENV_POLICY_MAP

    if task not in ENV_POLICY_MAP:
        raise ValueError(f"no scripted expert for {task!r} in metaworld.policies")
    return ENV_POLICY_MAP[task]()


class _MetaWorldDemoExpert:
    def __init__(self, task: str):
        self.policy = expert_for(task)

    def start(self) -> None:
        pass

    def action(self, obs: np.ndarray) -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the experts warn about saturating gains, by design
            return np.asarray(self.policy.get_action(obs), dtype=np.float64)


class _LiberoDemoExpert:
    """The LIBERO expert reads the simulator (object poses, the goal predicate), not the observation."""

    def __init__(self, env):
        from .envs.libero_expert import LiberoScriptedExpert

        self.env, self.policy = env, LiberoScriptedExpert()

    def start(self) -> None:
        self.policy.reset(self.env.env)

    def action(self, obs: np.ndarray) -> np.ndarray:
        return np.asarray(self.policy.act(self.env.env), dtype=np.float64)


def demo_expert(env_cfg: EnvConfig, env):
    """The scripted expert of ``env``'s task: ``start()`` after each reset, ``action(obs)`` every step."""
    if env_cfg.kind == "libero":
        return _LiberoDemoExpert(env)
    return _MetaWorldDemoExpert(env.task)


def libero_expert_success(task: str, states: int, noise: float = 0.0, seed: int = 0, first_state: int = 0,
                          log=None) -> dict:
    """The LIBERO expert on ``states`` of ``task``'s fixed init states (the held-out split, from ``first_state``), in
    grove's env (LeRobot's reset and settle steps, the suite's step limit): success rate, steps to success (the limit
    counted for a failure), the failed states. ``noise``: std of the expert's own Gaussian action noise."""
    from .envs.libero_env import LiberoTaskEnv, episode_limit
    from .envs.libero_expert import LiberoScriptedExpert

    env = LiberoTaskEnv(task)
    expert = LiberoScriptedExpert(noise=noise, seed=seed)
    limit, wins, steps, t0 = episode_limit(task), [], [], time.perf_counter()
    for i in range(first_state, first_state + states):
        env.reset(make_key(0, "eval", i))
        expert.reset(env.env)
        ok = False
        while env.steps < limit and not ok:
            ok = env.step(expert.act(env.env))[2]
        wins.append(ok)
        steps.append(env.steps if ok else limit)
    failed = [first_state + i for i, ok in enumerate(wins) if not ok]
    out = {"task": task, "success_rate": float(np.mean(wins)), "n": states, "mean_steps": float(np.mean(steps)),
           "noise": noise, "failed_states": failed, "wall_s": round(time.perf_counter() - t0, 1)}
    if log is not None:
        log(f"expert {task}: success {out['success_rate']:.2f} ({sum(wins)}/{states}), steps {out['mean_steps']:.0f}, "
            f"noise {noise}, {out['wall_s']:.0f}s, failed {failed}")
    return out


def collect_demos(
    env_cfg: EnvConfig,
    demos_per_task: int = 40,
    noise_std: float = 0.3,
    seed: int = 0,
    only_successful: bool = True,
    max_attempts_factor: int = 3,
    log=print,
    labels: str = "executed",
    task_demos: dict[str, int] | None = None,
) -> list[Episode]:
    """Noisy expert episodes for every task in ``env_cfg.tasks`` (successful ones only unless told otherwise).

    ``labels``: which action each step records. ``executed`` = the noisy action that was executed (the default;
    a policy cloned on it learns the noise too); ``expert`` = DART (Laskey et al. 2017, "DART: Noise Injection
    for Robust Imitation Learning"): the noisy action still drives the env, so the demos visit perturbed states,
    but the label is the expert's clean action at that state, so the clone learns to *correct* the noise.
    ``task_demos`` overrides ``demos_per_task`` for the tasks it names (more demos of a task the clone fails).
    """
    if labels not in ("executed", "expert"):
        raise ConfigError(f"collect labels must be 'executed' or 'expert', got {labels!r}")
    rng = np.random.default_rng(seed)
    episodes: list[Episode] = []
    for task_index, task in enumerate(env_cfg.tasks):
        env = make_task_env(env_cfg, task)
        renderer = make_renderer(env_cfg, env)
        expert = demo_expert(env_cfg, env)
        wanted = (task_demos or {}).get(task, demos_per_task)
        kept, attempts, t0 = 0, 0, time.perf_counter()
        while kept < wanted and attempts < wanted * max_attempts_factor:
            key = make_key(task_index, "train", DEMO_INDEX_OFFSET + attempts)
            attempts += 1
            obs = env.reset(key)
            expert.start()
            frames, pro, states, acts, succ = [], [], [], [], []
            for _ in range(env_cfg.horizon):
                frames.append(renderer.render(env.data))
                proprio, state = observed_vectors(env_cfg, env)
                pro.append(proprio)
                states.append(state)
                a = expert.action(obs)
                clean = np.clip(a, -1.0, 1.0).astype(np.float32)
                a = np.clip(a + rng.normal(0.0, noise_std, size=a.shape), -1.0, 1.0).astype(np.float32)
                obs, _, ok = env.step(a)
                acts.append(clean if labels == "expert" else a)
                succ.append(ok)
                if ok and env_cfg.success_mode == "once":
                    break
            ep = Episode(task=task, instruction=instruction_for(task), images=np.stack(frames),
                         proprio=np.stack(pro), actions=np.stack(acts), success=np.array(succ),
                         states=np.stack(states), key=key)
            if ep.succeeded or not only_successful:
                episodes.append(ep)
                kept += 1
        renderer.close()
        lens = [len(e) for e in episodes if e.task == task]
        log(f"collect {task}: {kept}/{attempts} episodes kept (expert success {kept / max(attempts, 1):.0%} "
            f"with noise {noise_std}), mean length {np.mean(lens) if lens else 0:.0f}, {time.perf_counter() - t0:.1f}s")
    return episodes


def _check_tasks(tasks: list[str]) -> None:
    """Every task must be a Meta-World v3 task with a scripted expert (checked before any env is built)."""
    from metaworld.policies import ENV_POLICY_MAP

    from .envs.metaworld_env import known_tasks

    known = known_tasks()
    unknown = [t for t in tasks if t not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"--tasks: unknown Meta-World task(s) {unknown}{hint}; v3 names look like reach-v3 "
                          f"(grove list shows them all)")
    no_expert = [t for t in tasks if t not in ENV_POLICY_MAP]
    if no_expert:
        raise ConfigError(f"--tasks: no scripted expert for {no_expert} in metaworld.policies")


def _check_libero_expert(tasks: list[str]) -> None:
    """The LIBERO expert picks and places: a task whose BDDL goal is one ``on`` or ``in`` predicate (all of
    libero_spatial and libero_object; libero_goal's bowl-on-stove, bowl-on-cabinet, wine-bottle and cream-cheese
    tasks). Whether it succeeds there is measured, not promised: ``collect`` logs its success rate per task."""
    from .envs.libero_expert import expert_supports
    from .envs.libero_tasks import bddl_file, quiet_robosuite_import

    quiet_robosuite_import()
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    for t in tasks:
        goal = robosuite_parse_problem(bddl_file(t))["goal_state"]
        if not expert_supports(goal):
            raise ConfigError(f"--tasks: grove's LIBERO expert picks and places (one 'on' or 'in' goal); {t}'s goal "
                              f"is {goal}")


def main(argv: list[str] | None = None) -> int:
    """``grove robotics collect``: write noisy expert demonstrations to an ``.npz`` (and optionally LeRobot v3.0).

    Every argument and both outputs are checked before collecting (minutes of simulation), and an existing
    ``--out`` is never overwritten; nothing is written when no episode is kept."""
    from shared_rl.cli import ArgumentParser, check_output_file

    p = ArgumentParser(prog="grove robotics collect", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output .npz file (must not exist)")
    p.add_argument("--env", choices=["metaworld", "libero"], default="metaworld", help="the simulator")
    p.add_argument("--suite", default="", help="LIBERO suite of --tasks given as indices (libero_spatial, libero_object, libero_goal)")
    p.add_argument("--tasks", nargs="+", default=None,
                   help="Meta-World v3 task names (default: the five-task set); LIBERO: indices of --suite or "
                        "<suite>/<index>")
    p.add_argument("--demos-per-task", type=int, default=40)
    p.add_argument("--task-demos", nargs="+", default=[], metavar="TASK=N",
                   help="per-task override of --demos-per-task, e.g. push-v3=160")
    p.add_argument("--noise", type=float, default=0.3, help="std of the Gaussian action noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--horizon", type=int, default=None, help="env steps at most (Meta-World 150; LIBERO: the suite's "
                                                                 "limit, 280 for spatial / object)")
    p.add_argument("--cameras", nargs="+", default=None, help="Meta-World: corner; LIBERO: image image2")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--include-goal", action="store_true", help="append the goal xyz to proprio")
    p.add_argument("--include-object", action="store_true", help="append the object's xyz to proprio (before the goal)")
    p.add_argument("--keep-failures", action="store_true")
    p.add_argument("--labels", choices=["executed", "expert"], default="executed",
                   help="executed: record the noisy action; expert: DART, record the expert's clean action at "
                        "each (noise-perturbed) state")
    p.add_argument("--lerobot", help="also export a LeRobot v3.0 dataset to this (new) directory")
    args = p.parse_args(argv)
    libero = args.env == "libero"
    if args.tasks is None:
        if libero:
            raise ConfigError("--tasks: name the LIBERO tasks, e.g. --suite libero_spatial --tasks 0 1")
        args.tasks = list(DEFAULT_TASKS)
    args.cameras = args.cameras or (["image", "image2"] if libero else ["corner"])
    if libero:
        cfg = EnvConfig(kind="libero", suite=args.suite, tasks=args.tasks, cameras=args.cameras,
                        image_size=args.image_size)
        cfg.check("collect")  # canonical task names, one line for an unknown suite / task / camera
        if args.horizon is None:
            from .envs.libero_tasks import EPISODE_LIMITS, split_task

            args.horizon = max(EPISODE_LIMITS[split_task(t)[0]] for t in cfg.tasks)
        args.tasks = cfg.tasks
    args.horizon = 150 if args.horizon is None else args.horizon
    for flag, value, low in (("--demos-per-task", args.demos_per_task, 1), ("--horizon", args.horizon, 1),
                             ("--image-size", args.image_size, 8)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    task_demos = {}
    for item in args.task_demos:
        task, _, n = item.partition("=")
        if task not in args.tasks or not n.isdigit() or int(n) < 1:
            raise ConfigError(f"--task-demos: {item!r} must be TASK=N with TASK in --tasks {args.tasks} and N >= 1")
        task_demos[task] = int(n)
    if not (args.noise >= 0 and np.isfinite(args.noise)):
        raise ConfigError(f"--noise must be a finite number >= 0, got {args.noise}")
    out = check_output_file(args.out, "--out", suffix=".npz")
    if args.lerobot:
        from .data import check_new_dataset_dir, lerobot_dataset_class

        check_new_dataset_dir(args.lerobot, "--lerobot")
        lerobot_dataset_class()
    if libero:
        _check_libero_expert(args.tasks)
    else:
        _check_tasks(args.tasks)
    cfg = EnvConfig(kind=args.env, tasks=args.tasks, horizon=args.horizon, cameras=args.cameras,
                    image_size=args.image_size, include_goal=args.include_goal, include_object=args.include_object)
    cfg.check("collect")
    eps = collect_demos(cfg, args.demos_per_task, args.noise, args.seed, only_successful=not args.keep_failures,
                        labels=args.labels, task_demos=task_demos)
    if not eps:
        raise ConfigError(f"collect kept no episode: the noisy experts never succeeded within --horizon "
                          f"{args.horizon}; raise --horizon, lower --noise, or pass --keep-failures (nothing was written)")
    path = save_episodes(eps, out)
    print(f"wrote {len(eps)} episodes ({sum(len(e) for e in eps)} frames) to {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if args.lerobot:
        if libero:  # LeRobot's LIBERO layout: image / image2, 20 Hz control
            export_lerobot(eps, args.lerobot, repo_id="grove/libero", fps=LIBERO_FPS, cameras=args.cameras)
        else:
            export_lerobot(eps, args.lerobot)
        print(f"wrote LeRobot v3.0 dataset to {args.lerobot}")
    return 0
