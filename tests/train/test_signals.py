"""Stop signals during a run (apr/train/signals.py): a second signal interrupts at once, but a sweep
trial's parent-death signal, which Linux sends once per thread of the dying worker, is one stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from apr.train import signals
from apr.train.signals import Interrupted, StopSignals


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the Python-level handler runs at the next bytecode boundary


def test_a_second_signal_interrupts_at_once():
    with pytest.raises(Interrupted), StopSignals(True, lambda line: None) as stop:
        _send(signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        _send(signal.SIGTERM)


def test_the_parent_death_signal_repeated_by_the_kernel_is_one_stop(monkeypatch):
    # a sweep's trial (PR_SET_PDEATHSIG SIGTERM) whose worker died: the kernel sends SIGTERM as it hands
    # the orphan from one exiting thread of the worker to the next. The run finishes its step, and the
    # repeats still on their way once the loop is over do not kill it while it records its end.
    monkeypatch.setattr(signals, "parent_death_signal", lambda: signal.SIGTERM)
    cleared = []
    monkeypatch.setattr(signals, "clear_parent_death_signal", lambda: cleared.append(True))
    before = signal.getsignal(signal.SIGTERM)
    lines = []
    try:
        with StopSignals(True, lines.append) as stop:
            for _ in range(3):
                _send(signal.SIGTERM)
            assert stop.received == signal.SIGTERM and cleared  # one stop; no more are sent
            stop.announce()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        _send(signal.SIGTERM)  # a late repeat: ignored
    finally:
        signal.signal(signal.SIGTERM, before)
    assert lines == ["SIGTERM: finishing this step and writing a checkpoint (SIGINT exits at once)"]
    # another signal after it still interrupts at once
    try:
        with pytest.raises(Interrupted), StopSignals(True, lambda line: None):
            _send(signal.SIGTERM)
            _send(signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, before)


CHILD = """
import os, sys, time
from pathlib import Path
from apr.train.signals import StopSignals
with StopSignals(True, print) as stop:
    print("ready", os.getpid(), flush=True)
    while stop.received is None:
        time.sleep(0.005)
    print("stopping", flush=True)
    while not Path(sys.argv[1]).exists():  # finishing the step, while the kernel repeats the signal
        time.sleep(0.005)
print("stopped by", stop.received, flush=True)
while not Path(sys.argv[1] + ".end").exists():  # recording the end of the run, the loop's handlers gone
    time.sleep(0.005)
print("recorded the end", flush=True)
"""

# a sweep worker starting its trial as apr/sweep/trial.py does
WORKER = """
import subprocess, sys, time
from apr.sweep.trial import _die_with_parent
out = open(sys.argv[2], "ab")
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[3]], stdout=out, stderr=subprocess.STDOUT,
                 start_new_session=True, preexec_fn=_die_with_parent)
time.sleep(300)
"""


def _wait_for(path: Path, text: str, proc=None) -> str:
    deadline = time.monotonic() + 60
    while text not in (found := path.read_text() if path.exists() else ""):
        assert (proc is None or proc.poll() is None) and "Traceback" not in found and time.monotonic() < deadline, found
        time.sleep(0.02)
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_trial_whose_worker_is_killed_stops_once_though_the_signal_comes_again(tmp_path: Path):
    # The worker is SIGKILLed: its trial gets SIGTERM (PR_SET_PDEATHSIG), then again while it finishes
    # its step and after (what the kernel does for each thread of a multi-threaded worker): one
    # graceful stop, and the end of the run recorded.
    out, repeated = tmp_path / "child.log", tmp_path / "repeated"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(signals.__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), textwrap.dedent(CHILD), str(out),
                               str(repeated)], env=env)
    try:
        child = int(_wait_for(out, "ready", worker).split()[1])
    finally:
        worker.kill()
        worker.wait()
    _wait_for(out, "stopping")
    os.kill(child, signal.SIGTERM)
    repeated.touch()
    _wait_for(out, "stopped by")
    os.kill(child, signal.SIGTERM)
    Path(f"{repeated}.end").touch()
    text = _wait_for(out, "recorded the end")
    assert text.split("\n")[1:4] == ["stopping", f"stopped by {int(signal.SIGTERM)}", "recorded the end"], text
