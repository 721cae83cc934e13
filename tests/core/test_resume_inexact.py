"""``--resume`` on a checkpoint that lacks some part's state, and a dead helper process (issue 65).

- A checkpoint written before a part saved its state (here: the toy domain, at resume, starts saving an extra-state
  key and a tensor the checkpoint has not got) is refused with exit 2 and one line naming what is missing, the run
  untouched; ``resume.allow_inexact=true`` continues, warns, and records the gap in the next metrics record.
- ``grove eval`` of the same checkpoint is not refused: it reads only the weights.
- A ``WorkerDied`` during a run (an env worker killed) is exit 1 and one ``grove: error:`` line that says how to
  resume; the run directory keeps its checkpoint and ``--resume`` finishes it.
"""
import json

import pytest
import torch
import yaml

from shared_rl.cli import main
from shared_rl.errors import WorkerDied
from shared_rl.toy import ToyDomain
from tests.core.test_resume import GOOD, tree_state

MISSING = "tensors critic.* (2), domain state 'replay_history'"


def _lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """A finished 3-iteration toy run; from then on the toy saves two more pieces of state (as a newer grove whose
    parts learned to save theirs would)."""
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(GOOD))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 0
    real_state, real_extra = ToyDomain.state_dict, ToyDomain.extra_state
    monkeypatch.setattr(ToyDomain, "state_dict", lambda self: {**real_state(self), "critic.w": torch.zeros(2),
                                                               "critic.b": torch.zeros(1)})
    monkeypatch.setattr(ToyDomain, "extra_state", lambda self: {**real_extra(self), "replay_history": []})
    return run


def test_a_checkpoint_without_a_parts_state_is_refused_in_one_line(old_run, capsys):
    before = tree_state(old_run)
    assert main(["train", "--resume", str(old_run), "iterations=5"]) == 2
    err = _lines(capsys)
    assert len(err) == 1 and err[0].startswith("grove: error: checkpoint "), err
    assert f"step_000003 lacks the state of {MISSING} (written before those parts saved it): a resume from it would " \
           f"not be exact; nothing was changed. Pass resume.allow_inexact=true" in err[0]
    assert tree_state(old_run) == before


def test_allow_inexact_continues_and_records_the_gap(old_run, capsys):
    with pytest.warns(UserWarning, match="lacks the state of"):
        assert main(["train", "--resume", str(old_run), "iterations=5", "resume.allow_inexact=true"]) == 0
    records = [json.loads(line) for line in (old_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert records[4]["resume/inexact"] == f"lacked the state of {MISSING}"
    assert "resume/inexact" not in records[5] and "resume/overrides" in records[4]


def test_eval_reads_the_weights_of_an_older_checkpoint(old_run, tmp_path, capsys):
    assert main(["eval", str(old_run), "--out", str(tmp_path / "ev")]) == 0
    assert (tmp_path / "ev" / "results.json").is_file()


class DyingToy(ToyDomain):
    """The toy bandit whose env worker dies in iteration ``at`` (as ``robotics.envs.vector`` reports one)."""

    at = 2

    def rollout(self, keys, group_size, generator, iteration):
        if iteration == self.at:
            raise WorkerDied("Meta-World env worker 0 (pid 4711, task reach-v3) died during step_chunk: killed by "
                             "SIGKILL")
        return super().rollout(keys, group_size, generator, iteration)


def test_a_dead_worker_is_exit_1_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    from shared_rl import registry

    monkeypatch.setitem(registry.DOMAINS, "dying_toy", f"{__name__}:DyingToy")
    data = {**GOOD, "domain": "dying_toy", "iterations": 4, "checkpoint": {"every": 1, "keep_last": 5},
            "dying_toy": GOOD["toy"]}
    data.pop("toy")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run)]) == 1
    err = _lines(capsys)
    assert err[-1] == ("grove: error: Meta-World env worker 0 (pid 4711, task reach-v3) died during step_chunk: "
                       f"killed by SIGKILL; the newest checkpoint is kept: resume with: grove train --resume {run}")
    assert sum(line.startswith("grove: error:") for line in err) == 1 and not any("Traceback" in x for x in err)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    monkeypatch.setattr(DyingToy, "at", -1)
    assert main(["train", "--resume", str(run)]) == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(5))
