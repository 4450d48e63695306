"""The storage plan: how large a checkpoint is, how many a run writes, the disk the keep policy
needs at its peak, how long the writes take, and the output folder's free space.

It reads the file system's free space (``shutil.disk_usage``, a statfs) and nothing else: no file is
created, no write is timed. The checkpoint's size is exact (the checkpoint manager's own header
arithmetic, apr.checkpoint.manager.weights_file_bytes); the JSON sidecar is bounded by
``SIDECAR_BYTES``; the write speed is an assumption (``WRITE_BYTES_PER_S``), stated as one.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from apr.checkpoint.files import BEST_STEM, STEP_PREFIX
from apr.checkpoint.manager import weights_file_bytes
from apr.config.schema import AprConfig
from apr.plan.datafacts import resolve

# The checkpoint's JSON (step, config, RNG states, data cursor): ~27 KiB for the test models, whose
# CPU RNG state is most of it; bounded generously. tests/plan/test_storage.py checks a real one.
SIDECAR_BYTES = 64 * 1024
# Assumed sustained write speed: a SATA SSD's (NVMe is several times faster, a network disk slower).
WRITE_BYTES_PER_S = 500e6
WRITE_SHARE_WARN = 0.05  # contract C-DISK-002: checkpoint writes above this share of the run's time
# One row_losses record (apr runs blame) in SQLite with its index: 113.5 bytes measured for 256,000 rows
# (shard names of 19 characters, a single source), docs/performance.md "Blame: per-row losses".
ROW_LOSS_BYTES = 115


def row_loss_facts(config: AprConfig, total_steps: int, world_size: int = 1) -> dict:
    """What ``apr runs blame``'s records cost the run's local store: every training row of each
    logged step (the log interval's multiples and the last step)."""
    tr = config.training
    rows = config.data.batch_size * tr.gradient_accumulation * max(world_size, 1)
    logged = total_steps // tr.log_interval + (1 if total_steps % tr.log_interval else 0)
    return {"rows_per_logged_step": rows, "logged_steps": logged, "bytes_per_row": ROW_LOSS_BYTES,
            "bytes": rows * logged * ROW_LOSS_BYTES}


def free_space(path: Path) -> tuple[Path, int] | None:
    """(the nearest existing folder at or above ``path``, its free bytes), or None if unreadable."""
    probe = path
    try:  # a name too long for the file system, or a path under a file: unreadable
        while not probe.exists() and probe.parent != probe:
            probe = probe.parent
        return probe, shutil.disk_usage(probe).free
    except OSError:
        return None


def existing_checkpoint_bytes(run_dir: Path) -> int:
    """Bytes the checkpoints already in ``run_dir`` hold (a resumed run's): the run prunes and
    replaces them, so they count as space it has. Hard links (checkpoint-best) are counted once."""
    seen, total = set(), 0
    try:
        entries = list(os.scandir(run_dir))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith((STEP_PREFIX, BEST_STEM)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.is_file(follow_symlinks=False) and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def checkpoints_written(total_steps: int, save_interval: int, eval_interval: int, validates: bool) -> dict:
    """How many step checkpoints the run loop writes (apr/train/cadence.py): every ``save_interval``
    steps and at the last step, plus, when it validates, one at each evaluation whose loss is the
    best so far. Those depend on the losses: ``best_max`` counts every evaluation not already on a
    save step (the upper bound the disk figures use)."""
    scheduled = total_steps // save_interval + (1 if total_steps % save_interval else 0)
    best_max = 0
    if validates and eval_interval > 0:
        both = save_interval * eval_interval // math.gcd(save_interval, eval_interval)
        best_max = total_steps // eval_interval - total_steps // both
        if total_steps % eval_interval == 0 and total_steps % save_interval:
            best_max -= 1  # the last step is a save step anyway
    return {"scheduled": scheduled, "best_max": best_max, "max": scheduled + best_max}


def storage_facts(config: AprConfig, total_steps: int | None, estimated_seconds: float | None,
                  world_size: int = 1, loss_tensors: dict | None = None) -> dict:
    """The run's checkpoint storage. Without a step count only the per-checkpoint size is known. A
    sharded run (``world_size`` > 1) writes one part per rank, synchronously, the ranks in parallel
    (each at the assumed speed: storage that scales with writers; docs/checkpoints.md)."""
    tr = config.training
    parts = world_size if str(tr.sharding) != "none" and world_size > 1 else 1
    validates = config.data.val is not None and tr.eval_interval > 0
    last_step = total_steps or tr.max_steps or 1
    weights = weights_file_bytes(config, last_step, loss_tensors)  # a narrower student: its projections
    each = weights + SIDECAR_BYTES
    out: dict = {
        "output_dir": str(resolve(tr.output_dir)), "weights_bytes": weights, "sidecar_bytes": SIDECAR_BYTES,
        "checkpoint_bytes": each, "keep_last": tr.keep_last, "best": validates,
        "write_bytes_per_s": WRITE_BYTES_PER_S, "write_speed_basis": "assumed (a SATA SSD's sustained write)",
        "seconds_per_checkpoint": each / parts / WRITE_BYTES_PER_S,
        "background": tr.checkpoint_async and parts == 1, "parts": parts,
    }
    probe = free_space(Path(out["output_dir"]))
    if probe is not None:
        out["free_path"], out["free_bytes"] = str(probe[0]), probe[1]
        out["existing_bytes"] = existing_checkpoint_bytes(Path(out["output_dir"]))
        out["available_bytes"] = probe[1] + out["existing_bytes"]
    if total_steps is None:
        return out
    written = checkpoints_written(total_steps, tr.save_interval, tr.eval_interval, validates)
    # The manager writes the new pair before it prunes the oldest: keep_last + 1 pairs at the peak;
    # checkpoint-best is a hard link, a full copy once its step is pruned: counted as one more.
    peak_pairs = min(written["max"], tr.keep_last + 1) + (1 if validates else 0)
    kept_pairs = min(written["max"], tr.keep_last) + (1 if validates else 0)
    out["row_losses"] = row_loss_facts(config, total_steps, world_size)
    out.update({"written": written, "peak_checkpoints": peak_pairs, "peak_bytes": peak_pairs * each,
                "kept_checkpoints": kept_pairs, "kept_bytes": kept_pairs * each,
                "total_written_bytes": written["max"] * each,
                "write_seconds": written["max"] * out["seconds_per_checkpoint"]})
    if "free_bytes" in out:
        out["free_after_bytes"] = out["available_bytes"] - out["peak_bytes"]
    if estimated_seconds:
        out["blocking_seconds"] = blocking_seconds(out, written["max"], estimated_seconds * tr.save_interval
                                                   / max(total_steps, 1))
        out["write_share"] = out["blocking_seconds"] / estimated_seconds
    return out


def blocking_seconds(facts: dict, writes: int, seconds_between_saves: float) -> float:
    """How long training waits for checkpoint writes. A synchronous save waits for every write. With
    ``training.checkpoint_async`` one write is in flight while training goes on, so the trainer waits
    only when a write outlasts the steps to the next save (the device-to-host snapshot it also waits
    for is not modelled: ~0.3 s for the 50M state, docs/checkpoints.md)."""
    each = facts["seconds_per_checkpoint"]
    if not facts["background"]:
        return writes * each
    return writes * max(0.0, each - seconds_between_saves)

