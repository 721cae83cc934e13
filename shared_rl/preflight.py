"""Checks that need the machine, not just the config: run before any model loads and before anything is written.

``load_train_config`` validates what the YAML says (types, ranges, names, batch arithmetic). ``preflight`` checks
whether *this machine and these inputs* can run it, so that a mistake costs seconds instead of a model load and a
held-out evaluation:

- the device exists (``device: cuda`` without a GPU, ``cuda:3`` on a one-GPU machine, ``mps`` off Apple);
- the optional loggers asked for are installed (``logging.wandb``, ``logging.tensorboard``);
- the process layout: ``distributed.strategy`` against what the domain supports, rollout chunks against the
  processes launched (``check_distributed``);
- hub ids the domains name, against the local hub cache when the Hub cannot be reached (``check_hub_model``);
- integers the libraries can hold (``check_numbers``: int64, 32-bit seeds, a bounded batch) and the files the
  config names, read defensively by their suffix (``check_named_files``: UTF-8 text, parquet/npz/safetensors marks);
- the domain's own input checks: the domain config's optional hook ``preflight(train_cfg)`` reads its small
  inputs (prompt files, datasets, ``module:function`` rewards) and checks that the configured rewards can score
  them (``shared_rl.domain`` documents the hook).

Every failure is a ``ConfigError`` whose one line says what to change.
"""
from __future__ import annotations

import importlib.util

from .errors import ConfigError


def resolve_device(name: str):
    """``torch.device`` for a config's ``device`` (``auto`` = the first GPU if torch sees one, else the CPU);
    a device this machine does not have is a ConfigError, never a silent fall-back."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError("device 'mps' is not available on this machine (torch.backends.mps.is_available() is "
                              "False); use device=cpu or device=auto")
        return torch.device("mps")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} is not available: torch sees no CUDA GPU here "
                              f"(torch.cuda.is_available() is False); use device=cpu or device=auto")
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        count = torch.cuda.device_count()
        if index >= count:
            raise ConfigError(f"device {name!r} is not available: torch sees {count} GPU(s), cuda:0..cuda:{count - 1}")
        return torch.device(name)
    raise ConfigError(f"device {name!r} is not a device grove runs on; use auto, cpu, cuda, cuda:N or mps")


def _need_package(flag: str, package: str, install: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{flag}: true needs the {package} package, which is not installed: {install} (or set "
                          f"{flag}=false)")


def preflight(cfg) -> None:
    """Everything ``grove train`` can check about a validated ``TrainConfig`` before loading a model."""
    resolve_device(cfg.device)
    check_numbers(cfg)
    check_named_files(cfg)
    if cfg.logging.wandb:
        _need_package("logging.wandb", "wandb", "pip install wandb")
    if cfg.logging.tensorboard:
        _need_package("logging.tensorboard", "tensorboard", "pip install tensorboard")
    check_distributed(cfg)
    cfg.domain_config.preflight(cfg)


def launched_processes() -> int:
    """How many processes this run is one of: torch.distributed's world when it is initialised, else the
    ``WORLD_SIZE`` that ``torchrun`` / ``accelerate launch`` give every worker (1 for a plain ``grove train``)."""
    import os
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_distributed(cfg) -> None:
    """The process layout against the config, before a worker loads a model: ``distributed.strategy: fsdp2`` on a
    domain that lists no modules to shard (refused in every layout, so ``--dry-run`` before ``torchrun`` says it),
    and with several processes, fewer rollout chunks than processes (some would sample nothing; under fsdp2 they
    would also have no forward to pair with the others)."""
    from .domain import DomainBase
    from .registry import resolve_domain

    strategy = cfg.distributed.strategy
    if strategy == "fsdp2" and resolve_domain(cfg.domain).fsdp_modules is DomainBase.fsdp_modules:
        raise ConfigError(f"distributed.strategy: fsdp2 is not supported by domain {cfg.domain!r} (it lists no "
                          f"modules to shard); use distributed.strategy: replicate")
    world = launched_processes()
    from .sharding import check_settings

    check_settings(cfg, world, resolve_device(cfg.device))  # mesh, offload and precision: the trainer's own check
    if world < 2:
        return
    groups = cfg.rollout.groups_per_iteration
    per_call = cfg.rollout.groups_per_call or -(-groups // world)
    chunks = -(-groups // per_call)
    if chunks < world:
        fix = (f"raise rollout.groups_per_iteration to >= {world}" if groups < world else
               f"set rollout.groups_per_call <= {groups // world}")
        if strategy == "fsdp2":
            raise ConfigError(f"distributed.strategy: fsdp2 needs a rollout chunk on each of the {world} processes, "
                              f"but {groups} groups in calls of {per_call} make {chunks} chunks; {fix}")
        raise ConfigError(f"{world} processes but {groups} groups in calls of {per_call} make {chunks} rollout "
                          f"chunk(s): {world - chunks} process(es) would sample nothing; {fix}")


# ---------------------------------------------------------------------------------------------------------------
# Inputs read defensively: the config file itself, the numbers that reach torch and numpy, the files a config
# names, and user code imported while a domain is built. All run before the run directory exists (and in
# --dry-run, except what only building the domain can show: a module that fails to import, a size that does not
# fit in memory, which the CLI turns into one line as well).

MAX_CONFIG_BYTES = 1 << 20  # a config is a page of YAML; a larger file is the wrong file (a dataset, a binary)
MAX_YAML_DEPTH = 64  # nesting: PyYAML's composer recurses per level (a deep file was a RecursionError)
MAX_YAML_NODES = 200_000  # values after alias expansion ("billion laughs" anchors)
MAX_SEQUENCES = 1 << 24  # sequences one iteration may sample (groups_per_iteration x group_size)
INT64_MAX = 2**63 - 1  # the largest integer a torch tensor or numpy int64 holds
SEED_MAX = 2**32 - 1  # numpy's seeds are 32-bit
TEXT_SUFFIXES = {".txt", ".jsonl", ".json", ".yaml", ".yml", ".csv", ".tsv", ".md", ".py"}
_SCAN_BYTES = 64 << 20  # at most this much of the files a config names is read by the checks
_SCAN_FILES = 500  # at most this many files of a directory a config names


def check_text(raw: bytes, where: str, what: str) -> None:
    """ConfigError unless ``raw`` is UTF-8 text without NUL bytes; the line says where it is not and what the
    file should have been."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{where} is not text (a NUL byte at offset {nul}); it should be {what}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start >= len(raw) - 3 and e.reason == "unexpected end of data":
            return  # a read cut a multi-byte character at the end of the checked prefix
        raise ConfigError(f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); it should be "
                          f"{what}: save it as UTF-8") from None


def check_yaml_text(text: str, where: str) -> None:
    """ConfigError when YAML ``text`` nests deeper than ``MAX_YAML_DEPTH`` or expands (through aliases) to more
    than ``MAX_YAML_NODES`` values; read as an event stream, which never recurses. Syntax errors are left to the
    loader, which names the line."""
    import yaml

    try:
        _scan_yaml(text, where, getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:  # libyaml gives up on deep nesting with a scanner error: look again, event by event
        try:
            _scan_yaml(text, where, yaml.SafeLoader)
        except yaml.YAMLError:
            return


def _scan_yaml(text: str, where: str, loader) -> None:
    import yaml

    sizes: list[int] = [0]  # values counted in each open collection (the stream at the bottom)
    anchors: dict[str, int] = {}
    open_anchors: list[str | None] = []
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(open_anchors) >= MAX_YAML_DEPTH:
                raise ConfigError(f"{where} nests more than {MAX_YAML_DEPTH} levels deep; a grove config is "
                                  f"a few levels of sections")
            sizes.append(1)
            open_anchors.append(event.anchor)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            size = sizes.pop()
            anchor = open_anchors.pop()
            if anchor:
                anchors[anchor] = size
            sizes[-1] += size
        elif isinstance(event, yaml.ScalarEvent):
            sizes[-1] += 1
            if event.anchor:
                anchors[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            sizes[-1] += anchors.get(event.anchor, 1)
        if sum(sizes) > MAX_YAML_NODES:
            raise ConfigError(f"{where} expands to more than {MAX_YAML_NODES:,} values (YAML anchors and "
                              f"aliases repeat whole sections); write the values out")


def check_config_file(path) -> None:
    """The config file as bytes, before YAML reads it: a regular file of at most ``MAX_CONFIG_BYTES``, UTF-8 text,
    nesting and alias expansion bounded. A missing file is left to ``load_yaml`` (its own message)."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        return
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {str(p)!r} is {size:,} bytes; a config is at most {MAX_CONFIG_BYTES:,} "
                          f"bytes of YAML: is it the right file?")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({e.strerror})") from None
    check_text(raw, f"config file {str(p)!r}", "a YAML config")
    check_yaml_text(raw.decode("utf-8"), f"config file {str(p)!r}")


def check_override_text(override: str) -> None:
    """A ``key=value`` override: UTF-8-clean and bounded like a config file (the value is read as YAML)."""
    if len(override) > MAX_CONFIG_BYTES:
        raise ConfigError(f"override {override[:40]!r}... is {len(override):,} characters; at most "
                          f"{MAX_CONFIG_BYTES:,}")
    if "\x00" in override:
        raise ConfigError(f"override {override[:40]!r} holds a NUL character")
    key, _, value = override.partition("=")
    check_yaml_text(value, f"override {key!r}")


def _walk(value, where: str):
    """(dotted name, value) of every leaf of a config (dataclasses, dicts, lists)."""
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            if not f.name.startswith("_"):
                yield from _walk(getattr(value, f.name), f"{where}.{f.name}" if where else f.name)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{where}[{i}]")
    else:
        yield where, value


def _leaves(cfg):
    for where, value in _walk(cfg, ""):
        if where.startswith("domain_config"):
            where = cfg.domain + where[len("domain_config"):]
        yield where, value


def check_numbers(cfg) -> None:
    """Integers the libraries can hold: every integer setting within int64, every seed within numpy's 32 bits,
    and at most ``MAX_SEQUENCES`` sequences per iteration (more is a typo that would ask for terabytes)."""
    for where, value in _leaves(cfg):
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        name = where.rsplit(".", 1)[-1]
        if name.endswith("seed") and not 0 <= value <= SEED_MAX:
            raise ConfigError(f"{where}={value} is not a seed numpy and torch accept; use 0..{SEED_MAX}")
        if abs(value) > INT64_MAX:
            raise ConfigError(f"{where}={value} is too large: torch and numpy hold integers up to 2^63-1")
    r = cfg.rollout
    if r.groups_per_iteration * r.group_size > MAX_SEQUENCES:
        raise ConfigError(f"rollout.groups_per_iteration x rollout.group_size = {r.groups_per_iteration} x "
                          f"{r.group_size} = {r.groups_per_iteration * r.group_size:,} sequences per iteration; "
                          f"at most {MAX_SEQUENCES:,} (lower them)")


def _check_file(path, where: str, budget: list[int]) -> None:
    suffix = path.suffix.lower()
    what = f"{where} {str(path)!r}"
    try:
        if suffix in TEXT_SUFFIXES:
            with open(path, "rb") as f:
                raw = f.read(min(budget[0], _SCAN_BYTES))
            budget[0] -= len(raw)
            check_text(raw, what, f"{suffix[1:]} text")
            return
        magic = {".parquet": (b"PAR1", b"PAR1"), ".npz": (b"PK", b""), ".safetensors": (b"", b"")}.get(suffix)
        if magic is None:
            return
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            f.seek(max(0, size - 4))
            tail = f.read(4)
    except OSError as e:
        raise ConfigError(f"{what} cannot be read ({e.strerror})") from None
    head_magic, tail_magic = magic
    if suffix == ".safetensors":
        ok = len(head) == 8 and 0 < int.from_bytes(head, "little") <= size - 8
    else:
        ok = size >= len(head_magic) + len(tail_magic) and head.startswith(head_magic) and tail.endswith(tail_magic)
    if not ok:
        raise ConfigError(f"{what} is not a valid {suffix[1:]} file (its first bytes are {head[:8]!r}); is it the "
                          f"right file, completely downloaded?")


def check_named_files(cfg) -> None:
    """Each file (or directory of files) a string setting names, read defensively by its suffix: text files
    (prompts, JSONL datasets, JSON metadata) must be UTF-8 without NUL bytes, parquet / npz / safetensors files
    must carry their format's marks. Bounded: at most ``_SCAN_BYTES`` read and ``_SCAN_FILES`` files per
    directory. Names that are not paths here (hub ids, reward names) are skipped."""
    from pathlib import Path

    budget = [_SCAN_BYTES]
    for where, value in _leaves(cfg):
        if not isinstance(value, str) or not value or "\x00" in value or len(value) > 4096:
            continue
        path = Path(value).expanduser()
        try:
            if path.is_file():
                _check_file(path, where, budget)
            elif path.is_dir() and path.resolve() != Path("/"):
                count = 0
                for child in sorted(path.rglob("*")):
                    if any(part.startswith(".") for part in child.relative_to(path).parts):
                        continue
                    if child.is_file():
                        _check_file(child, where, budget)
                        count += 1
                        if count >= _SCAN_FILES:
                            break
        except OSError:
            continue  # unreadable names are the domain's to report, in its own words


def user_code_failure(exc: BaseException) -> str | None:
    """One line when ``exc`` was raised while importing a module that is neither grove's nor an installed
    library's (a ``module:function`` reward, an engine class, a video reward loader): a syntax error in it, or any
    exception its top-level code raised. None for everything else (grove's own errors keep their traceback)."""
    import sysconfig
    import traceback
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ours = [root / pkg for pkg in ("shared_rl", "visgen", "robotics", "bench")]
    libraries = {Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")}

    def user_file(name: str | None) -> bool:
        if not name or name.startswith("<"):
            return False
        p = Path(name).resolve()
        return not any(p.is_relative_to(d) for d in ours) and not any(p.is_relative_to(d) for d in libraries)

    if isinstance(exc, SyntaxError) and user_file(exc.filename):
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}; fix the module"
    importing = False
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith("<frozen importlib"):
            importing = True
        elif importing and frame.name == "<module>" and user_file(frame.filename):
            message = " ".join(str(exc).split())[:200]
            return (f"importing {frame.filename} raised {type(exc).__name__}: {message} (its line {frame.lineno}); "
                    f"fix the module")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Hub ids. A model named "org/name" that is not in the local Hugging Face cache, on a machine that cannot reach the
# Hub, used to be "valid" in --dry-run and then cost the real run a pipeline import and up to a minute of the hub
# client's retries; it is answered here from the cache folder and one short connection attempt, importing nothing.

HUB_ID = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
_PROBE_SECONDS = 2.0  # one connection attempt to the Hub; a machine without network answers "no" in well under that


def hub_cache_dir():
    """The Hugging Face hub cache folder, found as ``huggingface_hub`` finds it (``HF_HUB_CACHE``, ``HF_HOME``,
    ``XDG_CACHE_HOME``) without importing it."""
    import os
    from pathlib import Path

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"


def cached_hub_ids(kind: str = "models") -> list[str]:
    """The repo ids of ``kind`` (models, datasets) with at least one snapshot in the local hub cache."""
    root, prefix = hub_cache_dir(), f"{kind}--"
    try:
        entries = sorted(root.iterdir()) if root.is_dir() else []
    except OSError:
        return []
    ids = []
    for entry in entries:
        snapshots = entry / "snapshots"
        if entry.name.startswith(prefix) and snapshots.is_dir() and any(snapshots.iterdir()):
            ids.append(entry.name[len(prefix):].replace("--", "/", 1))
    return ids


def recipe_hub_ids() -> list[str]:
    """The hub ids the shipped recipes name (``model:`` / ``path:`` lines under ``configs/``): the ids a typo is
    most likely a typo of. Read as text, no YAML parse."""
    import re
    from pathlib import Path

    pattern = re.compile(rf"^\s*(?:model|path):\s*['\"]?({HUB_ID})['\"]?\s*(?:#.*)?$", re.M)
    root = Path(__file__).resolve().parents[1]
    ids: set[str] = set()
    for path in (root / "configs").rglob("*.yaml"):
        try:
            found = pattern.findall(path.read_text(errors="replace"))
        except OSError:
            continue
        ids.update(m for m in found if not (root / m.split("/")[0]).is_dir())  # assets/x, runs/x: local paths
    return sorted(ids)


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached from here (``HF_HUB_OFFLINE`` set, no name resolution, no connection within
    ``_PROBE_SECONDS``), or None when a connection to it opens. Bounded: the attempt runs in a daemon thread."""
    import os
    import socket
    import threading
    from urllib.parse import urlparse

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var} is set"
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=_PROBE_SECONDS).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{host}: {e.strerror or type(e).__name__}")

    probe = threading.Thread(target=attempt, daemon=True)
    probe.start()
    probe.join(_PROBE_SECONDS + 0.5)  # a name lookup that hangs takes no timeout of its own
    return outcome[0] if outcome else f"{host}: no answer within {_PROBE_SECONDS:g} s"


def check_hub_model(name: str, where: str, known: list[str] | tuple[str, ...] = (), kind: str = "models") -> None:
    """ConfigError when hub id ``name`` (``org/name``) has no snapshot in the local cache and the Hub cannot be
    reached: the line names the cache folder, why the Hub is out of reach, the nearest cached or ``known`` id
    ("did you mean") and the command that downloads it. Cached ids, and any id while the Hub is reachable, pass
    (the loader then reports what the Hub says)."""
    from .registry import did_you_mean

    cached = cached_hub_ids(kind)
    if name in cached:
        return
    why = hub_unreachable()
    if why is None:
        return
    near = did_you_mean(name, [i for i in (*cached, *known, *recipe_hub_ids()) if i != name])
    raise ConfigError(f"{where} {name!r} is not in the local Hugging Face cache ({hub_cache_dir()}) and the Hub "
                      f"cannot be reached ({why}){near}; download it once where there is network "
                      f"(`hf download {name}`) or give a local directory")
