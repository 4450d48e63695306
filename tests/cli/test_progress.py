"""The apply progress bar: drawn on a terminal, absent otherwise, never mixed with log lines."""

from __future__ import annotations

import io

from apr.cli.progress import TerminalProgress


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_is_drawn_on_a_terminal_and_log_lines_print_above_it():
    out = FakeTty()
    p = TerminalProgress(out)
    p.update(5, 10)
    p.echo("step 5/10  loss 1.0")
    p.update(10, 10)
    p.close()
    text = out.getvalue()
    assert "[###############...............] 5/10  50.0%" in text
    assert "\r\x1b[Kstep 5/10  loss 1.0\n[###" in text  # bar cleared, line printed, bar redrawn
    assert "10/10 100.0%" in text and text.endswith("\r\x1b[K")


def test_no_bar_when_not_a_terminal():
    out = io.StringIO()
    p = TerminalProgress(out)
    p.update(1, 2)
    p.echo("a line")
    p.close()
    assert out.getvalue() == "a line\n"


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_bar_labels_elapsed_and_a_smoothed_eta():
    out, clock = FakeTty(), FakeClock()
    p = TerminalProgress(out, clock=clock)
    p.update(0, 100)
    assert "elapsed 0s  ETA –" in p._line  # no rate yet: no made-up ETA
    for step in range(1, 51):  # 2 steps/s
        clock.t += 0.5
        p.update(step, 100)
    assert "50/100" in p._line and "elapsed 25s  ETA 25s  2 steps/s" in p._line
    clock.t += 3.0  # one slow step (another process took the CPU)
    p.update(51, 100)
    eta = p._line.split("ETA ")[1].split("  ")[0]
    assert eta in ("26s", "27s", "28s", "29s"), p._line  # a per-step rate would say 2m 27s
