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
