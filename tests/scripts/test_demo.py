"""scripts/demo.sh (`make demo`): plain text when its output is piped or logged, bold headings on a
terminal unless NO_COLOR is set. The script runs for real, with a stand-in `apr` on PATH (the demo's
own commands are tested where they live), so this takes a fraction of a second."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "scripts" / "demo.sh"

FAKE_APR = """#!/usr/bin/env bash
# stands in for apr: says what it was asked; `monitor --json` prints a finished run's record
if [ "$1" = monitor ]; then
  echo '{"state": {"run_id": "r1", "status": "finished", "step": 3, "total_steps": 3, "loss": 2.5,
         "val_loss": 2.75, "val_loss_history": [[0, 5.5], [3, 2.75]]}}'
else
  echo "apr $*"
fi
"""


def _demo_env(tmp_path: Path, **extra: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "apr"
    fake.write_text(FAKE_APR)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", APR_DEMO_OUT=str(tmp_path / "out"),
               APR_HOME=str(tmp_path / "home"), **extra)
    return env


def _on_a_terminal(env: dict) -> str:
    """The demo's output with its stdout on a pseudo-terminal, as `make demo` in a shell has it."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen(["bash", str(DEMO)], stdout=follower, stderr=follower, env=env)
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end closed
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=60) == 0, b"".join(chunks)
    finally:
        os.close(leader)
    return b"".join(chunks).decode("utf-8", "replace")


def test_piped_output_has_no_escape_codes(tmp_path):
    proc = subprocess.run(["bash", str(DEMO)], env=_demo_env(tmp_path), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "==> 1/6 Train a byte-level BPE tokenizer" in out and "==> 6/6 What the run recorded" in out
    assert "run r1: status finished, step 3/3, train loss 2.500, val loss 5.500 -> 2.750" in out
    assert "\x1b" not in out, [line for line in out.splitlines() if "\x1b" in line]
    assert json.loads((tmp_path / "out" / "state.json").read_text())["state"]["run_id"] == "r1"  # APR_DEMO_OUT


def test_a_terminal_gets_bold_headings_unless_no_color(tmp_path):
    bold = _on_a_terminal(_demo_env(tmp_path))
    assert "\x1b[1m==> 1/6" in bold  # the same check is what keeps pipes plain: it must see a terminal
    plain = _on_a_terminal(_demo_env(tmp_path, NO_COLOR="1"))
    assert "==> 1/6" in plain and "\x1b" not in plain


@pytest.mark.parametrize("args", [["train", "validate", "configs/train/demo-tiny.yaml"], ["runs", "ls", "--global"]])
def test_the_demos_apr_commands_write_no_escape_codes_into_a_pipe(tmp_path, args):
    """The demo's own apr commands, piped: a finding, a table, nothing coloured."""
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env["APR_HOME"] = str(tmp_path / "home")
    proc = subprocess.run([sys.executable, "-m", "apr", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    assert "\x1b" not in proc.stdout + proc.stderr
