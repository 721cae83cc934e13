"""Every recipe states its memory in its header (issue 64, Build 3): exactly one ``# memory:`` line in the leading
comment block of each configs/**/*.yaml (the accelerate launch files aside), of the one form
``scripts/recipe_memory.py`` writes; at most one ``# peak memory (measured):`` line, right after it, of the fixed
form ``scripts/recipe_memory.py --measure`` writes from one iteration's run (only the CPU recipes measured carry
one); and, for a few cheap recipes (``-m slow``), the estimate line's number is what that script, i.e.
``--dry-run``'s estimate from parameter counts, computes now."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORM = re.compile(r"^# memory: (~[\d.,]+ (B|KiB|MiB|GiB) per process \((replicate|fsdp2), \d+ process(es)?[^)]*\): "
                  r"|not estimated here: |no estimate: )")
MEASURED = re.compile(r"^# peak memory \(measured\): ~[\d.]+ GB resident \((largest process, getrusage ru_maxrss|"
                      r"\d+ processes summed, polled by (psutil|/proc))\), one iteration on \d+ CPU cores? "
                      r"\(grove train (configs/\S+\.yaml) iterations=1( \S+=\S+)*; scripts/recipe_memory\.py "
                      r"--measure\)$")
CHEAP = ["configs/toy.yaml", "configs/llm/arith_grpo.yaml", "configs/robotics/metaworld_grpo.yaml",
         "configs/visgen/shapes_grpo.yaml", "configs/visgen/flux_dev_full_fsdp2.yaml", "configs/llm/arith_sft.yaml"]


def _script():
    spec = importlib.util.spec_from_file_location("recipe_memory", ROOT / "scripts/recipe_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipes() -> list[Path]:
    return [p for p in sorted((ROOT / "configs").rglob("*.yaml")) if "accelerate" not in p.parts]


@pytest.mark.parametrize("path", _recipes(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_header_states_its_memory_once(path):
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    stated = [line for line in header if line.startswith("# memory:")]
    assert len(stated) == 1, f"{path.name}: {len(stated)} '# memory:' lines in its header; run scripts/recipe_memory.py"
    assert FORM.match(stated[0]), stated[0]
    assert sum(line.startswith("# memory:") for line in lines) == 1, "a '# memory:' line outside the header"
    measured = [line for line in lines if line.startswith("# peak memory")]
    assert len(measured) <= 1, f"{path.name}: {len(measured)} measured lines; run scripts/recipe_memory.py --measure"
    if measured:
        m = MEASURED.match(measured[0])
        assert m and measured[0] in header, measured[0]
        assert m.group(3) == str(path.relative_to(ROOT)), f"{path.name}: the measured line names {m.group(3)}"
        assert header.index(measured[0]) == header.index(stated[0]) + 1, "the measured line follows '# memory:'"


def test_the_line_is_a_comment_the_yaml_never_sees():
    import yaml

    script = _script()
    path = ROOT / "configs/toy.yaml"
    text = path.read_text()
    changed = script.with_line(text, "# memory: no estimate: x")
    assert changed != text and yaml.safe_load(changed) == yaml.safe_load(text)
    assert script.with_line(changed, "# memory: no estimate: x") == changed  # replaced in place, never a second
    line = script.measured_line({"recipe": "configs/toy.yaml", "overrides": ["iterations=1"], "single_peak": 9e8,
                                 "tree_peak": 8e8, "processes": 1})
    assert MEASURED.match(line), line
    measured = script.with_measured(changed, line)
    assert yaml.safe_load(measured) == yaml.safe_load(text)
    assert script.with_measured(measured, line) == measured  # replaced in place, never a second
    assert script.with_line(measured, "# memory: no estimate: x") == measured  # the estimate pass keeps it
    summed = script.measured_line({"recipe": "configs/toy.yaml", "overrides": ["iterations=1", "eval.at_start=false"],
                                   "single_peak": 1e9, "tree_peak": 2.5e9, "processes": 3})
    assert MEASURED.match(summed) and "~2.5 GB" in summed and "3 processes summed" in summed, summed


@pytest.mark.slow
@pytest.mark.parametrize("recipe", CHEAP)
def test_the_stated_number_is_the_current_estimate(recipe):
    """The line equals the script's computation now (the meta-device counts, or docs/scaling.md's table), and a
    computed one carries the very number ``--dry-run`` prints."""
    from shared_rl.cli import memory_estimate_line
    from shared_rl.config import load_train_config, load_yaml

    path = ROOT / recipe
    line = _script().memory_line(path)
    assert line in path.read_text().splitlines(), f"{recipe}: stale; run scripts/recipe_memory.py"
    data = load_yaml(path)
    if data.get("kind") != "supervised" and "WORLD_SIZE=" not in path.read_text():
        printed = memory_estimate_line(load_train_config(data))
        assert re.search(r"~[\d.,]+ \w+ per process", printed).group(0) in line, (printed, line)
