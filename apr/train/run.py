"""The run loop of ``apr train apply`` (docs/design.md, "The run loop" and "The composed engine").

``prepare_run`` turns the plan's config into a ``Run`` and sets it up: the layout (device, ranks; a
resume on another world size was planned by apply, apr/train/layout.py), the data side
(apr/train/datasetup.py), the composed engine (apr/train/build.py), validation and in-training
evaluation, the output folder (locked; a checkpoint restored, apr/train/checkpoints.py). Its
checkpoint metadata is the union of the registered stateful parts (apr/train/stateful.py).

``Run.execute`` runs optimizer steps ``start_step + 1 .. total_steps`` in ``_train``: ``Cadence``
decides log / validate / save, each ending is a ``Stop`` made where it is decided, and hooks
(``StepHook``) see every step's ``StepReport`` through the ``RunContext`` protocol and may stop the
run. The loop reads the device only at log, evaluation and checkpoint steps; under DDP the ranks agree
on the step's signal and stops (``agree``) over a host-side gloo group, which reads nothing from
the device. Signals: apr/train/signals.py.
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch

from apr.checkpoint.manager import CheckpointManager, TrainState
from apr.config.schema import AprConfig
from apr.evaluate.during_training import TrainingEvaluator
from apr.steps import stacking
from apr.steps.resolved import Resolved
from apr.threads import apply_thread_policy
from apr.track.protocol import Recorder
from apr.train import build as engine_build  # build_engine looked up at call time (tests spy on it)
from apr.train import events, layout
from apr.train.blame import row_blame
from apr.train.blocknorms import block_metrics
from apr.train.cadence import Cadence
from apr.train.calibrate import record_run
from apr.train.checkpoints import Checkpoints, run_state
from apr.train.datadrift import DataDriftCheck
from apr.train.datasetup import data_side, micro_batches
from apr.train.drift import DriftCheck
from apr.train.earlystop import EarlyStopping
from apr.train.engine import Engine, NonFiniteError
from apr.train.histograms import LayerHistograms
from apr.train.mfu import mfu_meter
from apr.train.options import ApplyOptions, RunResult
from apr.train.orchestrator import Orchestrator
from apr.train.outdir import (
    OutputDirLock,
    refuse_foreign_files,
    refuse_resume_over_other_run,
    refuse_user_config,
)
from apr.train.signals import Interrupted, StopSignals
from apr.train.stacking import grow, stage_parts
from apr.train.steering import Steering
from apr.train.steplog import StepLog
from apr.train.stop import FINISHED, StepHook, StepReport, Stop, agree, first_stop
from apr.train.survive import Survival
from apr.train.validation import Validation

__all__ = ["ApplyOptions", "Run", "RunResult", "prepare_run"]


class Run:
    """One apply. ``prepare_run`` builds and sets it up; ``execute`` trains."""

    def __init__(self, plan: Resolved, *, config_hash: str, config_path: Path, options: ApplyOptions,
                 plan_doc: dict | None):
        if plan.steps is None:
            raise ValueError("a run needs a Resolved with step counts (apr.plan.build.resolve_config, or a plan)")
        self.plan = plan  # what the plan decided: the only input (apr/steps/resolved.py)
        config = self.config = plan.config
        self.config_hash, self.config_path = config_hash, config_path
        self.options, self.plan_doc = options, plan_doc
        self.hooks: list[StepHook] = list(options.hooks)
        es = config.training.early_stopping
        self.early_stopping = EarlyStopping(es.patience, es.min_delta) if es.patience else None
        self.survival = Survival(plan)  # training.bad_steps and training.rollback
        self.histograms = LayerHistograms.from_plan(plan)  # attached to each engine built
        self.hooks += _watch_hooks(config, plan_doc, self.early_stopping, self.histograms)
        self.orchestrator = Orchestrator(config) if config.training.orchestrator.enabled else None  # strategies
        self.run_dir = Path(os.path.abspath(os.path.expanduser(config.training.output_dir)))
        self.steering = Steering(self.run_dir)  # apr train steer: requests applied between steps
        self.start_step = 0
        self.step = 0  # the step in progress (the last finished one between steps)
        self.run_id: str | None = None
        self.resumed_from: Path | None = None
        self.force_cursor = False  # a forced resume may re-map a data cursor of another layout

    # ------------------------------------------------------------------------------ set-up

    def setup(self) -> Run:
        self.device, self.dp = layout.device_and_ranks(self.plan)
        self.threads = apply_thread_policy(self.config, 1 if self.dp is None else self.dp.world_size)
        self.is_main = self.dp is None or self.dp.is_main
        self.echo = self.options.echo if self.is_main else (lambda line: None)
        # a busy folder is refused before the model takes memory (the GPU's too) from the run holding it
        self.lock = self.options.lock or OutputDirLock(self.run_dir)
        try:
            if self.is_main:  # only rank 0 writes the folder
                self.lock.acquire(self.config_path)
            self.elastic = dict(self.plan.elastic) if self.plan.elastic else None  # laid out by the plan
            if self.elastic is not None:
                self.echo(self.elastic["message"])
            self._setup_data()
            _setup_engine(self)
            _setup_output(self)
        except BaseException:
            self.lock.release()
            raise
        return self

    def _setup_data(self) -> None:
        side = data_side(self.plan, self.dp, self.warn)
        self.loader, self.mixture, self.schedule = side.loader, side.mixture, self.plan.schedule
        steps = self.plan.steps
        self.epoch_steps, self.total_steps, self.tokens_per_step = steps.epoch_steps, steps.total_steps, \
            steps.tokens_per_step
        self.validation = Validation(self.config, side.loader_options, self.dp, self.device, self.echo,
                                     self.step_label, total_steps=self.total_steps)
        self.cadence = Cadence.from_plan(self.plan, validates=self.validation.configured)
        self.blame = row_blame(self)  # apr runs blame: each row's loss at the logged steps
        self.steplog = StepLog(total_steps=self.total_steps, tokens_per_step=self.tokens_per_step, dp=self.dp,
                               echo=self.echo, label=self.step_label,
                               shown=tuple(self.config.monitoring.terminal.metrics),
                               canonical=self.plan.reduction == "canonical")

    def build_engine(self, step: int) -> Engine:
        """The engine of the model at ``step`` (progressive stacking: that stage's depth, earlier
        blocks frozen with ``earlier: freeze``), hooked to the run."""
        config = self.config
        staged = self.plan.at_depth(stacking.config_at(config, step))
        self.stack_stage = stacking.stage_at(config, step)
        if self.stack_stage == 0:
            engine = engine_build.build_engine(staged, self.device, dp=self.dp)
        else:  # a later stage's fresh blocks: their own seed; the run's RNG stream is left as it was
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                engine = engine_build.build_engine(staged, self.device, dp=self.dp,
                                                   seed=config.training.seed + 1000 * self.stack_stage)
        stage_parts(engine, config, step, self.run_dir, self.warn)  # freezing, the trunk's activation cache
        if self.survival.bad_steps is not None:
            engine.step_gate = lambda loss, norm: self.survival.gate(self, loss, norm)
        if self.histograms is not None:
            self.histograms.attach(engine, self.is_main)
        if config.monitoring.block_norms:  # under sharding too: the norms are all-reduced from the shards'
            self.steplog.block_norms = partial(block_metrics, engine)
        return engine

    def rebuild_engine(self, step: int, fill=None) -> Engine:
        """``step``'s engine in place of the current one (freed first); ``fill(engine)`` loads its state.
        Stacking growth and a restore across stages ask for it; only the loop sets ``self.engine``."""
        self.engine = None
        engine = self.build_engine(step)
        if fill is not None:
            fill(engine)
        self.engine = engine
        return engine

    def move_to(self, step: int) -> None:
        """``step`` is the last finished one (a rollback, a snapshot, a decision); only the loop sets it."""
        self.step = int(step)

    def run_steps(self, n: int, lr_factor: float = 1.0) -> list[torch.Tensor]:
        """``n`` optimizer steps after the current one with no logging, validation, checkpoint or hook
        (an orchestrator's branch); the step moves with them. Each step's mean loss (device tensors,
        not read)."""
        losses: list[torch.Tensor] = []
        for _ in range(n):
            self.step += 1
            self.engine.current_step = self.step
            lr = self._lr(self.step) * lr_factor
            result = self.engine.train_step(_micro_batches(self), lr)
            losses.append(result.loss.detach().float().reshape(()))
        return losses

    def _lr(self, step: int) -> float:
        """The schedule's learning rate at ``step``, after a rollback's lowering and a steered factor."""
        return self.survival.lr(step, self.schedule(step)) * self.steering.lr_factor

    def warn(self, message: str) -> None:
        self.echo(f"warning: {message}")

    def step_label(self, step: int) -> str:
        return f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"

    def load_checkpoint(self, which: str | Path) -> tuple[TrainState, Path]:
        return self.checkpoints.load(which)

    def save(self, step: int, is_best: bool, recorder: Recorder) -> Path:
        return self.checkpoints.save(step, is_best, recorder)

    def record_checkpoints(self, recorder: Recorder, wait: bool = False) -> None:
        self.checkpoints.record(recorder, wait)

    @property
    def best_val(self) -> float | None:
        return self.validation.best

    def check_alerts(self, metrics: dict, step: int, recorder: Recorder) -> Stop | None:
        return events.check_alerts(self, metrics, step, recorder)

    # -------------------------------------------------------------------------------- loop

    def execute(self) -> RunResult:
        """Run the loop; the output folder's lock is released however it ends."""
        try:
            return self._execute()
        finally:
            self.lock.release()

    def _execute(self) -> RunResult:
        if self.resumed_from is not None and self.start_step >= self.total_steps:
            return _already_finished(self)
        recorder = self.recorder = events.open_recorder(self)
        self.run_id = recorder.run_id
        recorder.start(resume_step=self.start_step if self.resumed_from else None)
        if self.options.fork_of is not None:
            events.forked(self, recorder)
        if self.resumed_from is not None and self.survival.enabled:
            self.survival.restore_records(recorder)
        self.echo(events.banner(self))
        self.step = self.start_step
        t0, loop_started_at = time.perf_counter(), time.time()
        try:
            with StopSignals(self.options.handle_signals, self.echo) as signals:
                stop = self._train(recorder, signals)
        except Interrupted as err:  # a second signal: no checkpoint, no waiting for the other ranks
            stop = Stop.interrupted(err.signum, self.step)
            self.checkpoints.settle(recorder)
            recorder.finish(stop.status, stop.reason)
            self.echo(stop.reason)
            if self.dp is not None:
                self.dp.close()
            return _result(self, stop, final_step=max(self.step - 1, self.start_step), warnings=recorder.warnings)
        except BaseException as err:  # a crash: record it, then let it propagate
            self.checkpoints.settle(recorder)
            recorder.finish("failed", f"{type(err).__name__}: {err}"[:500])
            raise
        try:
            self.record_checkpoints(recorder, wait=True)
        except BaseException as err:  # the last background write failed (a full disk)
            recorder.finish("failed", f"{type(err).__name__}: {err}"[:500])
            raise
        events.verified(self, recorder, stop)  # distillation's verify, when configured and finished
        recorder.finish(stop.status, stop.reason)
        if (self.is_main and self.resumed_from is None and stop.status == "finished"
                and not self.survival.rollback.rollbacks):
            record_run(self, time.perf_counter() - t0, self.step - self.start_step, self.options.apr_home,
                       loop_started_at)
        if self.dp is not None:
            self.dp.barrier()  # rank 0's checkpoint is complete before any rank exits
            self.dp.close()
        return _result(self, stop, final_step=self.step, warnings=recorder.warnings)

    def _train(self, recorder: Recorder, signals: StopSignals) -> Stop:
        """Optimizer steps ``start_step + 1 .. total_steps``; returns why they ended (``self.step``: the last done)."""
        if self.start_step == 0 and self.validation.configured:
            events.validated_initially(self, recorder)
        if self.orchestrator is not None:
            self.orchestrator.start(self, recorder)
        self.steplog.start(self.step)
        while self.step < self.total_steps:
            self.steering.apply(self, self.steering.due(self, self.step + 1), recorder)  # apr train steer
            self.step += 1
            step, lr = self.step, self._lr(self.step)
            lr = lr if self.orchestrator is None else self.orchestrator.lr(lr)  # the strategy's lr factor
            try:
                report = self._one_step(step, lr, signals, recorder)
            except NonFiniteError as err:
                return _non_finite(self, err, recorder)
            if self.survival.enabled:
                rolled = self.survival.after_step(self, report, recorder)
                if isinstance(rolled, Stop):
                    return rolled  # no checkpoint: the newest one is the last good state
                if rolled:  # back at the restored step; its checkpoint was rewritten with the skip
                    if report.signal is not None:
                        return Stop.signal(report.signal, self.step)
                    continue
            signals.announce()
            if self.is_main:
                self.record_checkpoints(recorder)  # background writes finished meanwhile
                if self.options.progress is not None:
                    self.options.progress(step, self.total_steps)
            # the step's stops and signals, the same on every rank; nothing below reads ``signals``
            stop, signal = agree(self._after_step(report, recorder), signals, self.dp)
            signals.announce()  # (once) a signal that came during the step's logging, or on another rank
            forced = stop is not None or signal is not None
            if forced and report.metrics is None:  # the step a run stops at is logged (on every rank: agreed)
                try:
                    self.engine.check_finite()
                except NonFiniteError as err:
                    return _non_finite(self, err, recorder)
                report.metrics = self.steplog.log(step, report.lr, report.result, events.epochs_read(self.loader),
                                                  recorder)
            self.blame.record_stopping(step, recorder, stopping=forced)  # its rows too (apr runs blame)
            due = self.cadence.save(step, report.is_best, stopping=forced) or self.steering.checkpoint_at == step
            if (stop is None or stop.checkpoint) and self.survival.save_due(  # critical alert: nothing worth keeping
                    due, forced or report.is_last):
                try:
                    self.engine.check_finite()  # no read when already checked after this step
                except NonFiniteError as err:
                    return _non_finite(self, err, recorder)
                self.save(step, report.is_best, recorder)
                self.steplog.restart_clock()
            if stop is not None:
                return stop
            if signal is not None:
                return Stop.signal(signal, step)
            if self.orchestrator is not None and (stop := self.orchestrator.after_step(self, report, recorder)):
                return stop  # a branch's non-finite step; a decision or a rollback moves self.step
        return FINISHED

    def _one_step(self, step: int, lr: float, signals: StopSignals, recorder: Recorder) -> StepReport:
        """Stacking growth and mixture stages due at ``step``, its micro-batches, the engine's step,
        distillation's records, and the device's non-finite flags where the loop reads anyway."""
        if stacking.stage_at(self.config, step) != self.stack_stage:
            grow(self, step, recorder)
        self.survival.before_batches(self, recorder)
        stage = self.loader.stage if self.mixture else 0
        micro = _micro_batches(self)
        if self.mixture and self.loader.stage != stage:
            events.stage_started(self, step, recorder)
        self.engine.current_step = step  # losses (distillation's phase and block) follow the run's step
        with self.blame.capture(step):
            report = StepReport(step, lr, self.engine.train_step(micro, lr), is_last=step == self.total_steps)
        self.blame.record(step, recorder)
        # a signal that arrived by now stops the run after this step: agreed once, before anything
        # this step does depends on it (under DDP a signal on one rank would otherwise make that rank
        # alone log, read or save: collectives the others never join)
        _, report.signal = agree(None, signals, self.dp)
        if self.engine.kind == "distill":
            events.distill_records(self, step, recorder)
        if (self.survival.enabled or self.cadence.reads_device(step, report.signal is not None)
                or self.evaluator.due(step, report.is_last)):
            self.engine.check_finite()  # the engine's non-finite flags: read where the loop reads anyway
        return report

    def _after_step(self, report: StepReport, recorder: Recorder) -> Stop | None:
        """Log, validate, evaluate and the hooks, each at its own cadence; the first stop stands."""
        step, stop = report.step, None
        if self.cadence.log(step, stopping=report.signal is not None):
            report.metrics = self.steplog.log(step, report.lr, report.result, events.epochs_read(self.loader), recorder)
            events.record_mixture(self, step, recorder)
            stop = self.check_alerts(report.metrics, step, recorder)
        evaluated = False
        if self.cadence.validate(step) or (self.steering.evaluate_at == step and self.validation.configured):
            report.val_loss, report.is_best = self.validation.at(step, self.engine, recorder)
            events.record_mixture(self, step, recorder)
            self.steplog.restart_clock()
            evaluated = report.val_loss is not None
        if self.evaluator.due(step, report.is_last):
            stop = first_stop(stop, events.tasks_and_samples(self, step, recorder))
            self.steplog.restart_clock()
            evaluated = True
        if evaluated:  # alerts on val_loss and eval.* at the evaluation, before this step's checkpoint
            measured = {"val_loss": report.val_loss} if report.val_loss is not None else {}
            stop = first_stop(stop, self.check_alerts(measured, step, recorder))
        for hook in self.hooks:
            stop = first_stop(stop, hook.after_step(self, report))  # every hook sees every step
        if self.steering.stop_at == step and not report.is_last:
            stop = first_stop(stop, Stop("stopped", f"steer: stop_at {step}; resume with --resume latest", 0))
        return stop



def _setup_engine(self) -> None:
    """The engine (model, optimizer state, execution policy), the in-training evaluator and the
    stateful parts a checkpoint is made of."""
    config = self.config
    torch.manual_seed(config.training.seed)
    self.engine = self.build_engine(0)
    if config.model.architecture.moe is not None:  # the step's routing figures at log steps (apr/train/losses.py)
        self.steplog.moe = lambda dp: self.engine.loss.routing.metrics(dp)  # the engine of the step just taken
    self.steplog.mfu, line = mfu_meter(config, self.device, self.engine.execution,
                                       1 if self.dp is None else self.dp.world_size)
    if self.device.type == "cuda":  # a CPU run has no MFU, and no line about it
        self.echo(line)
    # reads the task files now, so a malformed one fails before the first step
    self.evaluator = TrainingEvaluator(config, seed=config.training.seed)
    self.registry = run_state(self)


def _setup_output(self) -> None:
    """Restore the checkpoint to resume, or refuse foreign files (the folder is locked already)."""
    manager = CheckpointManager(self.run_dir, self.config, config_hash=self.config_hash, on_warning=self.warn,
                                trainer_state=True)
    manager.allow_other_run = self.options.allow_other_run
    self.checkpoints = Checkpoints(self, manager)
    if self.options.resume is not None:
        refuse_user_config(self.run_dir, self.config_path)
        self.checkpoints.resume(self.options.resume)
        if self.options.fork_of is not None:  # a fork: the parent's state, a run of its own
            self.run_id = None
        if self.options.allow_other_run and self.is_main:  # never over a third run's records or saves
            refuse_resume_over_other_run(self.run_dir, self.config_path, self.run_id, start_step=self.start_step,
                                         total_steps=self.total_steps,
                                         save_interval=self.config.training.save_interval,
                                         saves_best=self.validation.configured)
    else:
        refuse_foreign_files(self.run_dir, self.config_path, warn=self.warn)


def _non_finite(self, err: NonFiniteError, recorder: Recorder) -> Stop:
    """A step produced NaN/inf (found ``err.steps_back`` steps ago): fail, keeping the last good
    step's weights when they are intact, the data cursor just past the bad step's batches."""
    self.step -= err.steps_back
    if err.steps_back > 1:  # put the data cursor back by the later steps' micro-batches
        accum = self.config.training.gradient_accumulation
        self.loader.seek(max(self.loader.absolute - (err.steps_back - 1) * accum, 0))
    if err.state_is_last_good and self.step > self.start_step:
        self.save(self.step, False, recorder)
    return Stop.non_finite(err.what, self.step + 1)


def _micro_batches(self) -> list:
    return micro_batches(self.loader, self.config.training.gradient_accumulation, self.device.type == "cuda")

def _result(run: Run, stop: Stop, final_step: int, warnings: list[str]) -> RunResult:
    v = run.validation
    return RunResult(
        status=stop.status, reason=stop.reason, run_dir=run.run_dir, run_id=run.run_id or "",
        start_step=run.start_step, final_step=final_step, total_steps=run.total_steps, loss=run.steplog.loss,
        val_loss=v.last, first_val_loss=v.first, last_checkpoint=run.checkpoints.last, exit_code=stop.exit_code,
        tokens_per_s=run.steplog.tokens_per_s, warnings=warnings, is_main=run.is_main)


def _already_finished(run: Run) -> RunResult:
    """A resume of a run whose checkpoint is at its last step: nothing to train, nothing rewritten."""
    reason = (f"already finished at step {run.start_step} of {run.total_steps}; nothing to do (raise "
              "training.max_steps or training.epochs to train on)")
    run.echo(f"apply: run {run.run_id} {reason}")
    if run.dp is not None:
        run.dp.close()
    return _result(run, Stop("finished", reason, 0), final_step=run.start_step, warnings=[])


def _watch_hooks(config: AprConfig, plan_doc: dict | None, early_stopping: EarlyStopping | None,
                 histograms: LayerHistograms | None) -> list[StepHook]:
    """The hooks the config asks for: early stopping, the run against its plan (apr/train/drift.py),
    per-layer histograms (histograms.py), data drift during training (datadrift.py)."""
    hooks: list[StepHook] = [early_stopping] if early_stopping is not None else []
    if config.monitoring.drift_after_steps > 0:
        hooks.append(DriftCheck(plan_doc, config.monitoring.drift_after_steps))
    if histograms is not None:
        hooks.append(histograms)
    if config.monitoring.data_drift.interval > 0 and config.data.sources is None:
        hooks.append(DataDriftCheck.of(config, _dataset_folder(config.data.train)))
    return hooks


def _dataset_folder(train: str) -> Path:
    """The folder a dataset's pretokenize manifest is in: ``data.train``, or the folder of a shard."""
    path = Path(os.path.expanduser(train))
    return path if path.is_dir() else path.parent


def prepare_run(plan: Resolved, *, config_hash: str, config_path: Path, options: ApplyOptions,
                plan_doc: dict | None = None) -> Run:
    """A ``Run`` of the resolved plan, set up: data read, engine built, output folder locked, checkpoint
    restored when resuming. A caller without a saved plan resolves its config with
    ``apr.plan.build.resolve_config``."""
    return Run(plan, config_hash=config_hash, config_path=config_path, options=options, plan_doc=plan_doc).setup()
