"""Importing grove's LLM and visgen domains prints none of torchao's import-time notices (issue 42): transformers
and diffusers import torchao themselves when it is installed; shared_rl._quiet drops exactly those notices."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_domain_imports_are_quiet():
    code = ("import logging, visgen.domain, shared_rl.llm.domain\n"
            "logging.getLogger('torch.utils._pytree').warning('another pytree warning')\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore::SyntaxWarning"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "is an Enum subclass" not in text and "Unable to import `torchao`" not in text, text
    assert "another pytree warning" in text  # other warnings of that logger still show
