"""The bad-input corpus across domains: every case exits with code 2, prints one actionable line, and leaves the
run directory unwritten. (Trainer-level cases: tests/core/test_cli.py.)"""
import json

import pytest
import yaml

from shared_rl.cli import main


def _visgen(**domain):
    return {"domain": "visgen", "iterations": 1, "logging": {"progress": False}, "visgen": domain}


def _llm(**domain):
    return {"domain": "llm", "iterations": 1, "logging": {"progress": False}, "llm": domain}


def _robotics(**domain):
    return {"domain": "robotics", "iterations": 1, "logging": {"progress": False}, "robotics": domain}


def _files(tmp):
    (tmp / "empty.jsonl").write_text("")
    (tmp / "broken.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    (tmp / "nocol.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    (tmp / "empty.txt").write_text("\n\n")
    return tmp


CASES = {
    # visgen
    "visgen missing model": (_visgen(model="no/such/pipeline"), "no/such/pipeline"),
    "visgen unknown reward": (_visgen(rewards=[{"name": "pickscorr"}]), "pickscorr"),
    "visgen unknown kernel": (_visgen(kernel="euler"), "visgen.kernel"),
    "visgen unknown method": (_visgen(method={"name": "nope"}), "nope"),
    "visgen bad resolution": (_visgen(resolution=30), "resolution"),
    "visgen missing prompt file": (_visgen(task="file", train_prompts="TMP/none.txt"), "none.txt"),
    "visgen empty prompt file": (_visgen(task="file", train_prompts="TMP/empty.txt", eval_prompts="TMP/empty.txt"),
                                 "empty.txt"),
    "visgen negative noise": (_visgen(noise_level=-0.5), "noise_level"),
    "visgen lora rank zero": (_visgen(lora={"rank": 0}), "rank"),
    # llm
    "llm missing model": (_llm(model="no/such/model"), "no/such/model"),
    "llm unknown reward": (_llm(rewards=[{"name": "exact_matchh"}]), "exact_matchh"),
    "llm reward guard bad policy": (_llm(reward_guard={"on_failure": "ignore"}), "on_failure"),
    "visgen reward guard negative retries": (_visgen(reward_guard={"retries": -1}), "reward_guard.retries"),
    "llm empty dataset": (_llm(dataset={"source": "jsonl", "path": "TMP/empty.jsonl"}), "empty.jsonl"),
    "llm malformed jsonl": (_llm(dataset={"source": "jsonl", "path": "TMP/broken.jsonl"}), "broken.jsonl"),
    "llm missing column": (_llm(dataset={"source": "jsonl", "path": "TMP/nocol.jsonl"}), "prompt"),
    "llm missing dataset file": (_llm(dataset={"source": "jsonl", "path": "TMP/none.jsonl"}), "none.jsonl"),
    "llm zero new tokens": (_llm(max_new_tokens=0), "max_new_tokens"),
    "llm negative temperature": (_llm(temperature=-1.0), "temperature"),
    # robotics
    "robotics unknown task": (_robotics(env={"tasks": ["reach-v9"]}), "reach-v9"),
    "robotics missing checkpoint": (_robotics(checkpoint="no/such/vla"), "no/such/vla"),
    "robotics image size mismatch": (_robotics(env={"image_size": 48}), "env gives"),
    "robotics action dim mismatch": (_robotics(checkpoint="", model={"action_dim": 3}), "action_dim"),
    "robotics unknown head mode": (_robotics(head_mode="gaussian"), "head_mode"),
    "robotics bad horizon": (_robotics(env={"horizon": 0}), "horizon"),
    # supervised entry points
    "pretrain without domain": ({"kind": "supervised"}, "domain"),
    "pretrain unknown domain": ({"kind": "supervised", "domain": "audio"}, "audio"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_domain_bad_input(tmp_path, capsys, name):
    data, expect = CASES[name]
    tmp = _files(tmp_path)
    text = yaml.safe_dump(data).replace("TMP/", f"{tmp}/")
    cfg = tmp / "bad.yaml"
    cfg.write_text(text)
    out = tmp / "run"
    code = main(["train", str(cfg), "--out", str(out)])
    err = [l for l in capsys.readouterr().err.strip().splitlines() if l.strip()]
    assert code == 2, err[-5:]
    assert len(err) == 1 and err[0].startswith("grove: error: ") and expect in err[0], err
    assert not out.exists()
