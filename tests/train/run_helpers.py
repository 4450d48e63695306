"""A tiny, learnable on-disk dataset and config for run-loop tests (CPU, float32, seconds)."""

from __future__ import annotations

import copy
import os
import signal
from pathlib import Path

import numpy as np

VOCAB = 61
SEQ = 16


def write_pattern_shards(folder: Path, rows: int, seed: int, shards: int = 2) -> Path:
    """Rows of a learnable pattern: counting sequences mod VOCAB from random starts, with strides 1-3."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, VOCAB, size=rows)
    strides = rng.integers(1, 4, size=rows)
    data = (starts[:, None] + strides[:, None] * np.arange(SEQ + 1)[None, :]) % VOCAB
    for i, part in enumerate(np.array_split(data.astype(np.uint32), shards)):
        offsets = pa.array(np.arange(len(part) + 1, dtype=np.int32) * (SEQ + 1))
        col = pa.ListArray.from_arrays(offsets, pa.array(part.reshape(-1)))
        pq.write_table(pa.table({"input_ids": col}), folder / f"shard-{i:05d}.parquet")
    return folder


BASE = {
    "model": {"architecture": {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": SEQ}},
    "data": {"train": "data/train/", "val": "data/val/", "batch_size": 4, "seq_len": SEQ},
    "optimizer": {"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 0.1},
    "training": {"epochs": 2, "max_steps": 12, "warmup_steps": 2, "mixed_precision": "fp32", "device": "cpu",
                 "kernels": "torch", "output_dir": "run/", "save_interval": 4, "keep_last": 10,
                 "log_interval": 2, "eval_interval": 4, "eval_batches": 2, "loss_chunk_size": 8, "seed": 3},
    "monitoring": {"tracking": {"experiment": "runtest"}},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_dataset(root: Path, train_rows: int = 96, val_rows: int = 16) -> None:
    write_pattern_shards(root / "data" / "train", train_rows, seed=1)
    write_pattern_shards(root / "data" / "val", val_rows, seed=2, shards=1)


def config_doc(root: Path, **sections) -> dict:
    """BASE with overrides, its relative paths made absolute under ``root``."""
    doc = merge(BASE, sections)
    for key in ("train", "val"):
        if isinstance(doc["data"].get(key), str):  # a mixture's sources (a list) name their own paths
            doc["data"][key] = str(root / doc["data"][key])
    doc["training"]["output_dir"] = str(root / doc["training"]["output_dir"])
    return doc


def write_config(root: Path, name: str = "cfg.yaml", **sections) -> Path:
    from apr.plan.examples import to_yaml

    path = root / name
    path.write_text(to_yaml(config_doc(root, **sections)))
    return path


def signal_at(step_text: str, sig: int = signal.SIGINT):
    """An echo callback that sends ``sig`` to this process when a log line starts with ``step_text``."""
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if line.startswith(step_text):
            os.kill(os.getpid(), sig)

    echo.lines = lines  # type: ignore[attr-defined]
    return echo


def run_until(cmd: list[str], env: dict, kill_at: str | None = None, timeout: float = 120) -> tuple[int, list[str]]:
    """Run ``cmd`` (stdout discarded), reading its stderr line by line; SIGKILL it as soon as a line
    starts with ``kill_at``: the whole job at once (its own session: torchrun and every rank, as when a
    machine dies; a launcher killed alone leaves its ranks holding the run folder for a while).
    Returns (exit code, the stderr lines read)."""
    import os
    import subprocess
    import sys

    if cmd[0] == sys.executable and cmd[1].endswith(".py"):  # a script: forked (tests/distributed/ranks.py)
        return _run_forked_until(cmd[1:], env, kill_at, timeout)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)

    def kill_job() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if kill_at is not None and line.startswith(kill_at):
                kill_job()
                break
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_job()
            proc.wait()
    return proc.returncode, seen


def _run_forked_until(args: list[str], env: dict, kill_at: str | None, timeout: float) -> tuple[int, list[str]]:
    """``run_until`` for ``python SCRIPT ...``: the script in a child of the test worker's fork
    server, its stderr read through a FIFO as it comes. The FIFO is opened without blocking, so a
    child that dies before opening its end cannot hang the test; end of file counts only once the
    child has exited."""
    import os
    import select
    import tempfile
    import time

    from tests.distributed.ranks import start_script

    with tempfile.TemporaryDirectory(prefix="apr-until-") as tmp:
        fifo = os.path.join(tmp, "stderr")
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        proc = start_script(args, env, os.devnull, fifo)
        seen: list[str] = []
        pending, deadline = b"", time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                select.select([fd], [], [], 0.1)
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:  # no writer: not yet opened, or gone
                    if proc.exitcode is not None:
                        break
                    time.sleep(0.02)
                    continue
                *lines, pending = (pending + chunk).split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace") + "\n"
                    seen.append(line)
                    if kill_at is not None and line.startswith(kill_at):
                        proc.kill()
                        proc.join()
                        return proc.exitcode, seen
            if pending:
                seen.append(pending.decode(errors="replace"))
            proc.join(max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        return proc.exitcode, seen


def resume_elsewhere(root: Path, sections: dict, straight, at: int, end: int, quiet: dict) -> dict:
    """The straight run's (under ``root/run``) step-``at`` checkpoint copied into a new folder and
    resumed there with the same ``sections``; asserts it starts at ``at`` and ends at ``end`` with the
    straight run's validation loss and bitwise its step-``end`` tensors, which it returns."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from apr.apply import run_apply

    other = root / "other" / "run"
    other.mkdir(parents=True)
    for suffix in ("json", "safetensors"):
        shutil.copy(root / "run" / f"checkpoint-step-{at}.{suffix}", other)
    moved = {**sections, "training": {**sections.get("training", {}), "output_dir": str(other)}}
    resumed = run_apply(write_config(root, "other.yaml", **moved), resume="latest", **quiet)
    assert resumed.start_step == at and resumed.final_step == end and resumed.val_loss == straight.val_loss
    final = load_file(str(root / "run" / f"checkpoint-step-{end}.safetensors"))
    again = load_file(str(other / f"checkpoint-step-{end}.safetensors"))
    assert [k for k in final if not torch.equal(final[k], again[k])] == []
    return final
