"""`apr sweep run`: workers that take trials from one Optuna study until the sweep's trial budget is
spent, plan each, train the valid ones as `apr train apply` processes and tell Optuna the result.

Claiming a trial is the one delicate part. A worker holds ``<sweep>/trials/NNNN.lock`` (``flock``)
for as long as it runs trial NNNN, so the operating system drops the claim however the worker ends
(kill -9 included). A trial that storage says is RUNNING but whose lock nobody holds was
interrupted: the next worker to see it resumes it (``apply --resume latest``) as the same Optuna
trial. Counting the budget and asking Optuna for a new trial happen under ``<sweep>/.sweep.lock``
so that workers on one machine never take more trials than the budget; workers on other machines
(a shared RDB) are kept to it afterwards: a trial numbered past the budget is marked surplus and
never runs. docs/sweeps.md describes this for users.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from apr.errors import Finding
from apr.sweep.planning import check_base, plan_trial, trial_dir, trial_settings
from apr.sweep.space import grid_size, suggest
from apr.sweep.spec import SweepError, SweepSpec
from apr.sweep.storage import default_url, display_url, open_study
from apr.sweep.trial import (
    LOCKED_RETRY_S,
    TrialProcess,
    apply_command,
    final_metric,
    has_checkpoint,
    log_tail_reason,
    read_run_state,
)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def trial_budget(spec: SweepSpec, count: int | None) -> int:
    """How many trials the sweep runs: --count, else run_cap; a grid at most its size."""
    caps = [c for c in (count, spec.run_cap) if c is not None]
    if spec.method == "grid":
        caps.append(grid_size(spec))
    if not caps:
        file, line, column = spec.where("method")
        raise SweepError(f"{spec.path}: a {spec.method} sweep needs a number of trials", [Finding(
            "error", "sweep.no_budget", f"a {spec.method} sweep runs until told: give run_cap in the file or --count",
            path="run_cap", file=file, line=line, column=column, expected="run_cap: N or --count N", got="neither")])
    return min(caps)


@dataclass
class Job:
    trial: object  # optuna.trial.Trial
    settings: dict
    run_dir: Path
    lock_fd: int
    resumed: bool
    reported: frozenset = frozenset()  # evaluations already told to Optuna before an interruption


@dataclass
class WorkerReport:
    ran: list[int] = field(default_factory=list)  # trial numbers this worker finished (any final state)
    signal: int | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 0


def _try_lock(path: Path) -> int | None:
    """An open fd holding an exclusive flock on ``path``, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def _sweep_lock(folder: Path):
    fd = os.open(folder / ".sweep.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Worker:
    """One worker: a loop of claim, plan, run, tell. ``echo`` gets one line per trial event."""

    def __init__(self, spec: SweepSpec, study, base: Path, folder: Path, budget: int, *, nproc: int = 1,
                 gpu: str | None = None, vram: str | None = None, echo: Callable[[str], None] = lambda s: None,
                 tag: str = ""):
        self.spec, self.study, self.base, self.folder, self.budget = spec, study, base, folder, budget
        self.nproc, self.gpu, self.vram, self.echo, self.tag = nproc, gpu, vram, echo, tag
        self.report = WorkerReport()
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    # --------------------------------------------------------------------------------- the loop
    def run(self) -> WorkerReport:
        previous = self._install_signals()
        try:
            while self.report.signal is None:
                job = self.next_job()
                if job is None:
                    break
                try:
                    self.run_job(job)
                finally:
                    os.close(job.lock_fd)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.report

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def stop(sig, _frame):
            self.report.signal = self.report.signal or sig

        return {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}

    def next_job(self) -> Job | None:
        with _sweep_lock(self.folder):
            return self._claim_interrupted() or self._ask_new()

    def _claim_interrupted(self) -> Job | None:
        import optuna

        for frozen in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            lock = self._lock_path(frozen.number)
            if "settings" not in frozen.user_attrs or not lock.exists():
                continue  # another machine's trial (its folder is not here), or one still being set up
            fd = _try_lock(lock)
            if fd is None:
                continue  # its worker is alive
            # Its worker tells the result before it lets go of the lock: read the state again now
            # that we hold it, or a trial that finished a moment ago would be "resumed".
            if self.study._storage.get_trial(frozen._trial_id).state != optuna.trial.TrialState.RUNNING:
                os.close(fd)
                continue
            trial = optuna.trial.Trial(self.study, frozen._trial_id)
            try:
                trial.set_user_attr("resumes", int(frozen.user_attrs.get("resumes", 0)) + 1)
                trial.set_user_attr("worker", self.name)
            except optuna.exceptions.UpdateFinishedTrialError:
                os.close(fd)
                continue
            return Job(trial, dict(frozen.user_attrs["settings"]), Path(frozen.user_attrs["run_dir"]), fd, True,
                       frozenset(frozen.intermediate_values))
        return None

    def _ask_new(self) -> Job | None:
        import optuna

        counted = [t for t in self.study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
        if len(counted) >= self.budget:
            return None
        trial = self.study.ask()
        run_dir = trial_dir(self.folder, trial.number)
        settings = trial_settings(self.spec, suggest(trial, self.spec), run_dir)
        fd = _try_lock(self._lock_path(trial.number))  # free: the number is new
        before = [t for t in self.study.get_trials(deepcopy=False)
                  if t.number < trial.number and not t.user_attrs.get("surplus")]
        if len(before) >= self.budget:  # a worker on another machine took the last place first
            trial.set_user_attr("surplus", True)
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            if fd is not None:
                os.close(fd)
            return None
        for key, value in (("settings", settings), ("run_dir", str(run_dir)), ("worker", self.name)):
            trial.set_user_attr(key, value)
        if fd is None:
            raise SweepError(f"cannot lock {self._lock_path(trial.number)}")
        return Job(trial, settings, run_dir, fd, False)

    def _lock_path(self, number: int) -> Path:
        path = trial_dir(self.folder, number).with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    # ----------------------------------------------------------------------------------- a trial
    def run_job(self, job: Job) -> None:
        import optuna

        trial, number = job.trial, job.trial.number
        params = {k: v for k, v in job.settings.items() if k in {p.key for p in self.spec.params}}
        described = " ".join(f"{k}={v!r}" for k, v in params.items())
        plan = plan_trial(self.base, job.settings, gpu=self.gpu, vram=self.vram,
                          world_size=self.nproc if self.nproc > 1 else None)
        if not plan.valid:
            trial.set_user_attr("reason", plan.reason())
            trial.set_user_attr("findings", [f.to_dict() for f in plan.errors][:20])
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self.report.ran.append(number)
            self.echo(f"{self.tag}trial {number}: invalid, not trained: {plan.reason()}  [{described}]")
            return
        trial.set_user_attr("plan", {"tokens": plan.tokens, "steps": plan.steps, "seconds": plan.seconds,
                                     "calibrated": plan.calibrated, "cost": plan.cost})
        resume = job.resumed and has_checkpoint(job.run_dir)
        self.echo(f"{self.tag}trial {number}: {'resuming' if resume else 'training'} {plan.steps} steps  [{described}]")
        started = time.monotonic()
        interval = plan.log_interval if self.spec.metric == "loss" else plan.eval_interval
        outcome = self._train(job, interval or 1, resume)
        self._finish(job, outcome, time.monotonic() - started)

    def _train(self, job: Job, interval: int, resume: bool):
        log = job.run_dir.with_suffix(".log")
        deadline = time.monotonic() + LOCKED_RETRY_S
        while True:
            resume = resume or has_checkpoint(job.run_dir)
            process = TrialProcess(apply_command(self.base, job.settings, resume=resume, nproc=self.nproc),
                                   job.run_dir, log, self.spec.metric, interval)
            outcome = process.run(job.trial, lambda: self.report.signal, job.reported)
            if not outcome.locked or time.monotonic() > deadline or self.report.signal is not None:
                return outcome
            time.sleep(1.0)  # the apply of a killed sweep is still writing its checkpoint

    def _finish(self, job: Job, outcome, seconds: float) -> None:
        import optuna

        trial, number = job.trial, job.trial.number
        state = read_run_state(job.run_dir)
        if state is not None and state.get("run_id"):
            trial.set_user_attr("run_id", state["run_id"])
        if outcome.interrupted is not None:  # left RUNNING: the next `apr sweep run` resumes it
            self.echo(f"{self.tag}trial {number}: interrupted at step {(state or {}).get('step')}; "
                      "run the same command again to resume it")
            return
        TS = optuna.trial.TrialState
        value = final_metric(state, self.spec.metric)
        if outcome.pruned_at is not None:
            evaluation, step, at = outcome.pruned_at
            reason = f"pruned at evaluation {evaluation} (step {step}): {self.spec.metric} {at:.4f}"
            trial.set_user_attr("reason", reason)
            self.study.tell(trial, state=TS.PRUNED)
            self.echo(f"{self.tag}trial {number}: {reason}")
        elif outcome.exit_code == 0 and value is not None:
            self.study.tell(trial, value)
            self.echo(f"{self.tag}trial {number}: finished, {self.spec.metric} {value:.6g} ({seconds:.1f} s)")
        else:
            reason = (f"the run recorded no {self.spec.metric}" if outcome.exit_code == 0 else
                      f"apply exited {outcome.exit_code}: {log_tail_reason(job.run_dir.with_suffix('.log'))}")
            trial.set_user_attr("reason", reason)
            self.study.tell(trial, state=TS.FAIL)
            self.echo(f"{self.tag}trial {number}: failed: {reason}")
        self.report.ran.append(number)


@dataclass
class SweepRun:
    folder: Path
    url: str
    budget: int
    report: WorkerReport
    helper_codes: list[int]

    @property
    def exit_code(self) -> int:
        return self.report.exit_code or next((c for c in self.helper_codes if c), 0)


def prepare(spec: SweepSpec, folder: Path, storage: str | None, count: int | None, worker: int = 0):
    """Everything checked before any trial: the base config and the listed values, the budget, the
    storage and the study. Returns (base config, study, url, budget)."""
    base = check_base(spec)
    budget = trial_budget(spec, count)
    folder.mkdir(parents=True, exist_ok=True)
    url = storage or default_url(folder)
    study = open_study(spec, url, worker=worker)
    return base, study, url, budget


def run_sweep(spec: SweepSpec, folder: Path, *, storage: str | None = None, count: int | None = None,
              workers: int = 1, nproc: int = 1, gpu: str | None = None, vram: str | None = None,
              helper_command: Callable[[int], list[str]] | None = None,
              echo: Callable[[str], None] = lambda s: None) -> SweepRun:
    """Run (or continue) the sweep with ``workers`` processes on this machine: this one and
    ``workers - 1`` helpers started with ``helper_command(i)`` (the CLI's own command line)."""
    base, study, url, budget = prepare(spec, folder, storage, count)
    echo(f"sweep {spec.name}: {spec.method}, {budget} trials, {spec.goal} {spec.metric}; storage "
         f"{display_url(url)}; {workers} worker(s)")
    helpers = [subprocess.Popen(helper_command(i), start_new_session=True)
               for i in range(1, workers)] if helper_command and workers > 1 else []
    worker = Worker(spec, study, base, folder, budget, nproc=nproc, gpu=gpu, vram=vram, echo=echo,
                    tag="[w0] " if helpers else "")
    try:
        report = worker.run()
    finally:
        for proc in helpers:  # a stop reaches the helpers too; each checkpoints its trial
            if worker.report.signal is not None and proc.poll() is None:
                proc.send_signal(worker.report.signal)
        codes = [_wait(proc) for proc in helpers]
    return SweepRun(folder, url, budget, report, codes)


def _wait(proc: subprocess.Popen) -> int:
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # a second Ctrl-C while the helpers checkpoint: keep waiting for them
            proc.send_signal(signal.SIGINT)


def run_helper(spec: SweepSpec, folder: Path, *, storage: str | None, count: int | None, nproc: int = 1,
               gpu: str | None = None, vram: str | None = None, worker: int = 1,
               echo: Callable[[str], None] = lambda s: None) -> WorkerReport:
    """A helper worker of `run_sweep` (``worker`` >= 1: its index)."""
    base, study, _url, budget = prepare(spec, folder, storage, count, worker=worker)
    return Worker(spec, study, base, folder, budget, nproc=nproc, gpu=gpu, vram=vram, echo=echo,
                  tag=f"[w{worker}] ").run()
