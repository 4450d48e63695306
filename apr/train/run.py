"""The run loop of ``apr train apply``: data, engine, schedule, evaluation, checkpoints, records.

``prepare_run`` turns a config (plus command-line overrides) into a ``Run`` and sets it up
(``_setup_device``, ``_setup_data``, ``_setup_engine``, ``_setup_output``: the output folder locked,
a checkpoint restored or a foreign folder refused). ``Run.execute`` then runs optimizer steps
``start_step + 1 .. total_steps`` (``_train``, docs/design.md "The run loop"): ``Cadence`` decides
log / validate / save, each ending is a ``Stop`` made where it is decided, and ``hooks`` (``StepHook``)
see every step's ``StepReport`` and may stop the run. The loop reads the host only at log,
evaluation and checkpoint steps (the engine's non-finite flags, the loss and norm, the results) and,
under DDP, once per step for the ranks' stop flags (``_agree``).

The number of steps is ``apr.steps.algebra.step_count`` over the loader's rows: the plan's formula.
Signals: apr/train/signals.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from ruamel.yaml import YAML

from apr.checkpoint.compat import compare_configs
from apr.checkpoint.manager import CheckpointError, CheckpointManager, TrainState, VerifyShare, read_info, scan
from apr.checkpoint.rng import capture_rng, restore_rng
from apr.config.schema import AprConfig
from apr.data.loader import ShardLoader
from apr.data.mixconfig import decay_start_step, token_stages
from apr.data.mixloader import MixtureLoader
from apr.errors import AprError, Finding
from apr.evaluate.during_training import TrainingEvaluator
from apr.fsutil import atomic_write_json, atomic_write_text
from apr.model.spec import param_count
from apr.steps import distill as distill_schedule
from apr.steps import stacking
from apr.steps.algebra import elastic_accumulation, step_count
from apr.steps.execution import Execution
from apr.steps.schedule import LRSchedule
from apr.track.protocol import NullRecorder, Recorder
from apr.track.recorder import RunRecorder
from apr.train import build as engine_build  # build_engine looked up at call time (tests spy on it)
from apr.train.blocknorms import block_metrics
from apr.train.cadence import Cadence
from apr.train.calibrate import record_run
from apr.train.dist import from_env
from apr.train.drift import DriftCheck
from apr.train.earlystop import EarlyStopping
from apr.train.engine import Engine, NonFiniteError, resolve_device
from apr.train.mfu import mfu_meter
from apr.train.outdir import (
    RESOLVED_CONFIG,
    RESOLVED_CONFIG_HEADER,
    OutputDirLock,
    refuse_foreign_files,
    refuse_user_config,
)
from apr.train.signals import Interrupted, StopSignals
from apr.train.stacking import frozen_groups, grown_tensors
from apr.train.steplog import StepLog
from apr.train.stop import FINISHED, StepHook, StepReport, Stop, first_stop
from apr.train.survive import Survival


@dataclass
class ApplyOptions:
    """How one apply behaves (the config overrides are already in the plan's config)."""

    resume: str | None = None  # None, "latest", or a checkpoint / run directory path
    force: bool = False  # resume although the config changed in a breaking way
    apr_home: Path | None = None
    echo: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    progress: Callable[[int, int], None] | None = None  # called after every step with (step, total_steps)
    handle_signals: bool = True
    overrides: dict = field(default_factory=dict)  # --seed/--device/--max-steps given (recorded in checkpoints)
    execution: dict | None = None  # the plan's resolved execution policy (facts.execution.policy)
    hooks: list[StepHook] = field(default_factory=list)  # called after every step (apr.train.stop.StepHook)


@dataclass
class RunResult:
    status: str  # finished | stopped | failed
    reason: str | None
    run_dir: Path
    run_id: str
    start_step: int
    final_step: int
    total_steps: int
    loss: float | None
    val_loss: float | None
    first_val_loss: float | None
    last_checkpoint: Path | None
    exit_code: int
    tokens_per_s: float | None = None
    warnings: list[str] = field(default_factory=list)
    is_main: bool = True  # rank 0 (or a single process): the one that reports


def _data_error(message: str, path: str, **kw) -> AprError:
    return AprError(message, [Finding("error", "apply.data", message, path=path, **kw)])


class Run:
    """One apply. ``prepare_run`` builds and sets it up; ``execute`` trains."""

    def __init__(self, *, config: AprConfig, config_hash: str, config_path: Path, options: ApplyOptions,
                 plan_doc: dict | None):
        self.config, self.config_hash, self.config_path = config, config_hash, config_path
        self.options, self.plan_doc = options, plan_doc
        self.hooks: list[StepHook] = list(options.hooks)
        es = config.training.early_stopping
        self.early_stopping = EarlyStopping(es.patience, es.min_delta) if es.patience else None
        if self.early_stopping is not None:
            self.hooks.append(self.early_stopping)
        self.survival = Survival(config)  # training.bad_steps and training.rollback
        if config.monitoring.drift_after_steps > 0:  # the run against its plan (apr/train/drift.py)
            self.hooks.append(DriftCheck(plan_doc, config.monitoring.drift_after_steps))
        self.run_dir = Path(os.path.abspath(os.path.expanduser(config.training.output_dir)))
        self.start_step = 0
        self.step = 0  # the step in progress (the last finished one between steps)
        self.best_val: float | None = None
        self.first_val: float | None = None
        self.val_loss: float | None = None  # the last measured validation loss
        self.source_val: dict[str, float | None] = {}  # a mixture's per-source val losses, last measured
        self.run_id: str | None = None
        self.resumed_from: Path | None = None
        self.last_checkpoint: Path | None = None

    # ------------------------------------------------------------------------------ set-up

    def setup(self) -> Run:
        self._setup_device()
        self._elastic_layout()
        self._setup_data()
        self._setup_engine()
        self._setup_output()
        return self

    def _setup_device(self) -> None:
        """The device and, under torchrun, the process group; ``training.world_size`` becomes the real one."""
        self.device = resolve_device(str(self.config.training.device))
        self.dp = from_env(self.device.type)
        from apr.threads import apply_thread_policy  # torch's intra-op threads, chosen and recorded

        self.threads = apply_thread_policy(self.config, 1 if self.dp is None else self.dp.world_size)
        if self.dp is not None:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.dp.local_rank)
            if self.config.training.world_size != self.dp.world_size:
                doc = self.config.model_dump(mode="json")
                doc["training"]["world_size"] = self.dp.world_size
                self.config = AprConfig.model_validate(doc)
        self.is_main = self.dp is None or self.dp.is_main
        self.echo = self.options.echo if self.is_main else (lambda line: None)

    def _elastic_layout(self) -> None:
        """Resuming on another number of ranks: keep the checkpoint's global batch by changing
        gradient_accumulation (before the loaders and the engine are built), or refuse with the
        world sizes that can keep it. See docs/distributed.md, "Resuming on another number of ranks"."""
        self.elastic: dict | None = None
        which = self.options.resume
        if which is None:
            return
        try:
            if which == "latest":
                found = [e for e in scan(self.run_dir) if e.complete]
                if not found:
                    return
                info = read_info(found[0].json_path)
            else:
                info = read_info(which)
            saved_tr, saved_data = info.config["training"], info.config["data"]
            w0, a0 = int(saved_tr.get("world_size", 1)), int(saved_tr.get("gradient_accumulation", 1))
            b0 = int(saved_data["batch_size"])
        except (AprError, OSError, KeyError, TypeError, ValueError):
            return  # _restore reports what is wrong with the checkpoint
        tr = self.config.training
        w1 = tr.world_size
        if w1 == w0 or b0 != self.config.data.batch_size:
            return  # same layout, or a batch_size change the config comparison refuses
        micro = a0 * w0  # micro-batches of batch_size rows per optimizer step, over all ranks
        accum, valid = elastic_accumulation(w0, a0, w1)
        if accum is None:
            message = (f"{info.json_path} was saved by {w0} rank(s) x gradient_accumulation {a0}: a global batch of "
                       f"{micro} micro-batches of {b0} sequences, which {w1} ranks cannot split evenly; resume on "
                       f"{', '.join(map(str, valid))} ranks (or change data.batch_size and pass --force)")
            raise AprError(message, [Finding("error", "resume.world_size", message, path="training.world_size",
                                             expected=f"a world size dividing {micro}", got=str(w1))])
        doc = self.config.model_dump(mode="json")
        doc["training"]["gradient_accumulation"] = accum
        self.config = AprConfig.model_validate(doc)
        self.elastic = {"from_world_size": w0, "to_world_size": w1, "from_accumulation": a0,
                        "to_accumulation": accum}
        self.echo(f"resume: {w0} -> {w1} ranks; gradient_accumulation {a0} -> {accum} keeps the global batch "
                  f"({micro * b0} sequences per step)")

    def _elastic_cursor(self, saved: dict) -> dict:
        """A saved single-source cursor of another world size, at the same global row: ``position``
        counts micro-batches of batch_size x world_size rows, so it scales by the world sizes."""
        if saved.get("kind") == "mixture" or not isinstance(self.loader, ShardLoader):
            return saved  # a mixture's cursor counts global draws: valid at any world size
        w0, w1 = int(saved.get("world_size", 1)), self.loader.world_size
        if w0 == w1 or self.elastic is None:
            return saved
        rows = int(saved["position"]) * w0
        if rows % w1:
            return saved  # not at a step boundary of the new layout: load_state_dict refuses it
        return {**saved, "position": rows // w1, "world_size": w1,
                "gradient_accumulation": self.loader.gradient_accumulation}

    def _setup_data(self) -> None:
        """The loaders, the step count, the LR schedule and the cadence."""
        config, tr, data = self.config, self.config.training, self.config.data
        rank, world = (0, 1) if self.dp is None else (self.dp.rank, self.dp.world_size)
        options = dict(seq_len=data.seq_len, batch_size=data.batch_size, seed=tr.seed, world_size=world, rank=rank,
                       input_column=data.input_column, vocab_size=config.model.architecture.vocab_size,
                       on_warning=self._warn)
        self.mixture = data.sources is not None
        if self.mixture:
            self.loader = MixtureLoader({s.name: os.path.expanduser(s.path) for s in data.sources},
                                        token_stages(data), total_steps=None, shuffle=data.shuffle,
                                        gradient_accumulation=tr.gradient_accumulation, repeat=data.repeat, **options)
        else:
            self.loader = ShardLoader(os.path.expanduser(data.train), shuffle=data.shuffle,
                                      gradient_accumulation=tr.gradient_accumulation, **options)
        if self.loader.steps_per_epoch == 0:
            need = self.loader.sequences_per_step
            raise _data_error(
                f"{data.train_paths()[0][1] if not self.mixture else 'the mixture'}: {self.loader.num_rows} sequences "
                f"are fewer than one optimizer step needs ({need} = batch_size x gradient_accumulation x world_size)",
                "data.train", file=str(data.train_paths()[0][1]))
        self.val_loader = None
        self.source_vals: dict[str, ShardLoader] = {}
        if tr.eval_interval > 0:
            if data.val is not None:
                self.val_loader = ShardLoader(os.path.expanduser(data.val), shuffle=False, **options)
            self.source_vals = {s.name: ShardLoader(os.path.expanduser(s.val), shuffle=False, **options)
                                for s in data.sources or [] if s.val}
        steps = step_count(num_sequences=self.loader.num_rows, batch_size=data.batch_size,
                           gradient_accumulation=tr.gradient_accumulation, world_size=world, epochs=tr.epochs,
                           max_steps=tr.max_steps)
        self.epoch_steps, self.total_steps = steps.epoch_steps, steps.total_steps
        if self.mixture:
            self.loader.set_total_steps(self.total_steps)
        self.tokens_per_step = steps.sequences_per_step * data.seq_len
        self.schedule = LRSchedule.from_config(config, self.total_steps,
                                               decay_start=decay_start_step(config, self.total_steps))
        self.cadence = Cadence.from_config(tr, self.total_steps,
                                           validates=self.val_loader is not None or bool(self.source_vals))
        self.steplog = StepLog(total_steps=self.total_steps, tokens_per_step=self.tokens_per_step, dp=self.dp,
                               echo=self.echo, label=self.step_label,
                               shown=tuple(config.monitoring.terminal.metrics))

    def _setup_engine(self) -> None:
        """The engine (model, optimizer state, execution policy) and the in-training evaluator."""
        config = self.config
        torch.manual_seed(config.training.seed)
        self.engine = self._build_engine(0)
        self.steplog.mfu, line = mfu_meter(config, self.device, self.engine.execution,
                                           1 if self.dp is None else self.dp.world_size)
        if self.device.type == "cuda":  # a CPU run has no MFU, and no line about it
            self.echo(line)
        # reads the task files now, so a malformed one fails before the first step
        self.evaluator = TrainingEvaluator(config, seed=config.training.seed)

    def _build_engine(self, step: int) -> Engine:
        """The engine of the model at ``step`` (progressive stacking: that stage's depth, earlier
        blocks frozen with ``earlier: freeze``), hooked to the run."""
        config, options = self.config, self.options
        staged = stacking.config_at(config, step)
        self.stack_stage = stacking.stage_at(config, step)
        execution = (None if options.execution is None
                     else Execution.from_dict(options.execution, staged.model.architecture.num_hidden_layers))
        if self.stack_stage == 0:
            engine = engine_build.build_engine(staged, self.device, dp=self.dp, execution=execution)
        else:  # a later stage's fresh blocks: their own seed; the run's RNG stream is left as it was
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                engine = engine_build.build_engine(staged, self.device, dp=self.dp, execution=execution,
                                                    seed=config.training.seed + 1000 * self.stack_stage)
        engine.freeze(frozen_groups(config, step))
        if self.survival.bad_steps is not None:
            engine.step_gate = lambda loss, norm: self.survival.gate(self, loss, norm)
        if config.monitoring.block_norms:  # under sharding too: the norms are all-reduced from the shards'
            self.steplog.block_norms = partial(block_metrics, engine)
        return engine

    def _grow(self, step: int, recorder: Recorder | None) -> None:
        """Progressive stacking: the engine of ``step``'s stage, filled from the current one."""
        old, old_depth = self.engine, len(self.engine.model.model.layers)
        meta = old.meta_state()
        before = {k: v.detach().clone() for k, v in old.train_state_tensors(everywhere=True).items()}
        self.engine = None
        del old
        engine = self._build_engine(step)
        new_depth = len(engine.model.model.layers)
        st = self.config.model.stacking
        fresh = engine.train_state_tensors(everywhere=True)
        engine.load_train_state_tensors(grown_tensors(before, fresh, old_depth, new_depth, str(st.init)))
        engine.load_meta_state(meta)
        self.engine = engine
        if recorder is not None:
            message = (f"stacking stage {self.stack_stage} starts at step {step}: {old_depth} -> {new_depth} blocks "
                       f"({st.init}{', earlier blocks frozen' if engine.frozen else ''})")
            recorder.log_event("stack", step, message, {"stage": self.stack_stage, "blocks": new_depth,
                                                        "from_blocks": old_depth, "init": str(st.init)})
            self.echo(f"{self.step_label(step)}  {message}")

    def _setup_output(self) -> None:
        """Lock the output folder (rank 0), then restore the checkpoint to resume or refuse foreign files."""
        self.ckpt = CheckpointManager(self.run_dir, self.config, config_hash=self.config_hash, on_warning=self._warn,
                                      trainer_state=True)
        self.lock = OutputDirLock(self.run_dir)
        try:
            if self.is_main:  # only rank 0 writes the folder
                self.lock.acquire(self.config_path)
            if self.options.resume is not None:
                refuse_user_config(self.run_dir, self.config_path)
                self._restore(self.options.resume)
            else:
                refuse_foreign_files(self.run_dir, self.config_path)
        except BaseException:
            self.lock.release()
            raise

    def _warn(self, message: str) -> None:
        self.echo(f"warning: {message}")

    def load_checkpoint(self, which: str | Path) -> tuple[TrainState, Path]:
        """A checkpoint of this run (``latest``, ``best`` or a path) for :meth:`adopt`; a sharded
        engine reads only its rank's rows of each tensor (apr/checkpoint/parts.py, LazyTensors), so
        no rank holds the whole model in host memory. Several ranks verify it together, each hashing
        its share of the files (``VerifyShare``)."""
        share = None if self.dp is None else VerifyShare(self.dp.rank, self.dp.world_size, self.dp.all_true)
        return self.ckpt.load(which, lazy=self.engine.sharded, share=share)

    def _restore(self, which: str) -> None:
        try:
            state, json_path = self.load_checkpoint(which)
        except CheckpointError as err:
            if err.reason != "model_mismatch" or err.path is None:
                raise
            # another model: show what changed in the config rather than tensor by tensor
            diff = compare_configs(read_info(err.path).config, self.config)
            if diff.breaking:
                raise AprError(f"{err.path} is a checkpoint of another model: the config changed in a way a "
                               "resume cannot take, even with --force\n" + diff.render(),
                               [f for f in diff.findings(str(self.config_path)) if f.severity == "error"]) from None
            raise
        info = state.info
        meta = state.meta
        diff = compare_configs(info.config, self.config)
        if self.elastic is not None:  # the layout change _elastic_layout made: not a config change
            diff.changes = [c for c in diff.changes
                            if c.path not in ("training.world_size", "training.gradient_accumulation")]
        try:
            diff.check(force=self.options.force, file=str(self.config_path))
        except AprError as err:
            saved = meta.get("cli_overrides") or {}
            if saved and saved != self.options.overrides:
                flags = " ".join(f"{k}={json.dumps(v)}" if "." in k else f"--{k.replace('_', '-')} {v}"
                                 for k, v in saved.items())
                raise AprError(err.message + f"\n(the checkpoint's run was started with {flags}; pass them again "
                               "to resume it)", err.findings) from None
            raise
        for change in diff.changes:
            self.echo(f"resume: {'FORCED ' if change.breaking else ''}{change.line()}")
        self.adopt(state, force=self.options.force)
        self.start_step = int(state.step)
        self.run_id = meta.get("run_id")
        self.resumed_from = json_path
        if self.start_step > self.total_steps:
            self._refuse_past_the_end(json_path)
        self.echo(f"resumed from {json_path} (step {self.start_step}, epoch {self.loader.epoch})")

    def adopt(self, state: TrainState, force: bool = False) -> None:
        """Take a checkpoint's weights, optimizer state, data cursor, RNG and loop counters (a resume,
        or a rollback to an earlier checkpoint of this run)."""
        meta = state.meta
        if stacking.stage_at(self.config, int(state.step)) != self.stack_stage:  # another stacking stage's depth
            self.engine = None
            self.engine = self._build_engine(int(state.step))
        self.engine.load_train_state_tensors(state.tensors)
        self.engine.load_meta_state(meta["engine"])
        try:
            self.loader.load_state_dict(self._elastic_cursor(meta["data"]))
        except AprError:
            if not force:
                raise
            self._remap_cursor(meta["data"])
        for note in restore_rng(meta["rng"]):
            self._warn(note)
        self.best_val = meta.get("best_val_loss")
        self.first_val = meta.get("first_val_loss")
        if self.early_stopping is not None:
            self.early_stopping.load_state_dict(meta.get("early_stopping"))
        self.survival.load_state_dict(meta.get("survival"))

    def _refuse_past_the_end(self, json_path: Path) -> None:
        tr = self.config.training
        by_steps = tr.max_steps is not None and tr.max_steps < self.epoch_steps
        key = "training.max_steps" if by_steps else "training.epochs"
        message = (f"{json_path} is at step {self.start_step}, past the {self.total_steps} steps this config runs; "
                   f"raise {key} to continue that run")
        raise AprError(message, [Finding("error", "resume.past_the_end", message, path=key,
                                         file=str(self.config_path), expected=f">= {self.start_step} steps",
                                         got=f"{self.total_steps} steps")])

    def _remap_cursor(self, saved: dict) -> None:
        """A forced resume whose data layout changed (rows, batch, accumulation, ranks, seed or shuffle):
        keep the saved epoch and the fraction of it already read, at the new layout. Not exact."""
        if self.mixture:  # the same number of rows drawn, under the new layout and stages
            draws = int((saved.get("cursor") or {}).get("draws", 0))
            self.loader.seek(draws // self.loader.rows_per_micro)
            self._warn(f"the data mixture or layout changed since the checkpoint; the data cursor was re-mapped to "
                       f"micro-batch {self.loader.absolute} (the run is no longer exactly reproducible)")
            return
        ga = int(saved.get("gradient_accumulation", 1))
        per_step = int(saved.get("batch_size", 1)) * ga * int(saved.get("world_size", 1))
        old_micro_batches = int(saved.get("num_rows", 0)) // max(per_step, 1) * ga
        done = int(saved.get("position", 0)) / max(old_micro_batches, 1)
        accum = self.config.training.gradient_accumulation
        position = min(int(done * self.loader.micro_batches_per_epoch) // accum * accum,
                       self.loader.micro_batches_per_epoch)
        self.loader.load_state_dict({"epoch": int(saved.get("epoch", 0)), "position": position})
        self._warn(f"the data layout changed since the checkpoint; the data cursor was re-mapped to epoch "
                   f"{self.loader.epoch}, micro-batch {position} of {self.loader.micro_batches_per_epoch} "
                   "(the run is no longer exactly reproducible)")

    def _write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        buf = io.StringIO()
        yaml = YAML()
        yaml.default_flow_style = False
        yaml.dump(self.config.model_dump(mode="json"), buf)
        atomic_write_text(self.run_dir / RESOLVED_CONFIG,
                          f"{RESOLVED_CONFIG_HEADER} (from {self.config_path}); hash {self.config_hash}\n"
                          + buf.getvalue())
        if self.plan_doc is not None:
            atomic_write_json(self.run_dir / "plan.json", self.plan_doc)

    # ------------------------------------------------------------------------------ components

    def evaluate(self) -> float | None:
        """Validation loss over ``training.eval_batches`` (averaged over ranks); None without a val set.
        A mixture's per-source val folders are measured too (``self.source_val``); without data.val
        the val loss is their plain mean (comparable across stages, for best checkpoints and early
        stopping)."""
        self.source_val = {name: self._loss_over(loader) for name, loader in self.source_vals.items()}
        if self.val_loader is not None:
            return self._loss_over(self.val_loader)
        known = [v for v in self.source_val.values() if v is not None]
        return sum(known) / len(known) if known else None  # the same sources every time, whatever the stage

    def _loss_over(self, loader: ShardLoader) -> float | None:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for batch in loader.iter_sequential(self.config.training.eval_batches):
            loss_sum, n = self.engine.eval_loss_sum(batch)
            total += loss_sum.double()
            count += n
        if self.dp is not None:
            both = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
            total, count = self.dp.sum_(both)[0], int(both[1].item())
        if count == 0:
            return None
        return float(total.item() / count)

    def _validate_initial(self, recorder: Recorder) -> None:
        """A fresh run measures the initial weights: a later checkpoint is "best" only if it beats them."""
        self.val_loss = self.first_val = self.best_val = self.evaluate()
        if self.early_stopping is not None and self.val_loss is not None:
            self.early_stopping.observe(0, self.val_loss)  # the initial weights are the first to beat
        recorder.log_eval(0, self.val_loss)
        self._echo_val(0, self.val_loss, best=False)
        self._record_mixture(0, recorder)

    def _validate(self, step: int, recorder: Recorder) -> tuple[float | None, bool]:
        """Validation loss at ``step``, recorded and printed, and whether it beats every earlier one."""
        self.val_loss = self.evaluate()
        recorder.log_eval(step, self.val_loss)
        is_best = self.val_loss is not None and (self.best_val is None or self.val_loss < self.best_val)
        if is_best:
            self.best_val = self.val_loss
        self._echo_val(step, self.val_loss, is_best)
        self._record_mixture(step, recorder)
        if self.source_val:
            self.echo(f"{self.step_label(step)}  val loss by source: " + "  ".join(
                f"{n} {v:.4f}" for n, v in self.source_val.items() if v is not None))
        return self.val_loss, is_best

    def _distill_records(self, step: int, recorder: Recorder) -> None:
        """Distillation: an event where a phase-1 block or phase 2 starts, and the autotune's."""
        loss = self.engine.loss
        phase, block = loss.last_phase
        if step == 1 or distill_schedule.phase_at(self.config, step - 1) != (phase, block):
            what = (f"phase 1: student block {block} learns teacher blocks "
                    f"{loss.spans[block][0]}-{loss.spans[block][1] - 1}" if phase == 1
                    else "phase 2: the whole student on KD + LM loss")
            recorder.log_event("distill", step, f"distillation {what} from step {step}",
                               {"phase": phase, "block": block})
            self.echo(f"{self.step_label(step)}  distillation {what}")
        for kind, message, detail in loss.autotune.events:
            recorder.log_event(kind, step, message, detail)
            self.echo(f"{self.step_label(step)}  autotune: {message}")
        loss.autotune.events.clear()

    def _stage_started(self, step: int, recorder: Recorder) -> None:
        """A mixture's next stage draws its first rows at ``step``: an event and a line."""
        st = self.loader.stages[self.loader.stage]
        total = sum(st.weights.values()) or 1.0
        mix = ", ".join(f"{n} {w / total:.0%}" for n, w in st.weights.items() if w > 0)
        message = f"data stage {self.loader.stage_name!r} starts at step {step}: {mix} of tokens"
        recorder.log_event("stage", step, message, {"stage": self.loader.stage, "name": self.loader.stage_name,
                                                    "token_shares": {n: w / total for n, w in st.weights.items()}})
        self.echo(f"{self.step_label(step)}  {message}")

    def _record_mixture(self, step: int, recorder: Recorder) -> None:
        """A mixture's stage, tokens/rows/epochs per source and per-source val losses, recorded."""
        if not self.mixture:
            return
        figures = self.loader.figures()
        for name, value in (self.source_val or {}).items():
            figures["sources"][name]["val_loss"] = value
        recorder.log_mixture(step, figures)

    def _evaluate_tasks(self, step: int, recorder: Recorder) -> Stop | None:
        """evaluation.tasks / samples on the model in training (apr.evaluate.during_training); the new
        scores are recorded and checked by the alerts (``eval.<task>.acc`` conditions)."""
        if self.dp is not None and self.dp.rank != 0 and not self.engine.sharded:
            return None  # data parallel: rank 0 holds the whole model; shards: every rank gathers it
        with self.engine.whole_weights():
            result = self.evaluator.run(self.engine.model, step)
        if not self.is_main:
            return None
        recorder.log_task_evals(step, result)
        scores = "  ".join(f"{name} acc {s['acc']:.3f} acc_norm {s['acc_norm']:.3f}"
                           for name, s in result["tasks"].items())
        self.echo(f"{self.step_label(step)}  eval {scores}  ({result['seconds']:.1f} s)".replace("  (", " (")
                  if scores else f"{self.step_label(step)}  samples ({result['seconds']:.1f} s)")
        for sample in result["samples"]:
            self.echo(f"  sample: {sample['prompt']!r} -> {sample['text']!r}")
        return self.check_alerts({"step": step}, step, recorder) if result["tasks"] else None

    def check_alerts(self, metrics: dict, step: int, recorder: Recorder) -> Stop | None:
        """Print the alerts ``metrics`` fire; the first ``stop`` alert stops the run."""
        fired = recorder.check_alerts(metrics)
        for alert in fired:
            self.echo(f"alert ({alert.action}) at step {step}: {alert.message}")
        stops = [a for a in fired if a.action == "stop"]
        return Stop.alert(stops[0].message) if stops else None

    def _agree(self, stop: Stop | None, signals: StopSignals) -> Stop | None:
        """Under DDP every rank stops at the same step: a signal or a stop on any rank stops all."""
        if self.dp is None:
            return stop
        flags = torch.tensor([signals.received or 0, stop is not None], dtype=torch.float32, device=self.device)
        sig_flag, stop_flag = (int(v) for v in self.dp.any_(flags).tolist())
        if sig_flag and signals.received is None:
            signals.received = sig_flag
        if stop_flag and stop is None:
            stop = Stop("stopped", "alert on rank 0", 1)
        return stop

    def checkpoint_meta(self, step: int) -> dict:
        return {
            "run_id": self.run_id, "cli_overrides": self.options.overrides, "epoch": self.loader.epoch,
            "data": self.loader.state_dict(),
            "rng": capture_rng(), "engine": self.engine.meta_state(),
            "schedule": {"step": step, "total_steps": self.total_steps, "lr_next": self.schedule(step + 1)
                         if step < self.total_steps else None},
            "best_val_loss": self.best_val, "first_val_loss": self.first_val,
            "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
            "survival": self.survival.state_dict() if self.survival.enabled else None,
            "tokens_seen": step * self.tokens_per_step,
        }

    def save(self, step: int, is_best: bool, recorder: Recorder) -> Path:
        """Write a checkpoint of ``step`` (on the background writer with ``training.checkpoint_async``:
        recorded once written, see ``record_checkpoints``)."""
        self.survival.before_save(recorder)
        if self.dp is not None and self.engine.sharded:  # a part per rank
            state = TrainState(step=step, tensors=self.engine.local_state_tensors(), meta=self.checkpoint_meta(step))
            self.last_checkpoint = self.ckpt.save_part(state, self.dp.rank, self.dp.world_size,
                                                       self.dp.exchange_digests, is_best=is_best,
                                                       parts_total=self.engine.shard_group.size())
            if self.is_main:
                recorder.checkpoint(step, self.last_checkpoint, is_best=is_best)
            return self.last_checkpoint
        state = TrainState(step=step, tensors=self.engine.train_state_tensors(), meta=self.checkpoint_meta(step))
        if not self.is_main:  # only rank 0 writes; every rank can resume from what it wrote
            self.last_checkpoint = self.ckpt.step_paths(step)[0]
        else:
            background = self.config.training.checkpoint_async
            self.last_checkpoint = self.ckpt.save(state, is_best=is_best, background=background)
            if background:
                self.record_checkpoints(recorder)
            else:
                recorder.checkpoint(step, self.last_checkpoint, is_best=is_best)
        return self.last_checkpoint

    def record_checkpoints(self, recorder: Recorder, wait: bool = False) -> None:
        """Record the checkpoints written since the last call (``wait``: after the one in flight);
        a background write that failed raises here."""
        for step, path, is_best in (self.ckpt.wait() if wait else self.ckpt.collect()):
            recorder.checkpoint(step, path, is_best=is_best)

    # -------------------------------------------------------------------------------- loop

    def execute(self) -> RunResult:
        """Run the loop; the output folder's lock is released however it ends."""
        try:
            return self._execute()
        finally:
            self.lock.release()

    def _execute(self) -> RunResult:
        if self.resumed_from is not None and self.start_step >= self.total_steps:
            return self._already_finished()
        recorder = self.recorder = self._open_recorder()
        recorder.start(resume_step=self.start_step if self.resumed_from else None)
        if self.resumed_from is not None and self.survival.enabled:
            self.survival.restore_records(recorder)
        self.echo(self._banner())
        self.step, self.last_checkpoint = self.start_step, self.resumed_from
        t0, loop_started_at = time.perf_counter(), time.time()
        try:
            with StopSignals(self.options.handle_signals, self.echo) as signals:
                stop = self._train(recorder, signals)
        except Interrupted as err:  # a second signal: no checkpoint, no waiting for the other ranks
            stop = Stop.interrupted(err.signum, self.step)
            self._settle_checkpoints(recorder)
            recorder.finish(stop.status, stop.reason)
            self.echo(stop.reason)
            if self.dp is not None:
                self.dp.close()
            return self._result(stop, final_step=max(self.step - 1, self.start_step), warnings=recorder.warnings)
        except BaseException as err:  # a crash: record it, then let it propagate
            self._settle_checkpoints(recorder)
            recorder.finish("failed", f"{type(err).__name__}: {err}"[:500])
            raise
        try:
            self.record_checkpoints(recorder, wait=True)
        except BaseException as err:  # the last background write failed (a full disk)
            recorder.finish("failed", f"{type(err).__name__}: {err}"[:500])
            raise
        recorder.finish(stop.status, stop.reason)
        if (self.is_main and self.resumed_from is None and stop.status == "finished"
                and not self.survival.rollback.rollbacks):
            record_run(self, time.perf_counter() - t0, self.step - self.start_step, self.options.apr_home,
                       loop_started_at)
        if self.dp is not None:
            self.dp.barrier()  # rank 0's checkpoint is complete before any rank exits
            self.dp.close()
        return self._result(stop, final_step=self.step, warnings=recorder.warnings)

    def _settle_checkpoints(self, recorder: Recorder) -> None:
        """On a crash or a second signal: the write in flight completes and is recorded; its own
        failure is only a warning then (the run's end is already decided)."""
        try:
            self.record_checkpoints(recorder, wait=True)
        except Exception as e:
            self._warn(f"a background checkpoint write failed: {type(e).__name__}: {e}")

    def _train(self, recorder: Recorder, signals: StopSignals) -> Stop:
        """Optimizer steps ``start_step + 1 .. total_steps``; returns why they ended (``self.step``: the last done)."""
        if self.start_step == 0 and self.val_loader is not None:
            self._validate_initial(recorder)
        self.steplog.start(self.step)
        survival = self.survival
        while self.step < self.total_steps:
            self.step += 1
            step, lr = self.step, survival.lr(self.step, self.schedule(self.step))
            if stacking.stage_at(self.config, step) != self.stack_stage:
                self._grow(step, recorder)
            survival.before_batches(self, recorder)
            stage = self.loader.stage if self.mixture else 0
            micro = [self.loader.next_batch() for _ in range(self.config.training.gradient_accumulation)]
            if self.mixture and self.loader.stage != stage:
                self._stage_started(step, recorder)
            self.engine.current_step = step  # distillation's phase and block follow the run's step
            try:
                report = StepReport(step, lr, self.engine.train_step(micro, lr), is_last=step == self.total_steps)
                if self.engine.kind == "distill":
                    self._distill_records(step, recorder)
                stopping = signals.received is not None
                if (survival.enabled or self.cadence.reads_device(step, stopping)
                        or self.evaluator.due(step, report.is_last)):
                    self.engine.check_finite()  # the engine's non-finite flags: read where the loop reads anyway
            except NonFiniteError as err:
                return self._non_finite(err, recorder)
            if survival.enabled:
                rolled = survival.after_step(self, report, recorder)
                if isinstance(rolled, Stop):
                    return rolled  # no checkpoint: the newest one is the last good state
                if rolled:  # back at the restored step; its checkpoint was rewritten with the skip
                    if signals.received is not None:
                        return Stop.signal(signals.received, self.step)
                    continue
            signals.announce()
            if self.is_main:
                self.record_checkpoints(recorder)  # background writes finished meanwhile
            if self.options.progress is not None and self.is_main:
                self.options.progress(step, self.total_steps)
            stop = None
            if self.cadence.log(step, stopping=signals.received is not None):
                report.metrics = self.steplog.log(step, lr, report.result, self._epoch(), recorder)
                self._record_mixture(step, recorder)
                stop = self.check_alerts(report.metrics, step, recorder)
            if self.cadence.validate(step):
                report.val_loss, report.is_best = self._validate(step, recorder)
                self.steplog.restart_clock()
            if self.evaluator.due(step, report.is_last):
                stop = first_stop(stop, self._evaluate_tasks(step, recorder))
                self.steplog.restart_clock()
            for hook in self.hooks:
                stop = first_stop(stop, hook.after_step(self, report))  # every hook sees every step
            stop = self._agree(stop, signals)
            forced = stop is not None or signals.received is not None
            if survival.save_due(self.cadence.save(step, report.is_best, stopping=forced),
                                 forced or report.is_last):
                try:
                    self.engine.check_finite()  # no read when already checked after this step
                except NonFiniteError as err:
                    return self._non_finite(err, recorder)
                self.save(step, report.is_best, recorder)
                self.steplog.restart_clock()
            if stop is not None:
                return stop
            if signals.received is not None:
                return Stop.signal(signals.received, step)
        return FINISHED

    def _non_finite(self, err: NonFiniteError, recorder: Recorder) -> Stop:
        """A step produced NaN/inf (found ``err.steps_back`` steps ago): fail, keeping the last good
        step's weights when they are intact, the data cursor just past the bad step's batches."""
        self.step -= err.steps_back
        self._rewind_loader(err.steps_back - 1)
        if err.state_is_last_good and self.step > self.start_step:
            self.save(self.step, False, recorder)
        return Stop.non_finite(err.what, self.step + 1)

    def _rewind_loader(self, steps: int) -> None:
        """Put the data cursor back by ``steps`` optimizer steps' micro-batches."""
        if steps <= 0:
            return
        accum = self.config.training.gradient_accumulation
        self.loader.seek(max(self.loader.absolute - steps * accum, 0))

    def _result(self, stop: Stop, final_step: int, warnings: list[str]) -> RunResult:
        return RunResult(
            status=stop.status, reason=stop.reason, run_dir=self.run_dir, run_id=self.run_id or "",
            start_step=self.start_step, final_step=final_step, total_steps=self.total_steps,
            loss=self.steplog.loss,
            val_loss=self.val_loss, first_val_loss=self.first_val, last_checkpoint=self.last_checkpoint,
            exit_code=stop.exit_code, tokens_per_s=self.steplog.tokens_per_s, warnings=warnings, is_main=self.is_main)

    def _open_recorder(self) -> Recorder:
        """Rank 0 writes the run files and records; the other ranks record nothing."""
        if not self.is_main:
            recorder: Recorder = NullRecorder(self.run_id)
        else:
            self._write_run_files()
            recorder = RunRecorder(
                self.run_dir, self.config, config_hash=self.config_hash, total_steps=self.total_steps,
                tokens_per_step=self.tokens_per_step, run_id=self.run_id, apr_home=self.options.apr_home,
                config_path=str(self.config_path), model_params=param_count(self.config.model.architecture))
        self.run_id = recorder.run_id
        return recorder

    def _already_finished(self) -> RunResult:
        """A resume of a run whose checkpoint is at its last step: nothing to train, nothing rewritten."""
        reason = (f"already finished at step {self.start_step} of {self.total_steps}; nothing to do (raise "
                  "training.max_steps or training.epochs to train on)")
        self.echo(f"apply: run {self.run_id} {reason}")
        if self.dp is not None:
            self.dp.close()
        self.last_checkpoint = self.resumed_from
        return self._result(Stop("finished", reason, 0), final_step=self.start_step, warnings=[])

    def _epoch(self) -> float:
        """Epochs read so far, fractional."""
        return self.loader.epoch + self.loader.position / max(self.loader.micro_batches_per_epoch, 1)

    def step_label(self, step: int) -> str:
        return f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"

    def _echo_val(self, step: int, val: float, best: bool) -> None:
        self.echo(f"{self.step_label(step)}  val loss {val:.4f} (ppl {math.exp(min(val, 700)):.1f})"
                  + ("  best" if best else ""))

    def _banner(self) -> str:
        c, tr = self.config, self.config.training
        params = param_count(c.model.architecture)
        what = f"resuming at step {self.start_step + 1}" if self.resumed_from else "starting"
        epochs = self.total_steps / self.loader.steps_per_epoch
        return (f"apply: {what}; run {self.run_id} -> {self.run_dir}\n"
                f"  model {params / 1e6:.2f}M params; {self.engine.strategy.describe()}; "
                f"kernels {self.engine.backend.name}, {tr.mixed_precision} on {self.device}\n"
                f"  {self.total_steps:,} steps x {self.tokens_per_step:,} tokens = {epochs:.3g} epochs of "
                f"{self.loader.steps_per_epoch:,} steps ({self.loader.num_rows:,} sequences)"
                + (f"\n  mixture of {len(self.loader.names)} sources ({', '.join(self.loader.names)}) in "
                   f"{len(self.loader.stages)} stage(s), stage {self.loader.stage_name!r} now" if self.mixture else ""))


def prepare_run(config: AprConfig, *, config_hash: str, config_path: Path, options: ApplyOptions,
                plan_doc: dict | None = None) -> Run:
    """A ``Run`` set up: data read, engine built, output folder locked, checkpoint restored when resuming."""
    return Run(config=config, config_hash=config_hash, config_path=config_path, options=options,
               plan_doc=plan_doc).setup()
