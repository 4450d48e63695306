"""A trainer killed with SIGKILL (no clean exit, possibly inside a checkpoint write) resumes with
``--resume latest`` and ends bitwise equal to a run that was never interrupted."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import config_doc, make_dataset, run_until  # noqa: E402

from apr.checkpoint.manager import read_checkpoint, scan  # noqa: E402
from tests.distributed.ranks import run_apr, run_script  # noqa: E402

WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"
FORK_WORKER = Path(__file__).resolve().parent / "fork_worker.py"

def _env() -> dict:
    """Read at call time, after the fixture has set a private APR_HOME."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _cmd(cfg: Path, resume: bool) -> list[str]:
    return [sys.executable, str(WORKER), str(cfg)] + (["latest"] if resume else [])


def _complete(run_dir: Path) -> bool:
    return any(e.complete for e in scan(run_dir)) if run_dir.is_dir() else False


def _run_to_end(cfg: Path, resume: bool) -> None:
    code, seen = run_until(_cmd(cfg, resume), _env(), timeout=300)
    assert code == 0, "".join(seen[-40:])


def _kill_at_line(cfg: Path, resume: bool, prefix: str) -> None:
    """Start the trainer and SIGKILL it as soon as it prints a line starting with ``prefix``."""
    code, _ = run_until(_cmd(cfg, resume), _env(), kill_at=prefix, timeout=60)
    assert code == -signal.SIGKILL, f"the trainer ended ({code}) before {prefix!r}"


def _write(tmp_path: Path, name: str, **training) -> Path:
    doc = config_doc(tmp_path, training={"output_dir": f"{name}/", **training})
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def _assert_same_state(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert set(ta) == set(tb) and any(n.startswith("optimizer.m.") for n in ta)
    for name in ta:
        assert ta[name].equal(tb[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_sigkill_at_step_27_then_resume_ends_bitwise_equal(tmp_path, accum):
    make_dataset(tmp_path, train_rows=104)  # 26 (or 13) steps per epoch: step 27 is mid-epoch
    common = {"epochs": 10, "max_steps": 60, "gradient_accumulation": accum, "save_interval": 9,
              "log_interval": 1, "eval_interval": 20, "keep_last": 2}
    _run_to_end(_write(tmp_path, "full", **common), resume=False)
    cfg = _write(tmp_path, "killed", **common)
    _kill_at_line(cfg, False, "step 27/60  loss")
    latest = max(e.step for e in scan(tmp_path / "killed") if e.complete)
    assert 18 <= latest <= 27  # 18, 20 (best val) or 27: that one may or may not be written when it died
    _run_to_end(cfg, resume=True)
    _assert_same_state(tmp_path / "killed" / "checkpoint-step-60.safetensors",
                       tmp_path / "full" / "checkpoint-step-60.safetensors")
    state = json.loads((tmp_path / "killed" / "training_state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 60


def _proc_state(pid: int) -> str:
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        return "; ".join(ln for ln in status if ln.startswith(("State", "Threads"))) + \
            f"; wchan {Path(f'/proc/{pid}/wchan').read_text()}"
    except OSError as err:
        return str(err)


class _ForkServer:
    """tests/checkpoint/fork_worker.py: each trainer is a forked child of one pre-imported process."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(FORK_WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.started, self.child, self.seen = 0, 0, []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:  # the children's stderr, read as it comes so that no child blocks on it
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=120)
        except queue.Empty:
            raise AssertionError(f"no output for 120 s from the trainer {self.child}: {_proc_state(self.child)}; "
                                 f"last lines: {self.seen[-5:]}") from None
        assert line is not None, "the fork server died"
        self.seen.append(line)
        return line

    def start(self, cfg: Path, resume: bool) -> int:
        self.proc.stdin.write(f"{cfg} {'latest' if resume else '-'}\n")
        self.proc.stdin.flush()
        marker, self.started = f"@@start {self.started}\n", self.started + 1
        while self.next_line() != marker:  # what the previous child printed before it died
            pass
        self.child = int(self.proc.stdout.readline().split()[1])
        return self.child

    def exit_code(self) -> int:
        return int(self.proc.stdout.readline().split()[1])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.mark.slow
def test_twenty_random_sigkills_never_leave_a_corrupt_checkpoint(tmp_path):
    """Twenty SIGKILLs at seeded points (the k-th logged step, then up to 20 ms more: inside a step or
    inside one of the checkpoint writes that every second step makes), each followed by a resume."""
    make_dataset(tmp_path)
    common = {"epochs": 40, "max_steps": 240, "save_interval": 2, "keep_last": 2, "log_interval": 1,
              "eval_interval": 0}
    server = _ForkServer()
    try:
        # the reference saves only at its end: checkpoint writes must not change what a run computes
        server.start(_write(tmp_path, "full", **{**common, "save_interval": 1000}), resume=False)
        assert server.exit_code() == 0
        cfg = _write(tmp_path, "chaos", **common)
        run_dir = tmp_path / "chaos"
        rng = random.Random(1234)
        for kill in range(20):
            pid = server.start(cfg, resume=_complete(run_dir))
            steps = rng.randint(1, 7)  # 20 kills advance the run by at most ~200 of its 240 steps
            while steps:
                line = server.next_line()
                assert not line.startswith("Traceback"), line
                steps -= line.startswith("step ") and "loss" in line
            time.sleep(rng.uniform(0.0, 0.02))
            os.kill(pid, signal.SIGKILL)
            assert server.exit_code() == -signal.SIGKILL, f"kill {kill + 1}: the run ended before it"
            # every checkpoint that looks complete verifies (size, SHA-256, tensors of this model)
            for entry in scan(run_dir):
                if entry.complete:
                    read_checkpoint(entry.json_path, verify=True)
        server.start(cfg, resume=_complete(run_dir))
        assert server.exit_code() == 0
    finally:
        server.close()
    _assert_same_state(run_dir / "checkpoint-step-240.safetensors",
                       tmp_path / "full" / "checkpoint-step-240.safetensors")


def _apr(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m apr ARGS``, forked from the test worker's server (tests/distributed/ranks.py)."""
    return run_apr(list(args), {**_env(), "NO_COLOR": "1"}, cwd=cwd)


# apply, SIGKILLed inside the first checkpoint JSON's write: half of it in the temp file, the weights renamed
KILL_IN_FIRST_JSON = """
import os, signal, sys
import apr.checkpoint.manager as manager
def killed(path, doc, **kw):
    (path.parent / f".{path.name}.x1y2.tmp").write_text('{"format": "apr-che')
    os.kill(os.getpid(), signal.SIGKILL)
manager.atomic_write_json = killed
from apr.cli.main import app
sys.argv = ["apr", "train", "apply", sys.argv[1]]
app()
"""


@pytest.mark.slow  # three applies in processes of their own
def test_a_run_killed_while_writing_its_first_checkpoints_json_is_started_afresh_never_a_dead_end(tmp_path):
    """The weights are renamed into place before the JSON: a kill between the two leaves weights without
    JSON, which is no checkpoint. --resume latest says so and names the way on; a fresh apply replaces it."""
    from run_helpers import write_config

    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 4, "save_interval": 4, "eval_interval": 100})
    script = tmp_path / "kill_in_first_json.py"
    script.write_text(KILL_IN_FIRST_JSON)
    killed = run_script([str(script), str(cfg)], {**_env(), "NO_COLOR": "1"}, timeout=300, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("*checkpoint*")) == [".checkpoint-step-4.json.x1y2.tmp",
                                                                  "checkpoint-step-4.safetensors"]
    weights = (run / "checkpoint-step-4.safetensors").read_bytes()

    resumed = _apr("train", "apply", str(cfg), "--resume", "latest", cwd=tmp_path)
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    assert "interrupted save" in resumed.stderr and "without --resume" in resumed.stderr, resumed.stderr
    assert (run / "checkpoint-step-4.safetensors").read_bytes() == weights  # nothing removed by the refusal

    fresh = _apr("train", "apply", str(cfg), cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "checkpoint-step-4.safetensors" in fresh.stderr and "interrupted save" in fresh.stderr
    assert read_checkpoint(run / "checkpoint-step-4.json", trainer_state=True).step == 4
    assert not list(run.glob(".checkpoint-*.tmp"))  # the half-written JSON went with the first save's pruning


def test_weights_without_json_that_apr_did_not_write_still_keep_a_fresh_run_out(tmp_path):
    from apr.errors import AprError
    from apr.train.outdir import refuse_foreign_files

    (tmp_path / "checkpoint-step-7.safetensors").write_bytes(b"someone's own file")
    with pytest.raises(AprError, match="checkpoint-step-7.safetensors"):
        refuse_foreign_files(tmp_path, tmp_path / "cfg.yaml")
