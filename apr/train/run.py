"""The run loop of ``apr train apply``: data, engine, schedule, evaluation, checkpoints, records.

``prepare_run`` turns a config (plus command-line overrides) into a ``Run``: the engine built or
restored from a checkpoint, the loaders with their cursors, the step algebra, the recorder. ``Run.
execute`` then runs optimizer steps ``start_step + 1 .. total_steps``. The loop's only host reads
are the engine's finiteness checks and the loss / norm read at log intervals.

The number of steps is ``apr.steps.algebra.step_count`` over the loader's rows: the plan's formula.

Signals: the first SIGINT / SIGTERM / SIGHUP lets the current step finish, writes a checkpoint and
ends the run as ``stopped`` (exit 130 / 143 / 129); a second one exits at once. SIGHUP is left
alone when it is ignored at start (nohup).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from apr.config.schema import AprConfig
from apr.errors import AprError, Finding
from apr.fmt import fmt_duration, fmt_rate
from apr.rate import RateMeter
from apr.steps.algebra import step_count
from apr.train.outdir import (
    RESOLVED_CONFIG,
    RESOLVED_CONFIG_HEADER,
    OutputDirLock,
    refuse_foreign_files,
    refuse_user_config,
)

SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


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


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM/SIGHUP: stop at once, mid-step, without a checkpoint."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Signals:
    """First SIGINT/SIGTERM/SIGHUP: ask the loop to stop after this step. Second: exit at once."""

    def __init__(self, enabled: bool, echo: Callable[[str], None]):
        self.received: int | None = None
        self.announced = False
        self._echo = echo
        self._old: dict[int, object] = {}
        self.enabled = enabled and _in_main_thread()

    def __enter__(self) -> _Signals:
        if self.enabled:
            for sig in SIGNAL_EXIT:
                if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # started under nohup: a hang-up is not meant for this run
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.received is not None:
            raise Interrupted(signum)  # unwinds the step at once; the loop records it and exits
        self.received = signum  # no printing here: the handler may run inside a write to the same stream

    def announce(self) -> None:
        """Say, once, from the loop, that a signal is stopping the run."""
        if self.received is not None and not self.announced:
            self.announced = True
            self._echo(f"{signal.Signals(self.received).name}: finishing this step and writing a checkpoint "
                       "(send it again to exit at once)")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class Run:
    """One apply, prepared. Use ``prepare_run`` to build it."""

    def __init__(self, *, config: AprConfig, config_hash: str, config_path: Path, options: ApplyOptions,
                 plan_doc: dict | None):
        from apr.data.loader import ShardLoader
        from apr.steps.schedule import LRSchedule
        from apr.train.dist import from_env
        from apr.train.engine import build_engine, resolve_device

        self.device = resolve_device(str(config.training.device))
        self.dp = from_env(self.device.type)
        if self.dp is not None:
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.dp.local_rank)
            if config.training.world_size != self.dp.world_size:
                doc = config.model_dump(mode="json")
                doc["training"]["world_size"] = self.dp.world_size
                config = AprConfig.model_validate(doc)
        self.is_main = self.dp is None or self.dp.is_main
        rank, world = (0, 1) if self.dp is None else (self.dp.rank, self.dp.world_size)
        self.config, self.config_hash, self.config_path = config, config_hash, config_path
        self.options, self.plan_doc = options, plan_doc
        self.echo = options.echo if self.is_main else (lambda line: None)
        tr, data = config.training, config.data
        self.run_dir = Path(os.path.abspath(os.path.expanduser(tr.output_dir)))

        self.loader = ShardLoader(
            os.path.expanduser(data.train), seq_len=data.seq_len, batch_size=data.batch_size, seed=tr.seed,
            gradient_accumulation=tr.gradient_accumulation, world_size=world, rank=rank, shuffle=data.shuffle,
            input_column=data.input_column, vocab_size=config.model.architecture.vocab_size)
        if self.loader.steps_per_epoch == 0:
            need = self.loader.sequences_per_step
            raise _data_error(
                f"{data.train}: {self.loader.num_rows} sequences are fewer than one optimizer step needs "
                f"({need} = batch_size x gradient_accumulation x world_size)",
                "data.train", file=str(data.train))
        self.val_loader = None
        if data.val is not None and tr.eval_interval > 0:
            self.val_loader = ShardLoader(
                os.path.expanduser(data.val), seq_len=data.seq_len, batch_size=data.batch_size, seed=tr.seed,
                shuffle=False, input_column=data.input_column, rank=rank, world_size=world,
                vocab_size=config.model.architecture.vocab_size)
        steps = step_count(num_sequences=self.loader.num_rows, batch_size=data.batch_size,
                           gradient_accumulation=tr.gradient_accumulation, world_size=world, epochs=tr.epochs,
                           max_steps=tr.max_steps)
        self.epoch_steps, self.total_steps = steps.epoch_steps, steps.total_steps
        self.tokens_per_step = steps.sequences_per_step * data.seq_len
        self.schedule = LRSchedule.from_config(config, self.total_steps)

        torch.manual_seed(tr.seed)
        from apr.steps.execution import Execution

        execution = (None if options.execution is None
                     else Execution.from_dict(options.execution, config.model.architecture.num_hidden_layers))
        self.engine = build_engine(config, self.device, dp=self.dp, execution=execution)
        self.start_step = 0
        self.best_val: float | None = None
        self.run_id: str | None = None
        self.first_val: float | None = None
        self.resumed_from: Path | None = None

        from apr.checkpoint.manager import CheckpointManager
        from apr.evaluate.during_training import TrainingEvaluator

        self.evaluator = TrainingEvaluator(config, seed=tr.seed)  # reads the task files: a bad one fails now
        self.ckpt = CheckpointManager(self.run_dir, config, config_hash=config_hash, on_warning=self._warn,
                                      trainer_state=True)
        self.lock = OutputDirLock(self.run_dir)
        try:
            if self.is_main:  # only rank 0 writes the folder
                self.lock.acquire(config_path)
            if options.resume is not None:
                refuse_user_config(self.run_dir, config_path)
                self._restore(options.resume)
            else:
                refuse_foreign_files(self.run_dir, config_path)
        except BaseException:
            self.lock.release()
            raise

    # ------------------------------------------------------------------------------ set-up

    def _warn(self, message: str) -> None:
        self.echo(f"warning: {message}")

    def _restore(self, which: str) -> None:
        from apr.checkpoint.compat import compare_configs
        from apr.checkpoint.manager import CheckpointError, read_info
        from apr.checkpoint.rng import restore_rng

        try:
            state, json_path = self.ckpt.load(which)
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
        try:
            diff.check(force=self.options.force, file=str(self.config_path))
        except AprError as err:
            saved = meta.get("cli_overrides") or {}
            if saved and saved != self.options.overrides:
                flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in saved.items())
                raise AprError(err.message + f"\n(the checkpoint's run was started with {flags}; pass them again "
                               "to resume it)", err.findings) from None
            raise
        for change in diff.changes:
            self.echo(f"resume: {'FORCED ' if change.breaking else ''}{change.line()}")
        self.engine.load_train_state_tensors(state.tensors)
        self.engine.load_meta_state(meta["engine"])
        try:
            self.loader.load_state_dict(meta["data"])
        except AprError:
            if not self.options.force:
                raise
            self._remap_cursor(meta["data"])
        for note in restore_rng(meta["rng"]):
            self._warn(note)
        self.start_step = int(state.step)
        self.best_val = meta.get("best_val_loss")
        self.first_val = meta.get("first_val_loss")
        self.run_id = meta.get("run_id")
        self.resumed_from = json_path
        if self.start_step > self.total_steps:
            self._refuse_past_the_end(json_path)
        self.echo(f"resumed from {json_path} (step {self.start_step}, epoch {self.loader.epoch})")

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
        import io

        from ruamel.yaml import YAML

        from apr.fsutil import atomic_write_json, atomic_write_text

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

    # ------------------------------------------------------------------------------ pieces

    def evaluate(self) -> float | None:
        if self.val_loader is None:
            return None
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for batch in self.val_loader.iter_sequential(self.config.training.eval_batches):
            loss_sum, n = self.engine.eval_loss_sum(batch)
            total += loss_sum.double()
            count += n
        if self.dp is not None:
            both = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=self.device)])
            total, count = self.dp.sum_(both)[0], int(both[1].item())
        if count == 0:
            return None
        return float(total.item() / count)

    def _evaluate_tasks(self, step: int, recorder) -> list:
        """evaluation.tasks / samples on the model in training (apr.evaluate.during_training);
        returns the alerts the new scores fire (``eval.<task>.acc`` conditions)."""
        if self.dp is not None and self.dp.rank != 0:
            return []
        result = self.evaluator.run(self.engine.model, step)
        recorder.log_task_evals(step, result)
        scores = "  ".join(f"{name} acc {s['acc']:.3f} acc_norm {s['acc_norm']:.3f}"
                           for name, s in result["tasks"].items())
        self.echo(f"{self._step_label(step)}  eval {scores}  ({result['seconds']:.1f} s)".replace("  (", " (")
                  if scores else f"{self._step_label(step)}  samples ({result['seconds']:.1f} s)")
        for sample in result["samples"]:
            self.echo(f"  sample: {sample['prompt']!r} -> {sample['text']!r}")
        fired = recorder.check_alerts({"step": step}) if result["tasks"] else []
        for alert in fired:
            self.echo(f"alert ({alert.action}) at step {step}: {alert.message}")
        return fired

    def checkpoint_meta(self, step: int) -> dict:
        from apr.checkpoint.rng import capture_rng

        return {
            "run_id": self.run_id, "cli_overrides": self.options.overrides, "epoch": self.loader.epoch,
            "data": self.loader.state_dict(),
            "rng": capture_rng(), "engine": self.engine.meta_state(),
            "schedule": {"step": step, "total_steps": self.total_steps, "lr_next": self.schedule(step + 1)
                         if step < self.total_steps else None},
            "best_val_loss": self.best_val, "first_val_loss": self.first_val,
            "tokens_seen": step * self.tokens_per_step,
        }

    def save(self, step: int, is_best: bool, recorder) -> Path:
        from apr.checkpoint.manager import TrainState

        state = TrainState(step=step, tensors=self.engine.train_state_tensors(), meta=self.checkpoint_meta(step))
        if not self.is_main:  # only rank 0 writes; every rank can resume from what it wrote
            return self.ckpt.step_paths(step)[0]
        path = self.ckpt.save(state, is_best=is_best)
        recorder.checkpoint(step, path, is_best=is_best)
        return path

    # -------------------------------------------------------------------------------- loop

    def execute(self) -> RunResult:
        """Run the loop; the output folder's lock is released however it ends."""
        try:
            return self._execute()
        finally:
            self.lock.release()

    def _execute(self) -> RunResult:
        from apr.model.spec import param_count
        from apr.track.recorder import RunRecorder
        from apr.train.engine import NonFiniteError

        tr = self.config.training
        if self.resumed_from is not None and self.start_step >= self.total_steps:
            return self._already_finished()
        if self.is_main:
            self._write_run_files()
            recorder = RunRecorder(
                self.run_dir, self.config, config_hash=self.config_hash, total_steps=self.total_steps,
                tokens_per_step=self.tokens_per_step, run_id=self.run_id, apr_home=self.options.apr_home,
                config_path=str(self.config_path), model_params=param_count(self.config.model.architecture))
        else:
            recorder = _NullRecorder(self.run_id)
        self.run_id = recorder.run_id
        recorder.start(resume_step=self.start_step if self.resumed_from else None)
        self.echo(self._banner())

        step = self.start_step
        status, reason, exit_code = "finished", None, 0
        last_ckpt: Path | None = self.resumed_from
        loss_v: float | None = None
        val_v: float | None = None
        rate: float | None = None
        try:
            with _Signals(self.options.handle_signals, self.echo) as signals:
                if self.start_step == 0 and self.val_loader is not None:
                    val_v = self.evaluate()
                    self.first_val = val_v
                    self.best_val = val_v  # a later checkpoint is "best" only if it beats the initial weights
                    recorder.log_eval(0, val_v)
                    self._echo_val(0, val_v, best=False)
                t_log, step_log = time.perf_counter(), step
                meter = RateMeter()  # the printed tok/s and ETA: an EMA over wall time, not one interval
                while step < self.total_steps:
                    step += 1
                    micro = [self.loader.next_batch() for _ in range(tr.gradient_accumulation)]
                    lr = self.schedule(step)
                    try:
                        result = self.engine.train_step(micro, lr)
                    except NonFiniteError as err:
                        step -= 1
                        status, reason, exit_code = "failed", f"non-finite {err.what} at step {step + 1}", 1
                        if err.state_is_last_good and step > self.start_step:
                            last_ckpt = self.save(step, False, recorder)
                        break
                    signals.announce()
                    is_last = step == self.total_steps
                    if self.options.progress is not None and self.is_main:
                        self.options.progress(step, self.total_steps)
                    if step % tr.log_interval == 0 or is_last or signals.received is not None:
                        loss_t = result.loss.detach().clone()
                        loss_v = float((self.dp.average_(loss_t) if self.dp is not None else loss_t).item())
                        gn = float(result.grad_norm.item())
                        now = time.perf_counter()
                        tokens, seconds = (step - step_log) * self.tokens_per_step, max(now - t_log, 1e-9)
                        rate = tokens / seconds
                        t_log, step_log = now, step
                        metrics = {"loss": loss_v, "lr": lr, "grad_norm": gn, "tokens_per_s": rate,
                                   "epoch": self.loader.epoch + self.loader.position
                                   / max(self.loader.micro_batches_per_epoch, 1),
                                   "tokens_seen": step * self.tokens_per_step}
                        if result.skipped:
                            metrics["skipped_steps"] = 1
                        recorder.log_step(step, metrics)
                        smooth = meter.add(tokens, seconds) or rate
                        eta = meter.eta((self.total_steps - step) * self.tokens_per_step)
                        self.echo(f"{self._step_label(step)}  loss {loss_v:.4f}  lr {lr:.2e}  "
                                  f"gnorm {gn:.3f}  {fmt_rate(smooth)} tok/s  eta {fmt_duration(eta)}")
                        fired = recorder.check_alerts(metrics)
                        for alert in fired:
                            self.echo(f"alert ({alert.action}) at step {step}: {alert.message}")
                        stops = [a for a in fired if a.action == "stop"]
                        if stops:
                            status, reason, exit_code = "stopped", f"alert: {stops[0].message}", 1
                    is_best = False
                    if self.val_loader is not None and tr.eval_interval and (step % tr.eval_interval == 0 or is_last):
                        val_v = self.evaluate()
                        recorder.log_eval(step, val_v)
                        is_best = val_v is not None and (self.best_val is None or val_v < self.best_val)
                        if is_best:
                            self.best_val = val_v
                        self._echo_val(step, val_v, is_best)
                        t_log = time.perf_counter()  # evaluation time is not training throughput
                    if self.evaluator.due(step, is_last):
                        stops = [a for a in self._evaluate_tasks(step, recorder) if a.action == "stop"]
                        if stops and status == "finished":
                            status, reason, exit_code = "stopped", f"alert: {stops[0].message}", 1
                        t_log = time.perf_counter()
                    if self.dp is not None:  # every rank stops at the same step: signal or alert on any
                        flags = torch.tensor([signals.received or 0, status != "finished"], dtype=torch.float32,
                                             device=self.device)
                        sig_flag, alert_flag = (int(v) for v in self.dp.any_(flags).tolist())
                        if sig_flag and signals.received is None:
                            signals.received = sig_flag
                        if alert_flag and status == "finished":
                            status, reason, exit_code = "stopped", "alert on rank 0", 1
                    stopping = status != "finished" or signals.received is not None
                    if step % tr.save_interval == 0 or is_last or is_best or stopping:
                        last_ckpt = self.save(step, is_best, recorder)
                        t_log = time.perf_counter()
                    if status != "finished":
                        break
                    if signals.received is not None:
                        name = signal.Signals(signals.received).name
                        status, reason = "stopped", f"{name} at step {step}; resume with --resume latest"
                        exit_code = SIGNAL_EXIT[signals.received]
                        break
        except Interrupted as err:
            name = signal.Signals(err.signum).name
            reason = f"second {name} during step {step}: stopped at once; resume from the last checkpoint"
            recorder.finish("stopped", reason)
            self.echo(reason)
            if self.dp is not None:
                self.dp.close()
            return RunResult(status="stopped", reason=reason, run_dir=self.run_dir, run_id=self.run_id,
                             start_step=self.start_step, final_step=max(step - 1, self.start_step),
                             total_steps=self.total_steps, loss=loss_v, val_loss=val_v, first_val_loss=self.first_val,
                             last_checkpoint=last_ckpt, exit_code=SIGNAL_EXIT.get(err.signum, 130),
                             warnings=recorder.warnings, is_main=self.is_main)
        except BaseException as err:  # a crash: record it, then let it propagate
            recorder.finish("failed", f"{type(err).__name__}: {err}"[:500])
            raise
        recorder.finish(status, reason)
        if self.dp is not None:
            self.dp.barrier()  # rank 0's checkpoint is complete before any rank exits
            self.dp.close()
        return RunResult(
            status=status, reason=reason, run_dir=self.run_dir, run_id=self.run_id, start_step=self.start_step,
            final_step=step, total_steps=self.total_steps, loss=loss_v, val_loss=val_v,
            first_val_loss=self.first_val, last_checkpoint=last_ckpt, exit_code=exit_code, tokens_per_s=rate,
            warnings=recorder.warnings, is_main=self.is_main)

    def _already_finished(self) -> RunResult:
        """A resume of a run whose checkpoint is at its last step: nothing to train, nothing rewritten."""
        reason = (f"already finished at step {self.start_step} of {self.total_steps}; nothing to do (raise "
                  "training.max_steps or training.epochs to train on)")
        self.echo(f"apply: run {self.run_id} {reason}")
        if self.dp is not None:
            self.dp.close()
        return RunResult(status="finished", reason=reason, run_dir=self.run_dir, run_id=self.run_id or "",
                         start_step=self.start_step, final_step=self.start_step, total_steps=self.total_steps,
                         loss=None, val_loss=None, first_val_loss=self.first_val,
                         last_checkpoint=self.resumed_from, exit_code=0, is_main=self.is_main)

    def _step_label(self, step: int) -> str:
        return f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}"

    def _echo_val(self, step: int, val: float, best: bool) -> None:
        self.echo(f"{self._step_label(step)}  val loss {val:.4f} (ppl {math.exp(min(val, 700)):.1f})"
                  + ("  best" if best else ""))

    def _banner(self) -> str:
        from apr.model.spec import param_count

        c, tr = self.config, self.config.training
        params = param_count(c.model.architecture)
        what = f"resuming at step {self.start_step + 1}" if self.resumed_from else "starting"
        epochs = self.total_steps / self.loader.steps_per_epoch
        return (f"apply: {what}; run {self.run_id} -> {self.run_dir}\n"
                f"  model {params / 1e6:.2f}M params; {self.engine.strategy.describe()}; "
                f"kernels {self.engine.backend.name}, {tr.mixed_precision} on {self.device}\n"
                f"  {self.total_steps:,} steps x {self.tokens_per_step:,} tokens = {epochs:.3g} epochs of "
                f"{self.loader.steps_per_epoch:,} steps ({self.loader.num_rows:,} sequences)")


class _NullRecorder:
    """What ranks other than 0 record: nothing (rank 0 writes the state file and the stores)."""

    def __init__(self, run_id: str | None):
        self.run_id = run_id or "rank-local"
        self.warnings: list[str] = []

    def start(self, resume_step=None) -> None: ...
    def log_step(self, step, metrics) -> None: ...
    def log_eval(self, step, val_loss) -> None: ...
    def log_task_evals(self, step, result) -> None: ...
    def checkpoint(self, step, path, is_best=False) -> None: ...
    def finish(self, status, reason=None) -> None: ...

    def check_alerts(self, metrics) -> list:
        return []


def prepare_run(config: AprConfig, *, config_hash: str, config_path: Path, options: ApplyOptions,
                plan_doc: dict | None = None) -> Run:
    return Run(config=config, config_hash=config_hash, config_path=config_path, options=options, plan_doc=plan_doc)
