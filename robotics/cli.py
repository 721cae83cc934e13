"""``grove robotics <tool>``: collect demonstrations, convert to/from LeRobot v3.0.

Every tool keeps grove's error contract: a mistake (an unknown task, a missing or garbage input, an output that
exists already) is a ``ConfigError``, which ``grove`` prints as one line with exit code 2, and it is found before
anything is written (``grove robotics collect`` checks its outputs before it spends minutes collecting).
"""
from __future__ import annotations

import sys

from shared_rl.cli import ArgumentParser, check_output_file
from shared_rl.errors import ConfigError


def _add_output(p: ArgumentParser, help_: str) -> None:
    """The output as the last positional or, as ``collect`` spells it, ``--out``."""
    p.add_argument("out", nargs="?", help=help_)
    p.add_argument("--out", dest="out_option", metavar="OUT", help=f"the same as the positional OUT ({help_})")


def _output(a, prog: str) -> str:
    if a.out is not None and a.out_option is not None and a.out != a.out_option:
        raise ConfigError(f"{prog}: the output is given twice ({a.out!r} and --out {a.out_option!r}); give one")
    out = a.out if a.out is not None else a.out_option
    if out is None:
        raise ConfigError(f"{prog}: the output is required: {prog} INPUT OUT (or --out OUT)")
    return out


def _to_lerobot(argv: list[str]) -> int:
    from .data import check_new_dataset_dir, export_lerobot, lerobot_dataset_class, load_episodes

    prog = "grove robotics to-lerobot"
    p = ArgumentParser(prog=prog, description="export an episodes .npz as LeRobot v3.0")
    p.add_argument("episodes", help="episodes .npz (from grove robotics collect)")
    _add_output(p, "the new dataset directory (must not exist; LeRobot creates it)")
    p.add_argument("--repo-id", default="grove/metaworld")
    a = p.parse_args(argv)
    out_dir = _output(a, prog)
    check_new_dataset_dir(out_dir, "out_dir")
    lerobot_dataset_class()  # installed? (before reading anything)
    export_lerobot(load_episodes(a.episodes), out_dir, a.repo_id)
    print(f"wrote {out_dir}")
    return 0


def _from_lerobot(argv: list[str]) -> int:
    from .data import import_lerobot, save_episodes

    prog = "grove robotics from-lerobot"
    p = ArgumentParser(prog=prog, description="import a LeRobot v3.0 dataset (image features)")
    p.add_argument("root", help="the LeRobot dataset directory (with meta/info.json)")
    _add_output(p, "the episodes .npz to write (must not exist)")
    a = p.parse_args(argv)
    a.out = _output(a, prog)
    check_output_file(a.out, "out", suffix=".npz")
    eps = import_lerobot(a.root)
    if not eps:
        raise ConfigError(f"{a.root}: the dataset holds no episodes")
    save_episodes(eps, a.out)
    print(f"wrote {len(eps)} episodes to {a.out}")
    return 0


TOOLS = {
    "collect": ("noisy scripted-expert demonstrations -> .npz (and LeRobot)", "robotics.collect:main"),
    "to-lerobot": ("export an episodes .npz as a LeRobot v3.0 dataset", None),
    "from-lerobot": ("import a LeRobot v3.0 dataset into an episodes .npz", None),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: grove robotics {" + ",".join(TOOLS) + "} ...\n")
        for name, (help_, _) in TOOLS.items():
            print(f"  {name:14s} {help_}")
        return 0
    tool, rest = argv[0], argv[1:]
    if tool == "collect":
        from .collect import main as collect_main

        return collect_main(rest)
    if tool == "to-lerobot":
        return _to_lerobot(rest)
    if tool == "from-lerobot":
        return _from_lerobot(rest)
    raise ConfigError(f"grove robotics: unknown tool {tool!r}; choose one of {', '.join(TOOLS)}")
