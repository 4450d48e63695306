"""Start N ranks of a script the way ``torchrun --standalone --nproc_per_node=N`` describes them
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without torchrun's own
process: on the 2-core test machine that process costs 3-4 s of import per launch, and the suite
launches 2-rank runs dozens of times. As torchrun does, a rank that fails takes the others down.
The product's own torchrun path stays tested end to end (tests/cli/test_apply_cli.py, the kill
tests in tests/distributed/test_sharding.py and tests/train/test_mixture_run.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGS`` as ``nproc`` ranks; the result's return code is the first failing rank's (0
    when all succeed), its output every rank's in rank order."""
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="apr-ranks-") as tmp:
        outs = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(nproc)]
        procs = []
        for r, (out, err) in enumerate(outs):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            with out.open("w") as o, err.open("w") as e:
                procs.append(subprocess.Popen([sys.executable, *args], stdout=o, stderr=e, env=rank_env))
        deadline, code = time.monotonic() + timeout, 0
        try:
            while any(p.poll() is None for p in procs):
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                if failed:  # one rank died: the others would wait at a collective until the timeout
                    code = failed[0]
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, timeout)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        code = code or next((p.returncode for p in procs if p.returncode), 0)
        stdout = "".join(o.read_text() for o, _ in outs)
        stderr = "".join(e.read_text() for _, e in outs)
    return subprocess.CompletedProcess([sys.executable, *args], code, stdout, stderr)
