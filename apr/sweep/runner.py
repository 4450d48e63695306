"""`apr sweep run`: workers that take trials from one Optuna study until the sweep's trial budget is
spent, plan each, train the valid ones as `apr train apply` processes and tell Optuna the result.

Claiming a trial is the one delicate part, and a stopped worker's trial comes back two ways.
On one machine a worker holds ``<sweep>/trials/NNNN.lock`` (``flock``) for as long as it runs
trial NNNN, so the operating system drops the claim however the worker ends (kill -9 included).
A trial that storage says is RUNNING but whose lock nobody holds was interrupted: the next worker
to see it resumes it (``apply --resume latest``) as the same Optuna trial. Across machines no
lock is visible, so Optuna's heartbeat does it: a worker records a heartbeat for its trial every
``heartbeat`` seconds (a thread, as ``study.optimize`` does); a trial whose heartbeat is older
than the grace period is failed by the next worker that looks (``optuna.storages.fail_stale_trials``)
and `StaleTrialRetry` enqueues its retry, a WAITING trial with the same settings and the link to
the stale trial's run folder, which resumes from that folder's last checkpoint when the new
worker can see it (a shared folder) and starts afresh otherwise. A worker with nothing left to
take waits while trials with a heartbeat run elsewhere, so a dead machine's trial is retried
before the sweep ends.

Counting the budget and asking Optuna for a new trial happen under ``<sweep>/.sweep.lock`` so
that workers on one machine never take more trials than the budget; workers on other machines
(a shared RDB) are kept to it afterwards: a trial numbered past the budget is marked surplus and
never runs. A retry takes its stale trial's place in the count. docs/sweeps.md describes this
for users.
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
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from apr.errors import Finding
from apr.sweep.folder import check_folder, claim_folder
from apr.sweep.planning import check_base, plan_trial, trial_dir, trial_settings
from apr.sweep.space import grid_size, suggest
from apr.sweep.spec import SweepError, SweepSpec, check_count
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
HEARTBEAT_S = 60  # Optuna's heartbeat_interval for every sweep (--heartbeat)
GRACE_S = 300  # a trial whose heartbeat is older is failed and retried (--grace)
WAIT_POLL_S = 2.0  # how often an idle worker looks again while trials run elsewhere


def trial_budget(spec: SweepSpec, count: int | None) -> int:
    """How many trials the sweep runs: --count, else run_cap; a grid at most its size."""
    caps = [c for c in (check_count(count), spec.run_cap) if c is not None]
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
    beat: Heartbeat | None = None
    fitted: dict = field(default_factory=dict)  # the trial plan's values of the base's auto keys: what apply runs


@dataclass
class WorkerReport:
    ran: list[int] = field(default_factory=list)  # trial numbers this worker finished (any final state)
    signal: int | None = None

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 0


class Heartbeat:
    """Optuna's heartbeat for one trial: recorded now, then every ``interval`` seconds by a daemon
    thread until ``stop()`` (``study.optimize`` does the same with optuna._heartbeat, which is
    private; a sweep's workers ask and tell themselves)."""

    def __init__(self, storage, trial_id: int, interval: int):
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        storage.record_heartbeat(trial_id)
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{trial_id}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception:  # a database hiccup: the next beat tries again; the grace period covers a few
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class StaleTrialRetry:
    """Optuna's ``heartbeat_stale_trial_callback``: a trial failed for a stale heartbeat (its worker's
    machine died, or lost the database) is enqueued again as a WAITING trial with the same
    parameters and settings, ``retry_of`` its number and ``run_dir`` its run folder, so the worker
    that asks next resumes it from its last checkpoint (apr.sweep.runner.Worker._ask_new). A trial
    already retried is not enqueued twice; a surplus one is not retried."""

    def __init__(self):
        self.echo: Callable[[str], None] = lambda s: None

    def __call__(self, study, frozen) -> None:
        import optuna

        if frozen.user_attrs.get("surplus"):
            return
        if any(t.user_attrs.get("retry_of") == frozen.number for t in study.get_trials(deepcopy=False)):
            return
        attrs = {k: frozen.user_attrs[k] for k in ("settings", "run_dir") if k in frozen.user_attrs}
        attrs |= {"retry_of": frozen.number, "resumes": int(frozen.user_attrs.get("resumes", 0))}
        study.add_trial(optuna.trial.create_trial(  # its system attributes hold a grid point's id
            state=optuna.trial.TrialState.WAITING, params=frozen.params, distributions=frozen.distributions,
            user_attrs=attrs, system_attrs={**frozen.system_attrs, "failed_trial": frozen.number}))
        self.echo(f"trial {frozen.number}: its worker {frozen.user_attrs.get('worker', '?')} sent no heartbeat "
                  "for the grace period; failed, and queued again to resume from its last checkpoint")


def _try_lock(path: Path) -> int | None:
    """An open fd holding an exclusive flock on ``path``, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _held(path: Path) -> bool:
    """Whether a process holds ``path``'s flock (False when there is no such file here)."""
    if not path.exists():
        return False
    fd = _try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


def counted_trials(trials: list) -> list:
    """The trials that count against the budget: not surplus, and not a stale trial that a retry
    has replaced (the retry counts in its place)."""
    live = [t for t in trials if not t.user_attrs.get("surplus")]
    replaced = {t.user_attrs["retry_of"] for t in live if t.user_attrs.get("retry_of") is not None}
    return [t for t in live if t.number not in replaced]


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
        storage = study._storage  # Optuna's BaseHeartbeat (an RDBStorage, under Optuna's cache)
        self.heartbeat: int | None = storage.get_heartbeat_interval()
        retry = storage.get_heartbeat_stale_trial_callback()
        if isinstance(retry, StaleTrialRetry):
            retry.echo = lambda line: echo(f"{tag}{line}")
        self.waiting_said = False

    # --------------------------------------------------------------------------------- the loop
    def run(self) -> WorkerReport:
        previous = self._install_signals()
        try:
            while self.report.signal is None:
                job = self.next_job()
                if job is None:
                    if not self._wait_for_others():
                        break
                    continue
                try:
                    self.run_job(job)
                finally:
                    if job.beat is not None:
                        job.beat.stop()
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
            job = self._claim_interrupted()
            if job is None:
                self._fail_stale()
                job = self._ask_new()
            return job

    def _fail_stale(self) -> None:
        """Optuna's own: RUNNING trials whose heartbeat is older than the grace period are failed
        and handed to StaleTrialRetry (a no-op without a heartbeat)."""
        import optuna

        if not self.heartbeat:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)

    def _wait_for_others(self) -> bool:
        """Nothing to take: wait (True) while trials that can still come back to this worker run
        elsewhere (a heartbeat that may go stale, or a lock held on this machine), else False."""
        import optuna

        running = [t for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
                   if (self.heartbeat and t.user_attrs.get("heartbeat"))
                   or _held(trial_dir(self.folder, t.number).with_suffix(".lock"))]
        if not running:
            return False
        if not self.waiting_said:
            self.waiting_said = True
            self.echo(f"{self.tag}no trial left to take; waiting for trial(s) "
                      f"{', '.join(str(t.number) for t in running)} running on other workers")
        deadline = time.monotonic() + min(WAIT_POLL_S, self.heartbeat or WAIT_POLL_S)
        while self.report.signal is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return True

    def _beat(self, trial) -> Heartbeat | None:
        return Heartbeat(self.study._storage, trial._trial_id, self.heartbeat) if self.heartbeat else None

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
                trial.set_user_attr("heartbeat", self.heartbeat)
            except optuna.exceptions.UpdateFinishedTrialError:
                os.close(fd)
                continue
            return Job(trial, dict(frozen.user_attrs["settings"]), Path(frozen.user_attrs["run_dir"]), fd, True,
                       frozenset(frozen.intermediate_values), self._beat(trial))
        return None

    def _ask_new(self) -> Job | None:
        """A new trial from the sampler, or a queued retry of a stale one (Optuna's ``ask`` hands out
        WAITING trials first)."""
        import optuna

        TS = optuna.trial.TrialState
        trials = self.study.get_trials(deepcopy=False)
        waiting = any(t.state == TS.WAITING for t in trials)
        if len(counted_trials(trials)) >= self.budget and not waiting:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "heartbeat ... used with Study.optimize": we beat ourselves
            trial = self.study.ask()
        beat = self._beat(trial)  # from now on another worker sees this trial alive
        retry_of = trial.user_attrs.get("retry_of")
        if retry_of is not None:
            job = self._retry_job(trial, retry_of, beat)
            if job is not None:
                return job
            return self._ask_new()
        run_dir = trial_dir(self.folder, trial.number)
        settings = trial_settings(self.spec, suggest(trial, self.spec), run_dir)
        fd = _try_lock(self._lock_path(trial.number))  # free: the number is new
        before = counted_trials([t for t in self.study.get_trials(deepcopy=False) if t.number < trial.number])
        if len(before) >= self.budget:  # a worker on another machine took the last place first
            self._surplus(trial, beat)
            if fd is not None:
                os.close(fd)
            return None
        for key, value in (("settings", settings), ("run_dir", str(run_dir)), ("worker", self.name),
                           ("heartbeat", self.heartbeat)):
            trial.set_user_attr(key, value)
        if fd is None:
            raise SweepError(f"cannot lock {self._lock_path(trial.number)}")
        return Job(trial, settings, run_dir, fd, False, beat=beat)

    def _retry_job(self, trial, retry_of: int, beat: Heartbeat | None) -> Job | None:
        """The job of a queued retry of stale trial ``retry_of``: its settings, in its run folder when
        that folder holds a checkpoint here (it resumes), else in a folder of its own (it starts
        afresh). None when another retry of the same trial came first (this one is surplus)."""
        first = min(t.number for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("retry_of") == retry_of)
        if first != trial.number:
            self._surplus(trial, beat)
            return None
        attrs = trial.user_attrs
        settings = dict(attrs.get("settings") or trial_settings(self.spec, suggest(trial, self.spec), Path()))
        old = Path(attrs["run_dir"]) if attrs.get("run_dir") else None
        resume = old is not None and has_checkpoint(old)
        run_dir = old if resume else trial_dir(self.folder, trial.number)
        settings["training.output_dir"] = str(run_dir)
        fd = _try_lock(self._lock_path(trial.number))
        if fd is None:
            raise SweepError(f"cannot lock {self._lock_path(trial.number)}")
        for key, value in (("settings", settings), ("run_dir", str(run_dir)), ("worker", self.name),
                           ("heartbeat", self.heartbeat), ("resumes", int(attrs.get("resumes", 0)) + resume)):
            trial.set_user_attr(key, value)
        self.echo(f"{self.tag}trial {trial.number}: retry of trial {retry_of}, "
                  + (f"resuming from {run_dir}" if resume else "starting afresh (no checkpoint of it here)"))
        return Job(trial, settings, run_dir, fd, resume, beat=beat)

    def _surplus(self, trial, beat: Heartbeat | None) -> None:
        import optuna

        if beat is not None:
            beat.stop()
        trial.set_user_attr("surplus", True)
        self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

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
        job.fitted = plan.fitted
        if plan.fitted:  # apply runs the plan's fit, never one of its own
            trial.set_user_attr("fitted", plan.fitted)
            described += "  fitted: " + " ".join(f"{k}={v!r}" for k, v in plan.fitted.items())
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
            fitted = {} if resume else job.fitted  # a resume runs what its checkpoint ran (apply reads it)
            process = TrialProcess(apply_command(self.base, {**job.settings, **fitted}, resume=resume,
                                                 nproc=self.nproc),
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
        if outcome.taken:
            self.echo(f"{self.tag}trial {number}: another worker failed it for a late heartbeat and retries it; "
                      "this worker stopped its run")
            return
        if outcome.interrupted is not None:  # left RUNNING: the next `apr sweep run` resumes it
            self.echo(f"{self.tag}trial {number}: interrupted at step {(state or {}).get('step')}; "
                      "run the same command again to resume it")
            return
        try:
            self._tell(job, outcome, state, seconds)
        except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale between two reports
            self.echo(f"{self.tag}trial {number}: another worker failed it for a late heartbeat and retries it; "
                      "its result here is not recorded")
            return
        self.report.ran.append(number)

    def _tell(self, job: Job, outcome, state: dict | None, seconds: float) -> None:
        import optuna

        trial, number = job.trial, job.trial.number
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


def prepare(spec: SweepSpec, folder: Path, storage: str | None, count: int | None, worker: int = 0, *,
            heartbeat: int | None = HEARTBEAT_S, grace: int | None = GRACE_S, given: str | Path | None = None):
    """Everything checked before any trial: the base config and the listed values, the budget, the
    sweep's folder (apr.sweep.folder; ``given``: it came from --dir), the storage and the study
    (with Optuna's heartbeat every ``heartbeat`` seconds, None or 0: off, and
    a stale trial retried after ``grace`` seconds). Returns (base config, study, url, budget)."""
    base = check_base(spec)
    budget = trial_budget(spec, count)
    check_heartbeat(heartbeat, grace)
    check_folder(spec, folder, given)
    claim_folder(spec, folder, given)  # this sweep's alone: another sweep's folder is refused, never shared
    url = storage or default_url(folder)
    study = open_study(spec, url, worker=worker, heartbeat=heartbeat or None, grace=grace,
                       on_stale=StaleTrialRetry() if heartbeat else None)
    return base, study, url, budget


def check_heartbeat(heartbeat: int | None, grace: int | None) -> None:
    """The grace period must outlast a heartbeat, or live trials would be failed between beats."""
    if heartbeat and grace is not None and grace <= heartbeat:
        raise SweepError(f"--grace {grace} must be longer than --heartbeat {heartbeat}", [Finding(
            "error", "sweep.heartbeat", "a trial is failed when its heartbeat is older than the grace period, so the "
            "grace period must be longer than the heartbeat interval (a few intervals: a late beat is not a dead "
            "worker)", path="--grace", expected=f"more than {heartbeat} s (e.g. {5 * heartbeat})", got=f"{grace} s")])


def run_sweep(spec: SweepSpec, folder: Path, *, storage: str | None = None, count: int | None = None,
              workers: int = 1, nproc: int = 1, gpu: str | None = None, vram: str | None = None,
              heartbeat: int | None = HEARTBEAT_S, grace: int | None = GRACE_S,
              helper_command: Callable[[int], list[str]] | None = None,
              echo: Callable[[str], None] = lambda s: None, given: str | Path | None = None) -> SweepRun:
    """Run (or continue) the sweep with ``workers`` processes on this machine: this one and
    ``workers - 1`` helpers started with ``helper_command(i)`` (the CLI's own command line)."""
    base, study, url, budget = prepare(spec, folder, storage, count, heartbeat=heartbeat, grace=grace, given=given)
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
               heartbeat: int | None = HEARTBEAT_S, grace: int | None = GRACE_S,
               echo: Callable[[str], None] = lambda s: None) -> WorkerReport:
    """A helper worker of `run_sweep` (``worker`` >= 1: its index)."""
    base, study, _url, budget = prepare(spec, folder, storage, count, worker=worker, heartbeat=heartbeat,
                                        grace=grace)
    return Worker(spec, study, base, folder, budget, nproc=nproc, gpu=gpu, vram=vram, echo=echo,
                  tag=f"[w{worker}] ").run()
