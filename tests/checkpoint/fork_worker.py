"""A fork server for the SIGKILL tests: imports torch and apr once, then runs each trainer in a
forked child (tests/train/run_worker.py's ``main``), so twenty kills do not pay twenty interpreter
starts. The child is a real process: SIGKILL ends it wherever it is, inside a checkpoint write too.

Protocol, one line each: stdin ``<config.json> <resume value or ->``; the server writes
``@@start <n>`` to stderr on a line of its own (the children's stderr is the server's) and
``pid <pid>`` to stdout, then, when the child ends, ``exit <code>`` (``-9`` for SIGKILL) to stdout
(the children's stdout goes to /dev/null, so nothing else lands there). No torch op runs in the
server, so forking it is safe."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
import run_worker  # noqa: E402  (imports torch and apr.train.run)


def serve() -> None:
    for n, line in enumerate(sys.stdin):
        cfg, resume = line.split()
        sys.stderr.write(f"\n@@start {n}\n")  # the newline ends a line a killed child left half-written
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the trainer
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            sys.argv = ["run_worker", cfg] + ([] if resume == "-" else [resume])
            try:
                code = run_worker.main()
            except BaseException:  # noqa: BLE001  (a crash is reported, as an interpreter would)
                import traceback

                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    serve()
