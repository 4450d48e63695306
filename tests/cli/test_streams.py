"""stdout/stderr that vanish (a dead pipe reader, a closed descriptor) never break or misdirect apr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def _python(code: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=60, **kw)


def test_writes_after_the_reader_is_gone_are_dropped_and_the_process_goes_on(tmp_path):
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will ever read
    done = tmp_path / "done"
    proc = _python(f"""
        import sys
        from apr.cli.streams import guard_std_streams
        guard_std_streams()
        for i in range(3):
            print("line", i)
            print("warning", i, file=sys.stderr)
        open({str(done)!r}, "w").write("ok")
    """, stdout=write_end, stderr=write_end)
    os.close(write_end)
    assert proc.returncode == 0 and done.read_text() == "ok"


def test_a_descriptor_closed_at_start_is_never_given_to_a_file(tmp_path):
    target = tmp_path / "checkpoint.bin"
    code = textwrap.dedent(f"""
        import os, sys
        from apr.cli.streams import guard_std_streams
        guard_std_streams()
        f = open({str(target)!r}, "w")
        print("this line must not land in the file")
        sys.stdout.flush()
        os.write(1, b"nor what a C library writes to descriptor 1\\n")
        f.write("data")
        f.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["sh", "-c", 'exec "$0" -c "$1" >&-', sys.executable, code], env=env, timeout=60,
                          stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 0, proc.stderr
    assert target.read_text() == "data"


def test_a_captured_stream_is_left_alone(capsys):
    from apr.cli.streams import guard_std_streams

    before = sys.stdout
    guard_std_streams()
    assert sys.stdout is before
    print("captured")
    assert capsys.readouterr().out == "captured\n"
