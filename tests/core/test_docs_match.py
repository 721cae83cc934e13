"""The docs name what the code registers, and the fast catalogs name what the registries hold.

Every name a config or a command line can choose is registered somewhere; ``grove list`` prints them, mostly from
the registries themselves and, for the domains whose registries import diffusers or MuJoCo, from static text
(``visgen/catalog.py``, ``robotics/catalog.py``). These tests keep the three in step:

- every registered name appears in ``grove list`` and on the docs page that documents its kind: the core's
  estimators, losses, KL estimators, aggregations, filters and samplers in ``docs/core.md``; visgen rewards in
  ``docs/rewards.md``; visgen rollout methods and training objectives on a ``docs/methods/`` page; tasks under
  ``docs/tasks/`` or in ``docs/rewards.md``; benchmarks, domains and command groups in ``README.md``;
- the static catalogs equal the registries they mirror;
- the Makefile's ``BENCHMARKS`` (what ``make bench`` runs) and the README's benchmark list are every registered
  benchmark, and every ``grove bench NAME`` the README names exists.

"Appears" means: a whole word inside code (an inline code span or a fenced block), so a name in prose does not
count and ``grpo`` does not match inside ``dr_grpo``.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared_rl import registry
from shared_rl.cli import catalog

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def code_words(text: str) -> set[str]:
    """Every name written as code in a markdown text: the words of its fenced blocks and inline code spans
    (a word: letters, digits, ``_``, ``-`` and ``.``; ``a | b`` or ``{name: a}`` yield ``a`` and ``b``)."""
    spans = re.findall(r"```.*?```", text, flags=re.S)
    rest = re.sub(r"```.*?```", " ", text, flags=re.S)
    spans += re.findall(r"`([^`\n]+)`", rest)
    words: set[str] = set()
    for span in spans:
        for word in re.findall(r"[A-Za-z0-9_.\-]+", span):
            words.add(word)
            words.update(word.strip(".-").split("."))  # `advantage.estimator` names both parts
    return words


def page_words(*paths: Path) -> set[str]:
    return set().union(*(code_words(p.read_text()) for p in paths))


@pytest.fixture(scope="module")
def listed() -> dict[str, list[str]]:
    """``grove list``: kind -> names (the catalog the command prints, row headings shortened to the kind)."""
    return {what: list(names) for what, names in catalog()}


def row(listed: dict[str, list[str]], prefix: str) -> list[str]:
    rows = [names for what, names in listed.items() if what.startswith(prefix)]
    assert len(rows) == 1, f"grove list has {len(rows)} rows starting {prefix!r}: {list(listed)}"
    assert not any(n.startswith("(unavailable") for n in rows[0]), rows[0]
    return rows[0]


def missing(names, words: set[str]) -> list[str]:
    return sorted(n for n in names if n not in words)


# ------------------------------------------------------------------------------------------------ the core's names
def test_every_core_name_is_listed_and_documented_in_core_md(listed):
    import typing

    from shared_rl.advantages import ESTIMATORS
    from shared_rl.config import LossConfig, SelectionConfig
    from shared_rl.losses import AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES

    def literal(cls, name):
        return [str(a) for a in typing.get_args(typing.get_type_hints(cls)[name])]

    core = page_words(DOCS / "core.md")
    kinds = {
        "advantage estimators": (sorted(ESTIMATORS), row(listed, "advantage estimators, flat")
                                 + row(listed, "advantage estimators, tree") + row(listed, "advantage estimators with")),
        "policy losses": (sorted(POLICY_LOSSES), row(listed, "policy losses")),
        "KL estimators": (sorted(KL_ESTIMATORS), row(listed, "KL estimators")),
        "loss aggregations": (list(AGGREGATIONS), row(listed, "loss aggregations")),
        "group filters": (literal(SelectionConfig, "filter"), row(listed, "group filters")),
        "key samplers": (literal(SelectionConfig, "sampler"), row(listed, "key samplers")),
    }
    assert sorted(AGGREGATIONS) == sorted(literal(LossConfig, "aggregation"))
    for kind, (registered, shown) in kinds.items():
        assert sorted(shown) == sorted(registered), f"grove list's {kind} differ from the registry"
        assert not missing(registered, core), f"docs/core.md does not name these {kind}: {missing(registered, core)}"


def test_every_estimator_and_loss_setting_is_named_in_core_md():
    """A name alone is not documentation: each estimator's and loss's own settings are written there too."""
    import dataclasses

    from shared_rl.advantages import ESTIMATORS
    from shared_rl.losses import POLICY_LOSSES

    core = page_words(DOCS / "core.md")
    settings = {f"estimator {n}": e.settings_class for n, e in ESTIMATORS.items()}
    settings.update({f"loss {n}": fn.settings_class for n, fn in POLICY_LOSSES.items()})
    for what, cls in settings.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        assert not missing(fields, core), f"docs/core.md does not name the settings of {what}: {missing(fields, core)}"


def test_domains_commands_and_supervised_jobs_are_listed_and_documented(listed):
    readme = page_words(ROOT / "README.md")
    docs = page_words(ROOT / "README.md", *DOCS.rglob("*.md"))
    assert row(listed, "domains") == registry.domain_names()
    assert row(listed, "command groups") == registry.command_names()
    assert row(listed, "supervised jobs (") == registry.supervised_names()
    assert not missing(registry.domain_names(), docs), "domains missing from the docs"
    assert not missing(registry.command_names(), readme), "command groups missing from README's command line"
    assert not missing(registry.supervised_names(), docs), "supervised jobs missing from the docs"


# ------------------------------------------------------------------------------------------------ benchmarks
def makefile_benchmarks() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    m = re.search(r"^BENCHMARKS\s*:=((?:.*\\\n)*.*)$", text, flags=re.M)
    assert m, "the Makefile has no BENCHMARKS := line"
    return m.group(1).replace("\\\n", " ").split()


def readme_command_block() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("## The command line", 1)[1].split("```", 2)[1]
    return block


def test_make_bench_runs_every_registered_benchmark(listed):
    names = sorted(registry.BENCHMARKS)
    assert row(listed, "benchmarks") == names
    assert sorted(makefile_benchmarks()) == names, "Makefile BENCHMARKS differs from shared_rl.registry.BENCHMARKS"
    assert len(set(makefile_benchmarks())) == len(makefile_benchmarks())
    assert "$(BENCHMARKS)" in (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]


def test_readme_names_every_benchmark_and_only_real_ones():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"grove bench ([a-z0-9][a-z0-9-]*)", text))
    assert named, "README names no `grove bench NAME`"
    assert not sorted(named - set(registry.BENCHMARKS)), f"README names benchmarks that do not exist: {named - set(registry.BENCHMARKS)}"
    lines = readme_command_block().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("grove bench NAME"))
    comment = [lines[at].split("#", 1)[1]]  # its comment and the comment lines under it
    comment += [ln for ln in (lines[at + 1:] + [""])[:next(j for j, ln in enumerate(lines[at + 1:] + [""])
                                                           if not ln.lstrip().startswith("#"))]]
    listed_there = set(re.findall(r"[a-z0-9][a-z0-9-]+", " ".join(comment)))
    assert not missing(registry.BENCHMARKS, listed_there), \
        f"README's `grove bench NAME` line lacks {missing(registry.BENCHMARKS, listed_there)}"
    assert "`make bench` runs every benchmark" in " ".join(text.split())


# ------------------------------------------------------------------------------------------------ visgen
def test_visgen_catalog_equals_its_registries():
    """``visgen/catalog.py`` is text so that ``grove list`` imports no diffusers; here the real registries."""
    import typing

    from visgen import catalog as cat
    from visgen.domain import VisgenConfig
    from visgen.methods import METHODS
    from visgen.objectives import OBJECTIVES
    from visgen.pipelines import ADAPTERS
    from visgen.tasks.base import TASKS

    real = {"METHODS": METHODS, "OBJECTIVES": OBJECTIVES, "TASKS": TASKS, "PIPELINE_FAMILIES": ADAPTERS,
            "KERNELS": typing.get_args(typing.get_type_hints(VisgenConfig)["kernel"])}
    for name, names in real.items():
        assert sorted(getattr(cat, name)) == sorted(names), f"visgen/catalog.py {name} differs from its registry"


def test_visgen_names_are_listed_and_documented(listed):
    from visgen import catalog as cat

    assert row(listed, "visgen: rollout methods") == list(cat.METHODS)
    assert row(listed, "visgen: training objectives") == list(cat.OBJECTIVES)
    assert row(listed, "visgen: tasks") == list(cat.TASKS)
    assert row(listed, "visgen: SDE kernels") == list(cat.KERNELS)
    assert row(listed, "visgen: pipeline families") == list(cat.PIPELINE_FAMILIES)
    methods = page_words(*(DOCS / "methods").glob("*.md"))
    assert not missing(cat.METHODS, methods), f"rollout methods on no docs/methods page: {missing(cat.METHODS, methods)}"
    assert not missing(cat.OBJECTIVES, methods), f"objectives on no docs/methods page: {missing(cat.OBJECTIVES, methods)}"
    assert not missing(cat.KERNELS, methods), f"SDE kernels on no docs/methods page: {missing(cat.KERNELS, methods)}"
    tasks = page_words(DOCS / "rewards.md", *(DOCS / "tasks").glob("*.md"))
    assert not missing(cat.TASKS, tasks), f"tasks in neither docs/tasks/ nor docs/rewards.md: {missing(cat.TASKS, tasks)}"
    models = page_words(ROOT / "README.md", DOCS / "methods" / "video.md")
    assert not missing(cat.PIPELINE_FAMILIES, models), \
        f"pipeline families in neither README nor docs/methods/video.md: {missing(cat.PIPELINE_FAMILIES, models)}"


def test_every_visgen_reward_is_listed_and_in_rewards_md(listed):
    from visgen.catalog import register_rewards

    names = register_rewards()
    assert row(listed, "visgen: rewards") == names
    assert not missing(names, page_words(DOCS / "rewards.md")), "rewards missing from docs/rewards.md"


# ------------------------------------------------------------------------------------------------ llm, robotics
def test_llm_names_are_listed_and_in_llm_md(listed):
    from shared_rl.llm.rewards import BUILTIN_REWARDS

    # callables a Python API caller passed (python:<name>:<n>) register for their process only: not the catalogue
    builtin = {k: v for k, v in BUILTIN_REWARDS.items() if not k.startswith("python:")}
    assert [n for n in row(listed, "llm: rewards") if not n.startswith("python:")] == sorted(builtin)
    llm = page_words(DOCS / "methods" / "llm.md")
    assert not missing(builtin, llm), "LLM rewards missing from docs/methods/llm.md"
    assert not missing(row(listed, "llm: rollout engines"), llm), "LLM engines missing from docs/methods/llm.md"


def test_robotics_catalog_equals_its_sources(listed):
    """``robotics/catalog.py`` is text so that ``grove list`` imports no MuJoCo; here the real sources."""
    import typing

    pytest.importorskip("metaworld")
    from robotics import catalog as cat
    from robotics.cli import TOOLS
    from robotics.config import RoboticsConfig
    from robotics.envs.metaworld_env import known_tasks
    from robotics.envs.vector import DEFAULT_TASKS

    assert list(cat.HEAD_MODES) == list(typing.get_args(typing.get_type_hints(RoboticsConfig)["head_mode"])), \
        "robotics/catalog.py HEAD_MODES differs from RoboticsConfig.head_mode"
    assert list(cat.DEFAULT_TASKS) == list(DEFAULT_TASKS), "robotics/catalog.py DEFAULT_TASKS differs"
    assert sorted(cat.METAWORLD_V3_TASKS) == sorted(known_tasks()), "robotics/catalog.py METAWORLD_V3_TASKS differs"
    assert sorted(cat.TOOLS) == sorted(TOOLS), "robotics/catalog.py TOOLS differs from robotics.cli.TOOLS"
    from robotics.envs.libero_tasks import SUITES

    assert [t.split("/")[0] for t in cat.LIBERO_TASKS] == list(SUITES), "robotics/catalog.py LIBERO_TASKS differs"
    assert row(listed, "robotics: LIBERO tasks") == list(cat.LIBERO_TASKS)
    assert row(listed, "robotics: exploration modes") == list(cat.HEAD_MODES)
    assert row(listed, "robotics: tools") == list(cat.TOOLS)
    assert not missing(cat.HEAD_MODES, page_words(*(DOCS / "methods").glob("*.md")))
    assert not missing(cat.TOOLS, page_words(ROOT / "README.md")), "robotics tools missing from README"


def test_the_benchmark_counts_the_readme_quotes_are_the_registry_s():
    """"all N that `grove list` names" and "one of the N below": N is the number of registered benchmarks (the
    count went stale once, 11 against 14)."""
    text = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.findall(r"all (\d+) that `grove list` names", text) + re.findall(r"one of the (\d+) below", text)
    assert len(quoted) == 2, f"README's benchmark counts not found where expected: {quoted}"
    assert {int(n) for n in quoted} == {len(registry.benchmark_names())}, (quoted, registry.benchmark_names())
