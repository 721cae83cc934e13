"""The README's "From Python" block runs verbatim from the checkout (issue 50: snippets that need no guessing)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_python_block_runs_as_written(tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## From Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    # the snippet's relative paths are the checkout's; its run directory lands in a temporary folder
    code = code.replace('run_dir="runs/toy-py"', f'run_dir={str(tmp_path / "toy-py")!r}')
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "toy-py" / "config.yaml").is_file()
