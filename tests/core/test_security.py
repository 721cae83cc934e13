"""Security rules of the code base: safetensors checkpoints, torch.load only with weights_only=True, no pickle,
no shell from configs. (The layering and import-cycle rules are in ``test_architecture.py``.)"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("shared_rl", "visgen", "robotics", "bench") for p in (ROOT / d).rglob("*.py")]


def test_every_torch_load_is_weights_only():
    bad = []
    for p in SOURCES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load" and \
                    getattr(node.func.value, "id", None) == "torch":
                kw = {k.arg: k.value for k in node.keywords}
                if not (isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"torch.load without weights_only=True: {bad}"


def test_no_pickle_and_no_shell():
    bad = []
    for p in SOURCES:
        src = p.read_text()
        if re.search(r"^\s*(import pickle|from pickle|import dill|import cloudpickle)", src, re.M):
            bad.append(f"{p.relative_to(ROOT)}: pickle")
        if re.search(r"shell\s*=\s*True|os\.system\(", src):
            bad.append(f"{p.relative_to(ROOT)}: shell")
    assert not bad, bad

