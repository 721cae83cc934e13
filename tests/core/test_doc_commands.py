"""Every ``grove train`` / ``grove pretrain`` command the docs show (also as ``accelerate launch -m shared_rl.cli
train``) parses: README.md, every page under docs/ and
the header comment of every config under configs/. "Parses" means what ``grove train --dry-run`` checks before it
reads any input file: the config exists, each ``key=value`` override applies, and the result validates (unknown
keys, types, ranges, batch arithmetic; a supervised job's own settings). Run in this process, without the inputs'
checks (assets a recipe's header says how to make need not exist yet), so it is fast.

Placeholders are left out: a command whose config is not a path (``grove train CONFIG``, ``--resume RUN``), and an
override whose value is one (``seed=S``, ``robotics.checkpoint=CLONE``, ``$n``).
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from shared_rl.cli import DEFAULT_CONFIG
from shared_rl.config import apply_overrides, check_supervised, load_train_config, load_yaml

ROOT = Path(__file__).resolve().parents[2]
JOINED = "\x1f"  # where a line break was joined away
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(/.*)?$|\$")  # S, N, DIR, CLONE, CLONE/eval_episodes.json, $n


def _header(path: Path) -> str:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return "\n".join(lines)


def doc_commands() -> list[tuple[str, str, list[str]]]:
    """(where, command, arguments) of every ``grove train|pretrain ...`` the docs show, continuation lines joined,
    trailing comments and notes dropped."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = [(p, p.read_text(errors="replace")) for p in pages]
    texts += [(p, _header(p)) for p in sorted((ROOT / "configs").rglob("*.yaml"))]
    found = []
    for path, text in texts:
        # join a command continued on the next (comment) line, and an inline code span prose wraps onto the next
        # line; the joined line breaks stay as JOINED marks so that line numbers still count them
        text = re.sub(r"\\\n\s*#?\s*", " " + JOINED, text)
        text = re.sub(r"(?<!`)`(?!`)[^`]+`(?!`)", lambda m: m.group(0).replace("\n", " " + JOINED), text)
        number = 1
        for line in text.split("\n"):
            for m in re.finditer(r"\b(?:grove|shared_rl\.cli) (train|pretrain)\b([^`\n|;]*)", line):
                rest = re.split(r"\s#|\s\(|\s+Docs:|\s2>&1", m.group(2).replace(JOINED, " "))[0]
                try:
                    args = shlex.split(rest)
                except ValueError:  # an unbalanced quote in prose: not a command
                    continue
                found.append((f"{path.relative_to(ROOT)}:{number}", m.group(1), args))
            number += 1 + line.count(JOINED)
    return found


def _parsed(command: str, args: list[str]) -> tuple[Path, list[str]] | None:
    """(config, overrides) of a command, or None when it names no config (a placeholder, ``--resume``)."""
    if "--resume" in args:
        return None
    rest, config = [], None
    it = iter(args)
    for a in it:
        if a.startswith("[") and a.endswith("]"):
            a = a[1:-1]  # an optional argument, [seed=1]: checked as if given
        if a == "--out":
            next(it, None)
        elif a.startswith("-"):
            continue
        elif "=" in a:
            key, value = a.split("=", 1)
            if not PLACEHOLDER.search(value):
                rest.append(a)
        elif config is None:
            config = a
        else:
            return None  # a second positional: prose that follows the command, not an argument
    if config is None:
        if command == "pretrain" or not rest:
            return None
        config = str(DEFAULT_CONFIG.relative_to(ROOT))  # bare `grove train key=value`: the default recipe
    if not config.startswith("configs/"):
        return None  # C, CONFIG, [CONFIG]: a placeholder
    return ROOT / config, rest


COMMANDS = [(where, command, parsed) for where, command, args in doc_commands()
            if (parsed := _parsed(command, args)) is not None]


def test_the_docs_show_commands_to_check():
    assert len(COMMANDS) > 50, len(COMMANDS)
    assert any(where.startswith("README.md") for where, _, _ in COMMANDS)
    assert any(where.startswith("configs/") for where, _, _ in COMMANDS)


@pytest.mark.parametrize("where,command,parsed", COMMANDS, ids=[f"{w} {c}" for w, c, _ in COMMANDS])
def test_a_documented_command_parses(where, command, parsed):
    config, overrides = parsed
    assert config.is_file(), f"{where}: grove {command} names {config.relative_to(ROOT)}, which does not exist"
    data = apply_overrides(load_yaml(config), overrides)
    if command == "pretrain" or data.get("kind") == "supervised":
        check_supervised(data["domain"], {k: v for k, v in data.items() if k not in ("kind", "domain")})
    else:
        load_train_config(data)
