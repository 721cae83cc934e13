"""Reading the files users hand grove (dataset metadata, tables) so that a file which is not what its name says is one
``ConfigError`` line naming the file and what it should be — never a ``UnicodeDecodeError`` or ``ArrowInvalid``
traceback. The domains' dataset readers (LeRobot datasets, demo files, prompt files) read through these."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .preflight import check_text

MAX_JSON_BYTES = 64 << 20  # a metadata file is small; a larger one is the wrong file


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:160]


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in ``path``: ConfigError (one line) when it is missing, too large, not UTF-8 text or not JSON;
    ``what`` says what the file should be ("LeRobot's dataset metadata")."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p} does not exist; it should be {what}")
    if p.stat().st_size > MAX_JSON_BYTES:
        raise ConfigError(f"{p} is {p.stat().st_size:,} bytes, too large for {what}")
    raw = p.read_bytes()
    check_text(raw, str(p), what)
    try:
        return json.loads(raw.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e.msg} at line {e.lineno}); it should be {what}") from None


def read_jsonl(path: str | Path, where: str = "") -> list[Any]:
    """One JSON value per non-blank line of ``path``; a line that is not JSON is one ConfigError line naming the
    file, the line and (``where``) the setting that named it."""
    p = Path(path)
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where + ' ' if where else ''}{p}: line {n} is not valid JSON ({e.msg} at column "
                                  f"{e.colno})") from None
    return rows


def read_parquet(path: str | Path, what: str, columns: list[str] | tuple[str, ...] = ()):
    """The Parquet table in ``path`` (pyarrow): ConfigError (one line) when it is missing, not Parquet (truncated,
    another format) or lacks one of ``columns``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p} does not exist; it should be {what}")
    try:
        table = pq.read_table(p)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ConfigError(f"{p} is not a readable Parquet file ({_first_line(e)}); it should be {what}") from None
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ConfigError(f"{p} has no column {', '.join(map(repr, missing))} (columns: {table.column_names}); it "
                          f"should be {what}")
    return table


def local_path_meant(path: str, roots: tuple[Path, ...] = ()) -> bool:
    """Whether ``path`` names a local file or folder rather than a hub id ("name" or "org/name"): it starts with
    ``.``, ``/`` or ``~``, has more than one ``/`` or a backslash, or its first component is a local folder (in the
    working directory or one of ``roots``: ``assets/llm-arith-tiy``, ``runs/lerobot/smolvla-tiny``). A missing local
    path is then a one-line error at once, never a Hub client's retries."""
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or "\\" in path:
        return True
    parts = Path(path).parts
    return len(parts) == 2 and any((base / parts[0]).is_dir() for base in (Path.cwd(), *roots))
