"""The ``grove`` command line.

    grove train [CONFIG] [--out DIR] [--resume DIR] [key=value ...]   RL (or supervised, by the config's kind)
    grove pretrain CONFIG [--out DIR] [key=value ...]                  supervised pretraining (kind: supervised)
    grove eval RUN_DIR [key=value ...]                                 evaluate a run's latest checkpoint
    grove bench NAME [--out DIR] [--quick]                             a benchmark -> DIR/results.json
    grove config show CONFIG [key=value ...]                           the resolved config, each field with its
                                                                       help text and default
    grove GROUP ...                                                    a domain's command group, e.g.
    grove robotics collect|to-lerobot|from-lerobot ...                 robotics tools (demonstrations, datasets)

Command groups are found by name like domains and benchmarks (``shared_rl.registry.COMMANDS`` and the
``grove.commands`` entry-point group), so this module never imports a domain package; a domain that needs
process-wide settings (``robotics``: the MuJoCo/OpenGL backend) sets them in its own package.

Bad input exits with code 2 and one line ``grove: error: ...``; nothing half-written is left behind.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import os
import shutil
import sys
import time
from pathlib import Path

from .config import apply_overrides, describe, dump_train_config, load_train_config, load_yaml, to_dict
from .errors import ConfigError, NonFiniteError, ResourceError
from .rewards import RewardFailure

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "visgen" / "shapes_grpo.yaml"
FALLBACK_CONFIG = REPO_ROOT / "configs" / "toy.yaml"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: same one-line form, exit 2
        raise ConfigError(message)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _default_run_dir(config_path: Path) -> Path:
    return Path("runs") / f"{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


class _RunDir:
    """Create the run directory lazily; remove it again if setup fails before anything useful is written."""

    def __init__(self, path: Path, resume: bool) -> None:
        self.path = path
        self.created = False
        self.main = int(os.environ.get("RANK", "0")) == 0  # under accelerate/torchrun only rank 0 writes
        if self.main and not resume and path.exists() and any(path.iterdir()):
            raise ConfigError(f"run directory {str(path)!r} is not empty; pass --resume {path} to continue it or choose another --out")
        if resume and not (path / "config.yaml").is_file():
            raise ConfigError(f"--resume {str(path)!r}: no config.yaml there (not a grove run directory)")

    def create(self) -> Path:
        if self.main and not self.path.exists():
            self.path.mkdir(parents=True)
            self.created = True
        return self.path

    def discard(self) -> None:
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def _input_errors(domain: str):
    """Errors raised while a domain loads its inputs (paths, data files, model configs) are input problems: report
    them as one line with exit code 2. ``GROVE_DEBUG=1`` re-raises with the traceback."""
    try:
        yield
    except ConfigError:
        raise
    except (FileNotFoundError, NotADirectoryError, KeyError, ValueError, OSError, AssertionError) as e:
        if os.environ.get("GROVE_DEBUG"):
            raise
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        msg = " ".join(msg.split())  # one line
        raise ConfigError(f"{domain}: {msg}") from e


def _quiet_loading() -> None:
    """Model-loading progress bars and import-time library chatter would bury the one-line error contract;
    training has its own bar."""

    for mod in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            importlib.import_module(mod).disable_progress_bar()
        except Exception:  # noqa: BLE001 — a missing library simply has no bar to hide
            pass


def _load_config(args) -> tuple[dict, Path]:
    if args.resume:
        config_path = Path(args.resume) / "config.yaml"
    elif args.config:
        config_path = Path(args.config)
    else:
        config_path = DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else FALLBACK_CONFIG
        _log(f"grove: no config given; running the default {config_path.relative_to(REPO_ROOT)}")
    data = apply_overrides(load_yaml(config_path), args.overrides)
    return data, config_path


def cmd_train(args, force_supervised: bool = False) -> int:
    import yaml

    data, config_path = _load_config(args)
    kind = "supervised" if force_supervised else data.get("kind", "rl")
    run = _RunDir(Path(args.resume or args.out or _default_run_dir(config_path)), bool(args.resume))
    if kind == "supervised":
        from .registry import resolve_supervised

        domain = data.get("domain")
        if not isinstance(domain, str):
            raise ConfigError(f"{config_path}: a supervised config needs 'domain: NAME'")
        fn = resolve_supervised(domain)
        body = {k: v for k, v in data.items() if k not in ("kind", "domain")}
        try:
            run_dir = run.create()
            (run_dir / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
            result = fn(body, run_dir, _log)
        except ConfigError:
            run.discard()
            raise
        _log(f"grove: done: {result}")
        return 0

    from .trainer import Trainer

    with _input_errors(str(data.get("domain", "config"))):
        cfg = load_train_config(data)
    _quiet_loading()
    try:
        with _input_errors(cfg.domain):
            trainer = Trainer(cfg, run.path, log=_log)  # builds the domain (loads models) before writing anything
        run_dir = run.create()
        if not args.resume and run.main:
            (run_dir / "config.yaml").write_text(yaml.safe_dump(dump_train_config(cfg), sort_keys=False))
    except ConfigError:
        run.discard()
        raise
    trainer.fit(resume=bool(args.resume))
    return 0


def cmd_eval(args) -> int:
    import json

    from .trainer import Trainer

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a grove run directory (no config.yaml)")
    cfg = load_train_config(apply_overrides(load_yaml(run_dir / "config.yaml"), args.overrides))
    trainer = Trainer(cfg, run_dir, log=_log)
    if not trainer.resume():
        raise ConfigError(f"{str(run_dir)!r} has no usable checkpoint")
    print(json.dumps(trainer._evaluate(trainer.start_iteration), indent=1))
    return 0


def cmd_bench(args) -> int:
    from .bench import markdown_table
    from .registry import resolve_benchmark

    fn = resolve_benchmark(args.name)
    out = Path(args.out or Path("runs") / f"bench-{args.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = fn(out, args.quick)
    print(markdown_table(result["rows"]))
    _log(f"grove: results in {out / 'results.json'}")
    return 0


def _yaml_value(value) -> str:
    """``value`` as one line of YAML, the way it would be written in a config (``null``, ``[0.9, 0.999]``, ``''``)."""
    import yaml

    text = yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=1 << 20).strip()
    return text[: -len("...")].strip() if text.endswith("\n...") else text


def format_config(cfg) -> list[str]:
    """The resolved ``TrainConfig`` as YAML lines, section by section (the domain's section under its name), each
    field as ``name: value   # help (default: X)``; a field without help text gets no comment. The output is a
    valid config: ``grove config show C > resolved.yaml`` trains the same run."""
    rows = []
    for path, value, default, help_ in describe(cfg):
        if path.startswith("domain_config."):
            path = cfg.domain + path[len("domain_config"):]
        *sections, name = path.split(".")
        rows.append((sections, f"{'  ' * len(sections)}{name}: {_yaml_value(value)}", default, help_))
    width = min(max(len(left) for _, left, _, _ in rows), 56)
    lines: list[str] = []
    open_sections: list[str] = []
    for sections, left, default, help_ in rows:
        same = 0
        while same < min(len(sections), len(open_sections)) and sections[same] == open_sections[same]:
            same += 1
        lines += [f"{'  ' * depth}{sections[depth]}:" for depth in range(same, len(sections))]
        open_sections = sections
        if help_:
            shown = "required" if default is dataclasses.MISSING else _yaml_value(default)
            left = f"{left:<{width}}   # {help_} (default: {shown})"
        lines.append(left)
    return lines


def cmd_config(args) -> int:
    if args.config_command != "show":
        raise ConfigError("config needs a sub-command: grove config show CONFIG [key=value ...]")
    if not args.config:
        raise ConfigError("config show needs a config, e.g. grove config show configs/toy.yaml")
    config_path = Path(args.config)
    data = apply_overrides(load_yaml(config_path), args.overrides)
    if data.get("kind", "rl") == "supervised":
        raise ConfigError(f"{config_path}: config show resolves RL configs; this one is kind: supervised "
                          f"(its job validates it when run: grove pretrain {config_path})")
    with _input_errors(str(data.get("domain", "config"))):
        cfg = load_train_config(data)
    print(f"# {config_path} resolved: every setting `grove train` runs with, its help text and default")
    print("\n".join(format_config(cfg)))
    return 0


def cmd_group(name: str, argv: list[str]) -> int:
    """``grove NAME ...``: hand the rest of the command line to the command group's ``main(argv)``."""
    from .registry import resolve_command

    return int(resolve_command(name)(argv) or 0)


BUILTIN_COMMANDS = ("train", "pretrain", "eval", "bench", "config")


def _command_groups() -> list[str]:
    from .registry import command_names

    return [n for n in command_names() if n not in BUILTIN_COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="grove", description="Group-relative RL post-training for image generators, robot policies and LLMs.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    for name, help_ in (("train", "train with a YAML config (RL by default; supervised when kind: supervised)"),
                        ("pretrain", "supervised pretraining of an embedded model")):
        t = sub.add_parser(name, help=help_)
        t.add_argument("config", nargs="?", help="YAML config (default: the embedded shapes GRPO recipe)")
        t.add_argument("--out", help="run directory (default runs/<config>-<time>)")
        if name == "train":
            t.add_argument("--resume", help="continue the run in this directory from its newest valid checkpoint")
        t.add_argument("overrides", nargs="*", help="dotted overrides such as optim.lr=1e-4")
    e = sub.add_parser("eval", help="evaluate the newest checkpoint of a run directory")
    e.add_argument("run_dir")
    e.add_argument("overrides", nargs="*")
    b = sub.add_parser("bench", help="run a benchmark; writes DIR/results.json, plots and a Markdown table")
    b.add_argument("name", help="benchmark name")
    b.add_argument("--out")
    b.add_argument("--quick", action="store_true", help="tiny settings that only check the plumbing")
    c = sub.add_parser("config", help="inspect configs: grove config show CONFIG [key=value ...]")
    csub = c.add_subparsers(dest="config_command", parser_class=_Parser)
    show = csub.add_parser("show", help="print the resolved config section by section, with help texts and defaults")
    show.add_argument("config", nargs="?", help="YAML config")
    show.add_argument("overrides", nargs="*", help="dotted overrides such as optim.lr=1e-4")
    for name in _command_groups():
        sub.add_parser(name, help=f"the {name} command group (grove {name} --help lists its tools)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if "torch.distributed" in sys.modules:  # launched by accelerate/torchrun: leave cleanly on every rank
        from .distributed import exit_distributed

        exit_distributed(code)
    return code


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import logging

    # import-time chatter of torchao (and diffusers' torchao shim) is not for the user's terminal
    for name in ("torch.utils._pytree", "diffusers.quantizers.torchao.torchao_quantizer"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        if argv and argv[0] not in BUILTIN_COMMANDS and argv[0] in _command_groups():
            return cmd_group(argv[0], argv[1:])
        parser = build_parser()
        if not argv:
            parser.print_help()
            return 0
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            # overrides after options land in unknown; anything not key=value is an error
            bad = [u for u in unknown if "=" not in u or u.startswith("-")]
            if bad:
                raise ConfigError(f"unrecognized arguments: {' '.join(bad)}")
            args.overrides = list(getattr(args, "overrides", []) or []) + unknown
        if args.command == "train":
            if args.config and "=" in args.config and not Path(args.config).exists():
                args.overrides = [args.config] + list(args.overrides)
                args.config = None
            return cmd_train(args)
        if args.command == "pretrain":
            args.resume = None
            if not args.config:
                raise ConfigError("pretrain needs a config, e.g. grove pretrain configs/visgen/shapes_pretrain.yaml")
            return cmd_train(args, force_supervised=True)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "config":
            return cmd_config(args)
        parser.print_help()
        return 2
    except ConfigError as e:
        print(f"grove: error: {e}", file=sys.stderr)
        return 2
    except (ResourceError, NonFiniteError, RewardFailure) as e:
        print(f"grove: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("grove: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
