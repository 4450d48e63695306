"""`apr monitor` in a real pseudo-terminal (pexpect) watching a real training run in the background.

The bytes the monitor writes to the terminal are replayed on a small virtual screen (cursor moves
and text; colours ignored), and the test reads the step and the loss off that screen as they
change, exactly what a person sees over SSH with TERM=xterm and NO_COLOR set.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402

ROWS, COLS = 24, 80
_TOKEN = re.compile(
    r"\x1b\[([0-9;?<>=$]*)([@-~])"  # CSI: cursor moves, colours, modes
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC
    r"|\x1b[^\[\]]"  # other two-byte escapes
    r"|\r|\n"
    r"|[^\x1b\r\n]+"
)


class VirtualScreen:
    """Just enough of a terminal to know which character is in which cell."""

    def __init__(self, rows: int = ROWS, cols: int = COLS):
        self.rows, self.cols = rows, cols
        self.grid = [[" "] * cols for _ in range(rows)]
        self.row = self.col = 0
        self._pending = ""
        self.raw: list[str] = []

    def feed(self, data: str) -> None:
        self.raw.append(data)
        data = self._pending + data
        cut = data.rfind("\x1b")
        if cut != -1 and not _TOKEN.match(data, cut):  # an escape split across two reads
            data, self._pending = data[:cut], data[cut:]
        else:
            self._pending = ""
        for m in _TOKEN.finditer(data):
            tok = m.group(0)
            if m.group(2) is not None:
                params, final = m.group(1), m.group(2)
                if final in "Hf" and not params.startswith("?"):
                    parts = [int(p) if p else 1 for p in params.split(";")] if params else [1, 1]
                    self.row, self.col = parts[0] - 1, (parts[1] if len(parts) > 1 else 1) - 1
                elif final == "J" and params in ("2", "3"):
                    self.grid = [[" "] * self.cols for _ in range(self.rows)]
            elif tok == "\r":
                self.col = 0
            elif tok == "\n":
                self.row = min(self.row + 1, self.rows - 1)
            elif not tok.startswith("\x1b"):
                for ch in tok:
                    if 0 <= self.row < self.rows and 0 <= self.col < self.cols:
                        self.grid[self.row][self.col] = ch
                    self.col += 1

    @property
    def text(self) -> str:
        return "\n".join("".join(r) for r in self.grid)


def _read(child, screen: VirtualScreen, seconds: float) -> None:
    try:
        screen.feed(child.read_nonblocking(1 << 16, timeout=seconds))
    except pexpect.TIMEOUT:
        pass


@pytest.mark.slow
def test_the_monitor_shows_a_live_training_run_in_a_real_terminal(tmp_path, _private_apr_home):
    make_dataset(tmp_path, train_rows=400)  # 100 steps per epoch
    cfg = write_config(tmp_path, training={"epochs": 3, "max_steps": 300, "log_interval": 1, "eval_interval": 0,
                                           "save_interval": 1000})
    run_dir = tmp_path / "run"
    # One torch thread: a tiny model on a busy 2-core box is slower, not faster, with more.
    env = {**os.environ, "APR_HOME": str(_private_apr_home), "TERM": "xterm", "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    monitor = pexpect.spawn(sys.executable, ["-m", "apr", "monitor", str(run_dir), "--refresh", "100"], env=env,
                            dimensions=(ROWS, COLS), encoding="utf-8", codec_errors="replace", timeout=30)
    trainer = None
    screen = VirtualScreen()
    try:
        deadline = time.monotonic() + 120
        while not ("WAITING" in screen.text and "does not exist" in screen.text):  # no run yet: it says so
            assert monitor.isalive() and time.monotonic() < deadline, screen.text
            _read(monitor, screen, 0.2)
        log = tmp_path / "train.log"
        with open(log, "w") as out:
            trainer = subprocess.Popen([sys.executable, "-m", "apr", "train", "apply", str(cfg)], env=env,
                                       stdout=out, stderr=subprocess.STDOUT)
        seen: list[tuple[int, str]] = []  # (step, loss) as read off the screen, in order
        while time.monotonic() < deadline:
            _read(monitor, screen, 0.05)
            step = re.search(r"step ([\d,]+) / 300", screen.text)
            loss = re.search(r"│loss\s+(\d+\.\d{4})", screen.text)
            if step and loss:
                shown = (int(step.group(1).replace(",", "")), loss.group(1))
                if not seen or shown != seen[-1]:
                    seen.append(shown)
            if "FINISHED" in screen.text and seen and seen[-1][0] == 300:
                break
        # The frame that showed FINISHED may have arrived in several reads (the header first): read
        # until the terminal is quiet, then take the final screen.
        for _ in range(5):
            _read(monitor, screen, 0.1)
        step = re.search(r"step ([\d,]+) / 300", screen.text)
        loss = re.search(r"│loss\s+(\d+\.\d{4})", screen.text)
        if step and loss and (int(step.group(1).replace(",", "")), loss.group(1)) != seen[-1]:
            seen.append((int(step.group(1).replace(",", "")), loss.group(1)))
        assert trainer.wait(timeout=60) == 0, log.read_text()
        steps = [s for s, _ in seen]
        assert len(set(steps)) >= 3, seen  # the screen changed while the run went on
        assert steps == sorted(steps) and steps[-1] == 300
        assert len({loss for _, loss in seen}) >= 3, seen
        assert "✓ FINISHED" in screen.text
        final = json.loads((run_dir / "training_state.json").read_text())
        assert seen[-1][1] == f"{final['loss']:.4f}"  # the screen shows what the run recorded
        # TERM=xterm: only the 16 standard colours; NO_COLOR: not even those hues (greys and bold only).
        sgr = {int(p) for codes in re.findall(r"\x1b\[([0-9;]*)m", "".join(screen.raw)) for p in codes.split(";") if p}
        assert not sgr & {38, 48}, "256-colour or true-colour codes on TERM=xterm"
        hues = {*range(31, 37), *range(41, 47), *range(91, 97), *range(101, 107)}
        assert not sgr & hues, sorted(sgr & hues)
        monitor.send("q")
        monitor.expect(pexpect.EOF, timeout=20)
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        monitor.close(force=True)
    assert monitor.exitstatus == 0
