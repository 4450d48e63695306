"""Run one apply from a JSON config document (argv[1]; argv[2]: a --resume value), without the plan:
launched as a subprocess (or by torchrun) by the crash and data-parallel tests. With
APR_TEST_ROWS_LOG set, rank 0 appends [micro-batch number, its row indices] to that file; with
APR_TEST_SHARDS set, rank 0 writes its FSDP2 shard sizes there after a sharded run (and the most
gradient-shard elements the interleaved walk held at once); with
APR_TEST_PIDS set, every rank appends "RANK PID" to that file; APR_TEST_LOSS_SCALE sets fp16's
initial loss scale (a large one makes the first steps overflow); APR_TEST_HOLD_SAVE=N makes rank 0
of a sharded run stop inside step N's save, after the parts are written and before the JSON, and
say "holding the save of step N" on stderr (a test kills it there); APR_TEST_SIGNAL="RANK:STEP:WHEN"
turns apr's signal handling on and makes that rank send itself SIGTERM at step STEP, WHEN "compute"
(right after the step's compute, before the loop looks at signals) or "log" (from a step hook,
after the step's logging); APR_TEST_STEER="STEP:KEY=VALUE,..." makes rank 0 write that steer request
after step STEP (as `apr train steer` would meanwhile); with APR_TEST_LR_LOG set, every rank appends
"RANK STEP LR" to that file for each step it trains."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.train.run import ApplyOptions, prepare_run


class SignalAt:
    """A step hook that sends this process SIGTERM after step ``step``'s logging."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, run, report):
        if report.step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
        return None


class SteerAfter:
    """A step hook that writes a steer request after step ``step``."""

    def __init__(self, step: int, settings: list[str]):
        self.step, self.settings = step, settings

    def after_step(self, run, report):
        if report.step == self.step:
            from apr.steer import request_steer

            request_steer(run.run_dir, self.settings)
        return None


def log_lrs(run, path: str) -> None:
    """Each step's learning rate as this rank's engine receives it, appended to ``path``."""
    train_step, rank = run.engine.train_step, os.environ.get("RANK", "0")

    def logged(micro, lr, *args, **kwargs):
        with open(path, "a") as f:
            f.write(f"{rank} {run.step} {lr!r}\n")
        return train_step(micro, lr, *args, **kwargs)

    run.engine.train_step = logged


def signal_after_compute(run, step: int) -> None:
    """This rank sends itself SIGTERM as step ``step``'s compute returns."""
    import signal

    train_step = run.engine.train_step

    def then_signal(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if run.step == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    run.engine.train_step = then_signal


def hold_step(hold: int) -> None:
    """Rank 0 sleeps at the digest exchange of step ``hold``'s save (every part is on disk, the JSON
    is not): the window in which a kill must leave the previous checkpoint the latest."""
    import time

    from apr.checkpoint.manager import CheckpointManager

    save_part = CheckpointManager.save_part

    def held(self, state, rank, world, exchange, *args, **kwargs):
        def exchange_then_hold(sha, size):
            records = exchange(sha, size)
            if rank == 0 and sha and int(state.step) == hold:
                print(f"holding the save of step {hold}", file=sys.stderr, flush=True)
                time.sleep(300)
            return records

        return save_part(self, state, rank, world, exchange_then_hold, *args, **kwargs)

    CheckpointManager.save_part = held


def main() -> int:
    doc = json.loads(Path(sys.argv[1]).read_text())
    resume = sys.argv[2] if len(sys.argv) > 2 else None
    cfg = AprConfig.model_validate(doc)
    shards_log = os.environ.get("APR_TEST_SHARDS")
    live = {"max": 0}
    if shards_log:  # the most gradient-shard elements the interleaved walk holds at once
        from apr.train.sharded_walk import ShardedWalk

        arrived = ShardedWalk._arrived_grad

        def measured(self, p):
            arrived(self, p)  # the engine's hook first: a complete group is stepped and dropped
            held = sum(q.grad.to_local().numel() for q in self.params.named.values() if q.grad is not None)
            live["max"] = max(live["max"], held)

        ShardedWalk._arrived_grad = measured
    signal_rank, signal_step, signal_when = (os.environ.get("APR_TEST_SIGNAL") or "-1:0:none").split(":")
    mine = int(signal_rank) == int(os.environ.get("RANK", "0"))
    hooks = [SignalAt(int(signal_step))] if mine and signal_when == "log" else []
    if os.environ.get("APR_TEST_STEER") and os.environ.get("RANK", "0") == "0":
        steer_step, _, settings = os.environ["APR_TEST_STEER"].partition(":")
        hooks.append(SteerAfter(int(steer_step), settings.split(",")))
    run = prepare_run(resolve_config(cfg, resume=resume), config_hash=config_hash(cfg), config_path=Path(sys.argv[1]),
                      options=ApplyOptions(resume=resume, handle_signals=int(signal_rank) >= 0, hooks=hooks))
    if mine and signal_when == "compute":
        signal_after_compute(run, int(signal_step))
    if os.environ.get("APR_TEST_LR_LOG"):
        log_lrs(run, os.environ["APR_TEST_LR_LOG"])
    if os.environ.get("APR_TEST_HOLD_SAVE"):
        hold_step(int(os.environ["APR_TEST_HOLD_SAVE"]))
    if os.environ.get("APR_TEST_LOSS_SCALE"):
        run.engine.scaler.scale = float(os.environ["APR_TEST_LOSS_SCALE"])
    pids = os.environ.get("APR_TEST_PIDS")
    if pids:  # each rank's pid, for tests that kill one rank
        with open(pids, "a") as f:
            f.write(f"{os.environ.get('RANK', '0')} {os.getpid()}\n")
    rows_log = os.environ.get("APR_TEST_ROWS_LOG")
    if rows_log and run.is_main:  # rank 0 logs every global micro-batch's rows (all ranks' parts)
        loader, draw = run.loader, run.loader.next_batch

        def logged():
            at = loader.absolute
            with open(rows_log, "a") as f:
                f.write(json.dumps([at, loader.rows_at(at)]) + "\n")
            return draw()

        loader.next_batch = logged
    result = run.execute()
    if shards_log and run.is_main and run.engine.sharded:  # rank 0's FSDP2 shard sizes, by group
        up = run.engine.updater
        frozen = [p.to_local() for p in run.engine.model.parameters() if not p.requires_grad]
        Path(shards_log).write_text(json.dumps({
            "max_live_grad": live["max"], "frozen_bytes": sum(t.numel() * t.element_size() for t in frozen),
            "groups": {name: {
            "params": sum(p.to_local().numel() for p in group),
            "adam_m": sum(up.moments(p)[0].to_local().numel() for p in group)}
            for name, group in run.engine.gradients.groups}}))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
