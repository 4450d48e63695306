"""Start N ranks of a script the way ``torchrun --standalone --nproc_per_node=N`` describes them
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without torchrun's own
process: on the 2-core test machine that process costs 3-4 s of import per launch, and the suite
launches 2-rank runs dozens of times. As torchrun does, a rank that fails takes the others down.
The product's own torchrun path stays tested end to end (tests/cli/test_apply_cli.py, the kill
tests in tests/distributed/test_sharding.py and tests/train/test_mixture_run.py).

Each rank (and each one-process run, ``run_script``) is a process forked from a server that has
imported torch and the other third-party libraries once (multiprocessing's forkserver, one per
test worker): an interpreter that imports torch costs ~4 s of CPU here, which the suite used to pay
for every process of every launch. apr itself is imported fresh by each child, the child's
environment is the launch's (``OMP_NUM_THREADS`` applied to torch's thread count, which the
server's import fixed), and no torch op runs in the server, so forking it is safe. The interpreter
start of ``apr train apply`` stays tested by the CLI tests."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# what every training process imports before apr (apr itself is imported by each child, fresh);
# torch._dynamo is imported by torch.optim's constructors (~1.7 s of CPU a process here)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "pyarrow", "pyarrow.parquet", "safetensors.torch",
           "sqlite_utils", "pydantic", "yaml"]
_context = None


def _forkserver():
    global _context
    if _context is None:
        # the server's environment is what OpenMP reads when it loads with torch: waiting threads
        # sleep, as in a process where apr.threads runs before torch (apr/threads.py)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(args: list[str], env: dict, out: str, err: str, cwd: str | None = None) -> None:
    """One process of a launch, in the forked child: the launch's environment, folder and output
    files, then ``python ARGS`` as the interpreter would run it (``-m MODULE`` too; atexit handlers
    included)."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = list(args)
    code = 0
    try:
        if args[0] == "-m":  # python -m MODULE ARGS: argv[0] becomes the module's file, as there
            sys.argv = list(args[1:])
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001  (reported as an interpreter would)
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_script(args: list[str], env: dict, out: Path | str, err: Path | str, cwd: Path | str | None = None):
    """``python ARGS`` started in a forked child (in folder ``cwd``) writing its stdout and stderr to
    ``out`` and ``err`` (a FIFO is fine: the child opens it); the multiprocessing Process."""
    where = None if cwd is None else str(cwd)
    proc = _forkserver().Process(target=_child, args=(list(args), dict(env), str(out), str(err), where),
                                 daemon=False)
    proc.start()
    return proc


def run_script(args: list[str], env: dict, timeout: float,
               cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in one forked process (in folder ``cwd``): its return code and output."""
    return run_ranks(args, 1, env, timeout, torchrun=False, cwd=cwd)


def run_apr(args: list[str], env: dict, cwd: Path | str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m apr ARGS`` in one forked process, as ``subprocess.run(..., capture_output=True,
    text=True)`` returns it: for tests that check a command's exit code and output, not the
    interpreter's start (tests/cli and tests/test_lazy_imports.py start real ones)."""
    return run_script(["-m", "apr", *args], env, timeout, cwd=cwd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], nproc: int, env: dict, timeout: float,
              torchrun: bool = True, cwd: Path | str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` as ``nproc`` ranks; the result's return code is the first failing rank's (0
    when all succeed), its output every rank's in rank order."""
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="apr-ranks-") as tmp:
        outs = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(nproc)]
        procs = []
        for r, (out, err) in enumerate(outs):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                        "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            procs.append(start_script(args, rank_env if torchrun else env, out, err, cwd))
        deadline, code = time.monotonic() + timeout, 0
        try:
            while any(p.exitcode is None for p in procs):
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:  # one rank died: the others would wait at a collective until the timeout
                    code = failed[0]
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(args, timeout)
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        code = code or next((p.exitcode for p in procs if p.exitcode), 0)
        stdout = "".join(o.read_text() for o, _ in outs if o.exists())  # absent: the child never started
        stderr = "".join(e.read_text() for _, e in outs if e.exists())
    return subprocess.CompletedProcess([sys.executable, *args], code, stdout, stderr)


WORKER = Path(__file__).resolve().parent.parent / "train" / "run_worker.py"


def launch_worker(doc: dict, path: Path, nproc: int, timeout: float = 240) -> None:
    """Write the config ``doc`` to ``path`` and train it with tests/train/run_worker.py on ``nproc``
    gloo ranks (one process when 1; its own APR_HOME beside ``path``); it must finish."""
    path.write_text(json.dumps(doc))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120", "APR_HOME": str(path.parent / "home")}
    args = [str(WORKER), str(path)]
    proc = run_ranks(args, nproc, env, timeout=timeout) if nproc > 1 else run_script(args, env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def two_ranks_against_one(tmp_path: Path, sharding: str, training: dict, model: dict | None = None) -> tuple:
    """The shape of the feature-on-two-ranks tests (MoE, latent attention, time, custom targets): the
    dataset the caller made under ``tmp_path``, 6 steps of micro-batches of 2 rows, one process
    accumulating 2 against 2 ranks under ``sharding``; checks the step-6 weights and moments agree
    within 1e-6 (relative Frobenius norms) and returns both runs' tensors (two ranks, one process)."""
    # lazy: the forkserver's children unpickle this module; apr stays imported fresh by each run
    from run_helpers import config_doc  # tests/train, on the path of every distributed test

    from apr.checkpoint.manager import read_checkpoint

    common = {"epochs": 1, "max_steps": 6, "save_interval": 6, "eval_interval": 3, "grad_clip": 0.5,
              "log_interval": 3, **training}
    extra = {"model": model} if model else {}
    opt = {"lr": 3e-3, "min_lr": 3e-4}
    one = config_doc(tmp_path, **extra, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "gradient_accumulation": 2, "output_dir": "one/"})
    two = config_doc(tmp_path, **extra, data={"batch_size": 2}, optimizer=opt,
                     training={**common, "sharding": sharding, "output_dir": "two/"})
    launch_worker(one, tmp_path / "one.json", 1)
    launch_worker(two, tmp_path / "two.json", 2)
    a, b = (read_checkpoint(tmp_path / d / "checkpoint-step-6.json").tensors for d in ("two", "one"))
    assert set(a) == set(b)
    worst = max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in a)
    assert worst <= 1e-6, worst
    return a, b
