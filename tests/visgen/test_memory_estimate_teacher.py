"""``grove train --dry-run``'s memory estimate counts on-policy distillation's frozen teacher
(``visgen.parameter_count``): the teacher pipeline's own transformer, read on the meta device from its
``transformer/config.json``, frozen in ``visgen.dtype`` and replicated under fsdp2 — the estimate grows by exactly its
parameter bytes; a teacher not readable yet is counted at the student's size and says so."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shared_rl.config import apply_overrides, load_train_config, load_yaml
from shared_rl.memory_estimate import per_process_bytes

ROOT = Path(__file__).resolve().parents[2]
STUDENT = ROOT / "assets/shapes-sd3-tiny"


def _teacher(tmp_path: Path, num_layers: int) -> Path:
    """A teacher pipeline of the student's family: its model_index and scheduler, and a transformer config with
    ``num_layers`` blocks (no weights: the estimate reads configs only)."""
    teacher = tmp_path / f"teacher{num_layers}"
    (teacher / "transformer").mkdir(parents=True)
    shutil.copy(STUDENT / "model_index.json", teacher / "model_index.json")
    shutil.copytree(STUDENT / "scheduler", teacher / "scheduler")
    config = json.loads((STUDENT / "transformer/config.json").read_text())
    (teacher / "transformer/config.json").write_text(json.dumps({**config, "num_layers": num_layers}))
    return teacher


def _groups(overrides: list[str]):
    cfg = load_train_config(apply_overrides(load_yaml(ROOT / "configs/visgen/shapes_opd.yaml"), overrides))
    return cfg.domain_config.parameter_groups(cfg)


def _built_count(config_path: Path) -> int:
    from diffusers import SD3Transformer2DModel

    return sum(p.numel() for p in SD3Transformer2DModel.from_config(json.loads(config_path.read_text())).parameters())


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2)])
def test_the_estimate_grows_by_the_teachers_parameter_bytes(tmp_path, dtype, size):
    teacher = _teacher(tmp_path, num_layers=6)  # a bigger teacher than the 4-block student: its own config counts
    with_teacher = _groups([f"visgen.objective.teacher={teacher}", f"visgen.dtype={dtype}"])
    without = _groups(["visgen.objective={name: log_prob}", f"visgen.dtype={dtype}"])
    extra = [g for g in with_teacher if g.name.startswith("teacher")]
    assert [(g.name, g.trainable, g.sharded, g.dtype_bytes) for g in extra] == [
        ("teacher transformer (frozen)", False, False, size)]
    n = _built_count(teacher / "transformer/config.json")
    assert extra[0].count == n > _built_count(STUDENT / "transformer/config.json")
    assert [g for g in with_teacher if not g.name.startswith("teacher")] == without
    assert per_process_bytes(with_teacher) - per_process_bytes(without) == n * size
    # fsdp2 shards the student's transformer, not the teacher: every process holds all of it
    assert per_process_bytes(with_teacher, "fsdp2", 2) - per_process_bytes(without, "fsdp2", 2) == n * size


def test_a_teacher_not_made_yet_is_counted_at_the_students_size():
    groups = _groups([])  # the recipe's runs/shapes_teacher: the run that makes it comes first
    student = next(g for g in groups if g.name == "transformer (frozen)")
    teacher = [g for g in groups if g.name.startswith("teacher")]
    assert len(teacher) == 1 and "not readable here" in teacher[0].name
    assert (teacher[0].count, teacher[0].sharded) == (student.count, False)


def test_the_real_teacher_equals_the_loaded_transformer():
    """The meta-device count of a teacher directory equals its loaded transformer's parameters."""
    from visgen.parameter_count import teacher_transformer_parameters
    from visgen.pipelines.load import load_pipeline

    pipe, _, _ = load_pipeline(str(STUDENT), torch.float32)
    assert teacher_transformer_parameters(str(STUDENT)) == sum(p.numel() for p in pipe.transformer.parameters())
