"""The run's checkpoints: save (a file, or a part per rank on shards), record what the background
writer finished, load (every rank verifying its share), resume (the config comparison, the data
cursor at another world size; the state put back by the restore service, apr/train/restore.py).
The metadata is the run's ``StateRegistry`` (apr/train/stateful.py); the tensors are the engine's."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from apr.checkpoint.compat import compare_configs
from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState, VerifyShare, read_info
from apr.checkpoint.rng import capture_rng, restore_rng
from apr.errors import AprError, Finding
from apr.train import layout
from apr.train.restore import Saved, restore
from apr.train.stateful import StateRegistry

# What an elastic resume may change with the number of ranks (docs/distributed.md, "Resuming on
# another number of ranks"): the accumulation that keeps the global batch, and how the new ranks
# shard the state (full, hybrid over nodes, ...); the weights stay within the resume's 1e-6.
ELASTIC_KEYS = ("training.world_size", "training.gradient_accumulation", "training.sharding", "training.nodes")


class Checkpoints:
    """One run's checkpoint component; ``run`` is the run loop (its engine is replaced by stacking
    growth, so it is read at each call)."""

    def __init__(self, run, manager: CheckpointManager):
        self.run = run
        self.manager = manager
        self.last: Path | None = None  # the newest checkpoint written or resumed from
        self.events_mark: float | None = None  # the resumed checkpoint's newest event (apr/track/recorder.py)

    # ------------------------------------------------------------------------------ writing

    def save(self, step: int, is_best: bool, recorder) -> Path:
        """Write a checkpoint of ``step`` (on the background writer with ``training.checkpoint_async``:
        recorded once written, see ``record``)."""
        run = self.run
        run.survival.before_save(recorder)
        meta = run.registry.state_dict()
        if run.dp is not None and run.engine.sharded:  # a part per rank
            state = TrainState(step=step, tensors=run.engine.local_state_tensors(), meta=meta)
            self.last = self.manager.save_part(state, run.dp.rank, run.dp.world_size, run.dp.exchange_digests,
                                               is_best=is_best, parts_total=run.engine.shard_group.size())
            if run.is_main:
                recorder.checkpoint(step, self.last, is_best=is_best)
            return self.last
        state = TrainState(step=step, tensors=run.engine.train_state_tensors(), meta=meta)
        if not run.is_main:  # only rank 0 writes; every rank can resume from what it wrote
            self.last = self.manager.step_paths(step)[0]
        else:
            background = run.config.training.checkpoint_async
            self.last = self.manager.save(state, is_best=is_best, background=background)
            if background:
                self.record(recorder)
            else:
                recorder.checkpoint(step, self.last, is_best=is_best)
        return self.last

    def record(self, recorder, wait: bool = False) -> None:
        """Record the checkpoints written since the last call (``wait``: after the one in flight);
        a background write that failed raises here."""
        for step, path, is_best in (self.manager.wait() if wait else self.manager.collect()):
            recorder.checkpoint(step, path, is_best=is_best)

    def settle(self, recorder) -> None:
        """On a crash or a second signal: the write in flight completes and is recorded; its own
        failure is only a warning then (the run's end is already decided)."""
        try:
            self.record(recorder, wait=True)
        except Exception as e:
            self.run.warn(f"a background checkpoint write failed: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------------------ reading

    def load(self, which: str | Path) -> tuple[TrainState, Path]:
        """A checkpoint of this run (``latest``, ``best`` or a path); a sharded engine reads only its
        rank's rows of each tensor (apr/checkpoint/parts.py, LazyTensors), so no rank holds the whole
        model in host memory. Several ranks verify it together, each hashing its share of the files."""
        dp = self.run.dp
        share = None if dp is None else VerifyShare(dp.rank, dp.world_size, dp.all_true)
        return self.manager.load(which, lazy=self.run.engine.sharded, share=share)

    def resume(self, which: str) -> None:
        """Restore the checkpoint to resume from, after comparing its config with this one."""
        run = self.run
        try:
            state, json_path = self.load(which)
        except CheckpointError as err:
            if err.reason != "model_mismatch" or err.path is None:
                raise
            # another model: show what changed in the config rather than tensor by tensor
            diff = compare_configs(read_info(err.path).config, run.config)
            if diff.breaking:
                raise AprError(f"{err.path} is a checkpoint of another model: the config changed in a way a "
                               "resume cannot take, even with --force\n" + diff.render(),
                               [f for f in diff.findings(str(run.config_path)) if f.severity == "error"]) from None
            raise
        self._check_config(state.info.config, state.meta)
        run.start_step = restore(run, Saved(state, json_path), force=run.options.force)
        run.run_id = state.meta.get("run_id")
        self.events_mark = state.meta.get("events_mark")
        self.last = json_path
        run.resumed_from = json_path
        if run.start_step > run.total_steps:
            self._refuse_past_the_end(json_path)
        run.echo(f"resumed from {json_path} (step {run.start_step}, epoch {run.loader.epoch})")

    def _check_config(self, saved_config: dict, meta: dict) -> None:
        run = self.run
        diff = compare_configs(saved_config, run.config)
        layout = []
        if run.elastic is not None:  # the layout change of an elastic resume (ranks, and how they shard): allowed
            layout = [c for c in diff.changes if c.path in ELASTIC_KEYS]
            diff.changes = [c for c in diff.changes if c.path not in ELASTIC_KEYS]
        try:
            diff.check(force=run.options.force, file=str(run.config_path))
        except AprError as err:
            saved = meta.get("cli_overrides") or {}
            if saved and saved != run.options.overrides:
                flags = " ".join(f"{k}={json.dumps(v)}" if "." in k else f"--{k.replace('_', '-')} {v}"
                                 for k, v in saved.items())
                raise AprError(err.message + f"\n(the checkpoint's run was started with {flags}; pass them again "
                               "to resume it)", err.findings) from None
            raise
        for change in diff.changes:
            run.echo(f"resume: {'FORCED ' if change.breaking else ''}{change.line()}")
        for change in layout:
            if change.path in ("training.sharding", "training.nodes"):  # the ranks' change is echoed by the layout
                run.echo(f"resume: layout {change.line()}")

    def _refuse_past_the_end(self, json_path: Path) -> None:
        run = self.run
        tr = run.config.training
        by_steps = tr.max_steps is not None and tr.max_steps < run.epoch_steps
        key = "training.max_steps" if by_steps else "training.epochs"
        message = (f"{json_path} is at step {run.start_step}, past the {run.total_steps} steps this config runs; "
                   f"raise {key} to continue that run")
        raise AprError(message, [Finding("error", "resume.past_the_end", message, path=key,
                                         file=str(run.config_path), expected=f">= {run.start_step} steps",
                                         got=f"{run.total_steps} steps")])


def run_state(run) -> StateRegistry:
    """The parts a checkpoint's metadata is made of, in the order they are written and read back."""
    reg = StateRegistry()
    reg.register("run", lambda: {"run_id": run.run_id, "cli_overrides": run.options.overrides,
                                 "epoch": run.loader.epoch})
    reg.register("data", lambda: {"data": run.loader.state_dict()}, partial(_load_cursor, run))
    reg.register("rng", lambda: {"rng": capture_rng()}, lambda meta: [run.warn(n) for n in restore_rng(meta["rng"])])
    reg.register("engine", lambda: {"engine": run.engine.meta_state()},
                 lambda meta: run.engine.load_meta_state(meta["engine"]))
    reg.register("loss_tensors", lambda: ({"loss_tensors": shapes} if (shapes := run.engine.loss_tensor_shapes())
                                          else {}))
    reg.register("schedule", lambda: {"schedule": {
        "step": run.step, "total_steps": run.total_steps,
        "lr_next": run.schedule(run.step + 1) if run.step < run.total_steps else None}})
    reg.register("validation", run.validation.state_dict, run.validation.load_state_dict)
    stopping = run.early_stopping
    reg.register("early_stopping", lambda: {"early_stopping": stopping.state_dict() if stopping else None},
                 (lambda meta: stopping.load_state_dict(meta.get("early_stopping"))) if stopping else None)
    reg.register("survival", lambda: {"survival": run.survival.state_dict() if run.survival.enabled else None},
                 lambda meta: run.survival.load_state_dict(meta.get("survival")))
    reg.register("tokens", lambda: {"tokens_seen": run.step * run.tokens_per_step})
    # the newest event recorded: a resume drops the later ones, recorded again (read back by ``resume``)
    reg.register("events", lambda: {"events_mark": mark() if (mark := getattr(getattr(run, "recorder", None),
                                                                                "events_mark", None)) else None})
    reg.register("steering", run.steering.state_dict, partial(_load_steering, run))
    orchestrator = run.orchestrator
    if orchestrator is not None:  # the strategy in force, the bandit, the decisions (apr/train/orchestrator.py)
        reg.register("orchestrator", orchestrator.state_dict, lambda meta: orchestrator.load_state_dict(meta, run))
    return reg


def _load_steering(run, meta: dict) -> None:
    """The steer requests the checkpoint holds, in force again (apr/train/steering.py)."""
    run.steering.load_state_dict(meta, int((meta.get("schedule") or {}).get("step", 0)))
    run.steering.restore(run)


def _load_cursor(run, meta: dict) -> None:
    """The data cursor, at this world size (elastic resume); a forced resume of another data layout
    re-maps it (not exact, and says so)."""
    try:
        run.loader.load_state_dict(layout.elastic_cursor(meta["data"], run.loader, run.elastic))
    except AprError:
        if not run.force_cursor:
            raise
        run.warn(layout.remap_cursor(run.loader, meta["data"], run.mixture, run.config.training.gradient_accumulation))
