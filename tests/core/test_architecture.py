"""Architecture rules, checked on the source with ``ast`` (nothing is imported):

- layering: ``shared_rl`` never imports ``visgen``, ``robotics`` or ``bench``; ``visgen`` and ``robotics`` never
  import each other. Every import counts (module level or inside a function, ``import x`` or ``from x import``,
  relative ones resolved), with no whitelist: the core reaches domains, benchmarks and command groups only
  through the ``"module:attr"`` strings of ``shared_rl/registry.py``.
- no import cycles among the project's modules, lazy (function-level) imports included: a lazy import only hides
  a cycle until someone moves it to the top of the file. Only imports under ``if TYPE_CHECKING:`` are ignored
  (they never run).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared_rl", "visgen", "robotics", "bench")

# top-level package -> the project packages it must never import
FORBIDDEN = {
    "shared_rl": {"visgen", "robotics", "bench"},
    "visgen": {"robotics"},
    "robotics": {"visgen"},
}


def _modules(root: Path, packages) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` bodies (never executed)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports(module: str, path: Path, is_pkg: bool) -> list[tuple[str, int]]:
    """Every (absolute dotted name, line) that ``module`` imports, at any depth of the file. ``from m import a``
    yields ``m.a`` (which may be a submodule or a name in ``m``); relative imports are resolved."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(f"{target}.{a.name}", node.lineno) for a in node.names]
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line}. An imported name resolves to the longest known module
    prefix (``from pkg import sub`` -> ``pkg.sub``; ``from pkg import func`` -> ``pkg``). The implicit import of
    a parent package (``import a.b`` runs ``a/__init__``) is not an edge: Python initialises parents first."""
    mods = _modules(root, packages)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, (path, is_pkg) in mods.items():
        for name, line in imports(mod, path, is_pkg):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                target = ".".join(parts[:i])
                if target in mods:
                    if target != mod:
                        graph[mod].setdefault(target, line)
                    break
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles: strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def _cycle_path(graph: dict[str, dict[str, int]], scc: list[str], files: dict[str, str]) -> str:
    """One concrete cycle through ``scc`` as ``a (a.py:12) -> b (b.py:3) -> a`` (breadth-first, shortest)."""
    members, start = set(scc), scc[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in prev:
        nxt = []
        for v in frontier:
            for w in graph[v]:
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [start]
    while True:
        path.append(prev[path[-1]])
        if path[-1] == start:
            break
    path.reverse()
    hops = [f"{a} ({files[a]}:{graph[a][b]})" for a, b in zip(path, path[1:])]
    return " -> ".join(hops + [start])


def describe_cycles(root: Path = ROOT, packages=PACKAGES) -> dict[frozenset, str]:
    graph = import_graph(root, packages)
    files = {m: path.relative_to(root).as_posix() for m, (path, _) in _modules(root, packages).items()}
    return {frozenset(scc): _cycle_path(graph, scc, files) for scc in strongly_connected(graph)}


# ------------------------------------------------------------------------------------------------- the rules
def test_layering_every_direction_every_import():
    bad = []
    mods = _modules(ROOT, PACKAGES)
    for mod, (path, is_pkg) in mods.items():
        forbidden = FORBIDDEN.get(mod.split(".")[0], set())
        for name, line in imports(mod, path, is_pkg):
            if name.split(".")[0] in forbidden:
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert not bad, "layering broken (" + "; ".join(f"{k} must not import {sorted(v)}" for k, v in FORBIDDEN.items()) \
        + "; resolve domains, benchmarks and command groups by name via shared_rl/registry.py):\n" + "\n".join(bad)


def test_no_import_cycles():
    cycles = describe_cycles()
    if cycles:
        pytest.fail("import cycles (lazy imports count too; move the shared piece into a module both import):\n"
                    + "\n".join(f"  {sorted(k)}: {v}" for k, v in sorted(cycles.items(), key=lambda kv: kv[1])),
                    pytrace=False)


# ------------------------------------------------------------------------------- the checker itself works
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_cycle_checker_sees_lazy_relative_and_from_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from . import a as _a\nVALUE = 1\n",  # __init__ -> a -> (from . import VALUE) __init__
        "pkg/a.py": "from . import VALUE\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from ..c import g\n",  # lazy, relative two levels up
        "pkg/c.py": "import pkg.sub.b\ndef g(): pass\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import X\n",
        "pkg/e.py": "from pkg import d\nX = 1\n",  # d -> e only under TYPE_CHECKING: not a cycle
        "pkg/f.py": "from pkg.sub import b\n",  # a submodule through its package: an edge to pkg.sub.b only
    })
    cycles = describe_cycles(tmp_path, ("pkg",))
    assert set(cycles) == {frozenset({"pkg", "pkg.a"}), frozenset({"pkg.sub.b", "pkg.c"})}, cycles
    assert "pkg.sub.b (pkg/sub/b.py:2) -> pkg.c (pkg/c.py:1) -> pkg.sub.b" in cycles[frozenset({"pkg.sub.b", "pkg.c"})] \
        or "pkg.c (pkg/c.py:1) -> pkg.sub.b (pkg/sub/b.py:2) -> pkg.c" in cycles[frozenset({"pkg.sub.b", "pkg.c"})]
    assert import_graph(tmp_path, ("pkg",))["pkg.f"] == {"pkg.sub.b": 1}


# ---------------------------------------------------------------------------------------------------------------
# One hook protocol: the core calls a domain's (and its config's) hooks directly — every optional hook has its
# default on shared_rl.domain.DomainBase / DomainConfig — and never probes for them with getattr / hasattr.

_PROBED = ("domain", "domain_config", "config_class")


def _hook_probes(tree: ast.AST) -> list[str]:
    """``getattr(x.domain, "...")`` / ``hasattr(cfg.domain_config, ...)`` style calls on a domain or its config."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args):
            target = node.args[0]
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "type":
                target = target.args[0] if target.args else target
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if name in _PROBED:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_core_never_probes_a_domain_for_hooks():
    bad = {}
    for path in sorted((ROOT / "shared_rl").rglob("*.py")):
        probes = _hook_probes(ast.parse(path.read_text()))
        if probes:
            bad[str(path.relative_to(ROOT))] = probes
    assert not bad, f"declare the hook on DomainBase / DomainConfig and call it: {bad}"
    # the checker sees the forms it forbids
    src = "a = getattr(self.domain, 'x', None)\nb = hasattr(cfg.domain_config, 'y')\nc = getattr(type(self.domain), 'z')"
    assert len(_hook_probes(ast.parse(src))) == 3
