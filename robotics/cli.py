"""``grove robotics <tool>``: collect demonstrations, convert to/from LeRobot v3.0."""
from __future__ import annotations

import argparse
import sys


def _to_lerobot(argv: list[str]) -> int:
    from .data import export_lerobot, load_episodes

    p = argparse.ArgumentParser(prog="grove robotics to-lerobot", description="export an episodes .npz as LeRobot v3.0")
    p.add_argument("episodes")
    p.add_argument("out_dir")
    p.add_argument("--repo-id", default="grove/metaworld")
    a = p.parse_args(argv)
    export_lerobot(load_episodes(a.episodes), a.out_dir, a.repo_id)
    print(f"wrote {a.out_dir}")
    return 0


def _from_lerobot(argv: list[str]) -> int:
    from .data import import_lerobot, save_episodes

    p = argparse.ArgumentParser(prog="grove robotics from-lerobot", description="import a LeRobot v3.0 dataset (image features)")
    p.add_argument("root")
    p.add_argument("out")
    a = p.parse_args(argv)
    eps = import_lerobot(a.root)
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
    print(f"grove robotics: unknown tool {tool!r}; choose one of {', '.join(TOOLS)}", file=sys.stderr)
    return 2
