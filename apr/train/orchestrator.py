"""Orchestrated training (``training.orchestrator``; docs/design.md, "Orchestrated training"): a
driver over the run loop that switches the optimization strategy while the run trains.

At each decision point (after every ``decision_interval`` steps) the UCB1 bandit ranks the candidate
strategies; the top ``branches`` of them each train ``eval_horizon`` steps from the same exact state
(weights, moments, the engine's meta, data cursor, every RNG: the run's stateful parts, as a
checkpoint holds them, copied in memory), each is scored on the same validation batches, and the
winner's state is kept: the run goes on from it, its steps counted as the run's. The losers' steps
are recorded, not kept. Because every branch starts from the same bits and a branch changes nothing
outside that state, the winner continues bitwise as if it had been chosen without branching.
A nowcast (linear extrapolation of each weight tensor over the last decision points) is one more
branch, kept only when it scores better. Between decisions, a step whose loss exceeds
``max_loss_increase`` x the loss at the last decision point restores that point's state and
switches to ``safety_strategy``.

The orchestrator's own state (the strategy in force, the bandit, the decision history, the safety
reference) is a stateful part of every checkpoint, so a resume continues the same decisions.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import torch

from apr.checkpoint.manager import scan
from apr.fmt import fmt_loss
from apr.fsutil import atomic_path
from apr.steps import orchestration
from apr.steps.orchestration import UCB1, Strategy
from apr.train.outcome import NonFiniteError
from apr.train.reduction import agreed
from apr.train.restore import Saved, Snapshot, restore
from apr.train.updaters import make_updater

# The stateful parts a restore of the orchestrator's own keeps as they are: its bandit, decisions and
# strategy outlive a branch's restore; a safety rollback also keeps the data cursor past the bad window.
OWN = ("orchestrator",)
SAFETY = (*OWN, "data")


def apply_strategy(engine, config, strategy: Strategy) -> None:
    """Switch ``engine`` to ``strategy`` between two steps: its updater (AdamW or SGD over the same
    moment buffers), betas, weight decay, and clipping (mode and threshold)."""
    if engine.updater.name != strategy.optimizer:
        new = make_updater(config.optimizer, engine.backend, strategy.optimizer)
        new.rounding_seed = config.training.seed  # bf16 state: the stochastic rounding's key, as at the start
        if engine.layout is not None:  # autograd, or the walk on shards: the new updater takes the moments
            engine.layout.params.adopt(engine.updater, new)  # (the walk's flat buffers are shared as they are)
        engine.updater = new
    engine.updater.set_hyper(strategy.beta1, strategy.beta2, strategy.weight_decay)
    tr = config.training
    clip_mode = str(tr.clip_mode) if strategy.clip_mode == "off" else strategy.clip_mode
    clipped = config.model_copy(update={"training": tr.model_copy(update={"clip_mode": clip_mode,
                                                                          "grad_clip": strategy.grad_clip})})
    # the gradient buffers were allocated for the plan's execution: whether every gradient is kept stays
    keeps = engine.strategy.keeps_all_grads
    new = engine.plan.with_clip(clipped).strategy  # a planned candidate (apr/steps/orchestration.py)
    engine.strategy = replace(new, keeps_all_grads=keeps, norm_prepass=new.norm_prepass and not keeps)
    engine.grad_clip = strategy.grad_clip if strategy.grad_clip is not None else (tr.grad_clip or 1.0)


def extrapolate(history: list[tuple[int, dict[str, torch.Tensor]]], step: int) -> dict[str, torch.Tensor]:
    """Each tensor at ``step`` on the least-squares line through its values at the history's steps
    (float64 arithmetic, the tensors' own dtype out). Element by element, the history's terms added
    in history order: an element's result does not depend on the tensor's shape, so a rank's rows of
    an FSDP2 shard extrapolate to the bits one process computes for them (no matrix product, whose
    blocking follows the shape)."""
    steps = [float(s) for s, _ in history]
    mean_step = math.fsum(steps) / len(steps)
    t = [s - mean_step for s in steps]
    spread = math.fsum(x * x for x in t)
    out = {}
    for name, last in history[-1][1].items():  # a point read back from disk (a resume) joins on the newest's device
        ys = [w[name].to(last.device).double() for _, w in history]
        mean = ys[0].clone()
        for y in ys[1:]:
            mean += y
        mean /= len(ys)
        slope = torch.zeros_like(mean)
        for ti, y in zip(t, ys, strict=True):
            slope += ti * (y - mean)
        out[name] = (mean + slope / spread * (float(step) - mean_step)).to(last.dtype)
    return out


class Orchestrator:
    def __init__(self, config):
        self.config = config
        self.orch = config.training.orchestrator
        self.arms = orchestration.candidates(config)
        self.bandit = UCB1(self.arms, self.orch.exploration)
        self.current = self.orch.initial_strategy
        self.decisions = 0
        self.history: list[dict] = []  # one entry per decision (the last 50 are checkpointed)
        self.reference_loss: float | None = None  # the training loss at the last decision point
        self.good: Snapshot | None = None  # the state at the last decision point (safety rollback)
        # that state's step, checkpointed: a resumed process (no ``good`` in memory) rolls back to the
        # newest checkpoint at or before it (docs/design.md, "Orchestrated training", safety)
        self.good_step: int | None = None
        # the weights at the last decision points; each point also in the run folder (.apr/nowcast/), its
        # step checkpointed, so a resumed process extrapolates over the same points (``_read_history``)
        self.nowcast_history: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.rollbacks = 0
        self.next_decision = self.orch.decision_interval
        # the loop's last step and its loss, taken before that step's checkpoint (``StepLoss``, a hook):
        # a process resumed from that checkpoint runs the step's safety test and decision itself
        self.step_loss: tuple[int, float] | None = None
        self.loss_hook = StepLoss(self)

    def strategy(self, name: str | None = None) -> Strategy:
        return orchestration.resolve(self.config, name or self.current)

    def lr(self, lr: float) -> float:
        return lr * self.strategy().lr_factor

    def start(self, run, recorder) -> None:
        """Put the engine on the strategy in force (a fresh run's initial one, a resumed run's); a
        process resumed from the checkpoint of a step the loop had not yet passed to ``after_step``
        (the safety test, a decision) does that now, with the step's loss as the checkpoint holds it."""
        apply_strategy(run.engine, run.config, self.strategy())
        if self.loss_hook not in run.hooks:  # each step's loss, read before the loop checkpoints the step
            run.hooks.append(self.loss_hook)
        if run.start_step == 0:
            self._event(recorder, "strategy", 0, f"strategy {self.current} (initial)",
                        {"strategy": self.current, "settings": self.strategy().to_dict()})
        if self.step_loss is not None and self.step_loss[0] == run.step and run.step > 0:
            self._after_loss(run, self.step_loss[1], recorder)
        while self._due(run):  # stopped at a decision point (its loss not checkpointed: an older checkpoint)
            self._decide(run, self.reference_loss or math.inf, recorder)

    # ------------------------------------------------------------------------------ per step

    def after_step(self, run, report, recorder):
        """The safety test on this step's loss, then a decision when one is due (either may move
        ``run.step``); a ``Stop`` when a step went non-finite, else None."""
        try:
            self._after_step(run, report, recorder)
        except NonFiniteError as err:
            return run._non_finite(err, recorder)
        return None

    def _after_step(self, run, report, recorder) -> bool:
        held = self.step_loss
        return self._after_loss(run, held[1] if held is not None and held[0] == run.step else
                                self._loss(run, report), recorder)

    def _after_loss(self, run, loss: float, recorder) -> bool:
        self.step_loss = None  # tested: a checkpoint written from here on does not hold it for a resume
        limit = None if self.reference_loss is None or self.orch.max_loss_increase is None else \
            self.orch.max_loss_increase * self.reference_loss
        if limit is not None and (self.good is not None or self.good_step is not None) and not loss <= limit:
            if self._safety_rollback(run, loss, limit, recorder):
                return True
        moved = False
        while self._due(run):  # a kept horizon may reach the next decision point
            self._decide(run, loss, recorder)
            loss = self.reference_loss
            moved = True
        return moved

    def _due(self, run) -> bool:
        return run.step >= self.next_decision and orchestration.horizon_at(self.config, run.step, run.total_steps) > 0

    @staticmethod
    def _loss(run, report) -> float:
        """The step's loss as every rank takes it (canonical: the global batch's, on any world size)."""
        return float(agreed(run.dp, report.result.loss, run.plan.reduction == "canonical").item())

    # ------------------------------------------------------------------------------ decisions

    def _decide(self, run, loss: float, recorder) -> None:
        step = run.step
        horizon = orchestration.horizon_at(self.config, step, run.total_steps)
        if horizon < self.orch.eval_horizon:  # the run's last step stays a step of the loop (validated, saved)
            run.echo(f"{run.step_label(step)}  orchestrator: horizon clipped to {horizon} steps (the run ends at "
                     f"step {run.total_steps})")
        k = orchestration.branch_count(self.config)
        chosen = self.bandit.choose(k)
        start = Snapshot.take(run)
        start_val = self._score(run)
        branches, best, best_state = [], None, None
        for i, name in enumerate(chosen):
            if i:
                restore(run, start, keep=OWN)
            val, losses, failed = self._train_branch(run, name, step, horizon)
            reward = (start_val - val) / horizon if val is not None and math.isfinite(val) else -math.inf
            self.bandit.update(name, reward if math.isfinite(reward) else -1e9)
            branches.append({"strategy": name, "val_loss": val, "reward": reward, "train_losses": losses,
                             "failed": failed})
            if best is None or reward > branches[best]["reward"]:
                best = i
                best_state = None if i == len(chosen) - 1 else Snapshot.take(run)
        nowcast, failed = None, branches[best]["failed"]
        if failed:  # every branch went non-finite: the run goes on from the decision point, as it was
            restore(run, start, keep=OWN)
            best_state = None
        elif self.orch.nowcasting.enabled:
            nowcast = self._nowcast(run, start, step, branches[best]["val_loss"], best_state, recorder)
        winner = self.current if failed else branches[best]["strategy"]
        if nowcast is None and best_state is not None:
            restore(run, best_state, keep=OWN)  # the last branch trained was not the winner: take the winner's bits
        run.move_to(step if failed else step + horizon)
        self.next_decision = step + self.orch.decision_interval
        self.decisions += 1
        previous, self.current = self.current, winner
        apply_strategy(run.engine, run.config, self.strategy())
        self.reference_loss = loss if failed else branches[best]["train_losses"][-1]
        self.good = Snapshot.take(run) if self.orch.max_loss_increase is not None else None
        self.good_step = run.step if self.good is not None else None
        entry = {"step": step, "decision": self.decisions, "start_val_loss": start_val, "horizon": horizon,
                 "branches": branches, "winner": winner, "previous": previous, "nowcast": nowcast,
                 "bandit": self.bandit.state_dict(), "kept_until": run.step}
        self.history = [*self.history, entry][-50:]
        for b in branches:
            kept = "kept" if b["strategy"] == winner and nowcast is None and not failed else "discarded"
            self._event(recorder, "branch", step, f"branch {b['strategy']}: {horizon} steps, val loss "
                        f"{fmt_loss(b['val_loss'])} ({kept})", {**b, "horizon": horizon, "kept": kept == "kept"})
        scores = ", ".join(f"{b['strategy']} {fmt_loss(b['val_loss'])}" for b in branches)
        self._event(recorder, "decision", step, f"decision {self.decisions}: {winner} wins ({scores}; from "
                    f"{fmt_loss(start_val)}); steps {step + 1}-{run.step} kept", entry)
        if winner != previous:
            self._event(recorder, "switch", step, f"strategy {previous} -> {winner}",
                        {"from": previous, "to": winner, "settings": self.strategy().to_dict()})
        run.echo(f"{run.step_label(run.step)}  orchestrator: {winner} ({scores})")
        if self.good is not None:  # the safety rollback's target on disk: a resumed process rolls back to it
            run.save(run.step, False, recorder)
        run.steplog.start(run.step)

    def _train_branch(self, run, name: str, step: int, horizon: int) -> tuple[float | None, list[float], bool]:
        """``horizon`` steps of strategy ``name`` from the run's current state; its validation loss."""
        apply_strategy(run.engine, run.config, self.strategy(name))
        factor = self.strategy(name).lr_factor
        try:
            losses = run.run_steps(horizon, factor)  # the loop's own steps, from ``step`` (the run's)
            run.engine.check_finite()
        except NonFiniteError:
            return None, [], True
        values = agreed(run.dp, torch.stack(losses), run.plan.reduction == "canonical")
        return self._score(run), [float(x) for x in values.tolist()], False

    def _score(self, run) -> float | None:
        """The validation loss on the same ``eval_batches`` for every branch (averaged over ranks)."""
        v = run.validation
        kept, v.eval_batches = v.eval_batches, self.orch.eval_batches or v.eval_batches
        try:
            return v.measure(run.engine)
        finally:
            v.eval_batches = kept

    # ------------------------------------------------------------------------------ nowcasting

    def _nowcast(self, run, start: Snapshot, step: int, best_val: float | None, best_state, recorder) -> dict | None:
        """Extrapolate each weight tensor linearly over the decision-point history (least squares in
        the step) ``ahead`` steps past this point; kept only when its validation loss beats the best
        branch's. Returns its record when kept."""
        cfg = self.orch.nowcasting
        before = [s for s, _ in self.nowcast_history]
        self.nowcast_history = [*self.nowcast_history, (step, start.weights())][-cfg.history:]
        self._write_point(run, step, start, keep={*before, *(s for s, _ in self.nowcast_history)})
        if len(self.nowcast_history) < 2 or best_val is None:
            return None
        winner_state = best_state or Snapshot.take(run)
        ahead = cfg.ahead or self.orch.decision_interval
        jumped = extrapolate(self.nowcast_history, step + ahead)
        restore(run, winner_state.with_tensors({**winner_state.tensors, **jumped}), keep=OWN)  # shards: own rows
        val = self._score(run)
        record = {"ahead": ahead, "history": [int(s) for s, _ in self.nowcast_history], "val_loss": val,
                  "best_branch_val_loss": best_val, "kept": val is not None and val < best_val}
        self._event(recorder, "nowcast", step, f"nowcast {ahead} steps ahead: val loss {fmt_loss(val)} against "
                    f"{fmt_loss(best_val)} ({'kept' if record['kept'] else 'discarded'})", record)
        if not record["kept"]:
            restore(run, winner_state, keep=OWN)
            return None
        return record

    def _write_point(self, run, step: int, start: Snapshot, keep: set[int]) -> None:
        """The decision point's weights in ``.apr/nowcast/`` (before any checkpoint names the step); the
        points no checkpoint since the previous decision names are removed."""
        if start.local or run.is_main:  # a sharded engine: each rank its own rows
            from safetensors.torch import save_file  # lazy: nowcasting only

            path = _point_path(run, step, start.local)
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                save_file({k: v.detach().cpu().contiguous() for k, v in start.weights().items()}, str(tmp))
            suffix = path.name[len(f"step-{step}"):]
            for old in path.parent.glob(f"step-*{suffix}"):
                head = old.name[:-len(suffix)].removeprefix("step-")
                if head.isdigit() and int(head) not in keep:
                    old.unlink(missing_ok=True)
        if run.dp is not None:  # every rank's point is on disk before a checkpoint names it
            run.dp.barrier()

    def _read_history(self, run, steps: list[int]) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """The nowcast points a checkpoint names, read back from ``.apr/nowcast/``; [] (said) when one is gone."""
        if not steps or run is None:
            return []
        local = bool(run.engine.sharded)
        points = [_read_point(run, s, local) for s in steps]
        missing = [_point_path(run, s, local).name for s, p in zip(steps, points, strict=True) if p is None]
        if missing:
            run.warn(f"orchestrator: the nowcast points {', '.join(missing)} are gone from "
                     f"{_point_path(run, steps[0], local).parent}: the nowcast history starts again at the next "
                     "decision")
            return []
        return list(zip(steps, points, strict=True))

    # ------------------------------------------------------------------------------ safety

    def _good_state(self, run, recorder) -> Snapshot | Saved | None:
        """The state to roll back to: the last decision point's in memory, or, in a resumed process,
        the newest checkpoint at or before that point's step, read; None when retention removed every
        such checkpoint (said once)."""
        if self.good is not None:
            return self.good
        if run.is_main:
            run.record_checkpoints(recorder, wait=True)  # the background write in flight is on disk
        if run.dp is not None:  # every rank lists the same checkpoints (rank 0's write is complete)
            run.dp.barrier()
        targets = [e for e in scan(run.run_dir) if e.complete and e.step <= self.good_step]
        if not targets:
            run.warn(f"orchestrator: no checkpoint at or before step {self.good_step} (the last decision's state) "
                     "is left: no safety rollback until the next decision")
            self.good_step = None
            return None
        saved = Saved(*run.load_checkpoint(targets[0].json_path))
        run.echo(f"orchestrator: the last decision's state is {saved.path.name} (resumed process)")
        return saved

    def _safety_rollback(self, run, loss: float, limit: float, recorder) -> bool:
        step = run.step
        good = self._good_state(run, recorder)
        if good is None:
            return False
        accum = run.config.training.gradient_accumulation
        window = [run.loader.absolute - (step - good.step) * accum, (step - good.step) * accum]
        # the bad window's data is not replayed; the bandit, the decisions: the run's, not the state's
        restore(run, good, keep=SAFETY)
        self.good, self.good_step = good if isinstance(good, Snapshot) else Snapshot.take(run), good.step
        self.rollbacks += 1
        previous, self.current = self.current, self.orch.safety_strategy
        apply_strategy(run.engine, run.config, self.strategy())
        message = (f"safety rollback: loss {fmt_loss(loss)} above {self.orch.max_loss_increase:g} x "
                   f"{fmt_loss(self.reference_loss)} at step {step}; restored step {good.step}, strategy {previous} -> "
                   f"{self.current}, skipping the data of steps {good.step + 1}-{step}")
        recorder.rewind(good.step)
        self._event(recorder, "safety_rollback", step, message,
                    {"loss": loss, "limit": limit, "restored_step": good.step, "from": previous,
                     "to": self.current, "micro_batches": window})
        run.echo(f"{run.step_label(step)}  {message}")
        run.save(run.step, False, recorder)  # a resume from here on starts past the bad window, on the safety strategy
        run.steplog.start(run.step)
        return True

    # ------------------------------------------------------------------------------ records, state

    def _event(self, recorder, kind: str, step: int, message: str, detail: dict) -> None:
        recorder.log_event(kind, step, message, _finite(detail))

    def state_dict(self) -> dict:
        return {"orchestrator": {"current": self.current, "decisions": self.decisions,
                                 "bandit": self.bandit.state_dict(),
                                 "history": copy.deepcopy(self.history), "reference_loss": self.reference_loss,
                                 "rollbacks": self.rollbacks, "next_decision": self.next_decision,
                                 "good_step": self.good_step,
                                 "step_loss": None if (held := self.step_loss) is None else  # inf, nan: as text
                                 [held[0], held[1] if math.isfinite(held[1]) else str(held[1])],
                                 "nowcast_steps": [int(s) for s, _ in self.nowcast_history]}}

    def load_state_dict(self, meta: dict, run=None) -> None:
        state = meta.get("orchestrator")
        if not state:  # a checkpoint of a run without orchestration: nothing of ours changes
            return
        # a resume or training.rollback's restore: the in-memory states are of steps that are no more
        self.good = None
        self.nowcast_history = self._read_history(run, [int(s) for s in state.get("nowcast_steps") or ()])
        held = state.get("step_loss")
        self.step_loss = None if held is None else (int(held[0]), float(held[1]))
        self.current, self.decisions = state["current"], int(state["decisions"])
        self.bandit.load_state_dict(state["bandit"])
        self.history = copy.deepcopy(state.get("history") or [])
        self.reference_loss, self.rollbacks = state.get("reference_loss"), int(state.get("rollbacks", 0))
        self.next_decision = int(state.get("next_decision", self.orch.decision_interval))
        good_step = state.get("good_step")
        self.good_step = None if good_step is None else int(good_step)


class StepLoss:
    """A step hook (apr/train/stop.py): the step's loss, read before the loop checkpoints the step."""

    def __init__(self, orchestrator: Orchestrator):
        self.orchestrator = orchestrator

    def after_step(self, run, report):
        self.orchestrator.step_loss = (run.step, Orchestrator._loss(run, report))
        return None


def _point_path(run, step: int, local: bool) -> Path:
    """A nowcast point's file: ``.apr/nowcast/step-N.safetensors`` in the run folder, or a rank's rows
    of it on shards."""
    rank = f".rank{run.dp.rank}-of-{run.dp.world_size}" if local and run.dp is not None else ""
    return Path(run.run_dir) / ".apr" / "nowcast" / f"step-{step}{rank}.safetensors"


def _read_point(run, step: int, local: bool) -> dict[str, torch.Tensor] | None:
    """A nowcast point's weights as this process holds them (a rank's rows on shards): its own file, or,
    resumed on another number of ranks, the one another layout wrote (whole, or a file of rows per rank:
    joined, then cut to this rank's rows), so the history, and the nowcast, go on as they would have;
    None when neither is there."""
    from safetensors.torch import load_file  # lazy: nowcasting only

    path = _point_path(run, step, local)
    if path.is_file():
        return load_file(str(path))
    layout = run.engine.layout  # None: the walk (its weights are the model's parameters)
    named = layout.params.named if layout is not None else dict(run.engine.model.named_parameters())
    whole = _whole_point(path.parent, step, {name: p.shape[0] for name, p in named.items()})  # DTensor: whole
    if whole is None or not local:
        return whole
    out = {}
    for name, p in named.items():
        start = layout.row_start(p)
        out[name] = whole[name][start:start + p.to_local().shape[0]].contiguous()
    return out


def _whole_point(folder: Path, step: int, rows: dict[str, int]) -> dict[str, torch.Tensor] | None:
    """A point's whole tensors from the files any layout wrote: ``step-N.safetensors``, or every
    ``step-N.rankR-of-K`` file of one K, each tensor's rows joined in rank order up to its whole rows
    (under hybrid the first shard group's files hold them all; the replicas' repeat them)."""
    from safetensors.torch import load_file  # lazy: nowcasting only

    if (folder / f"step-{step}.safetensors").is_file():
        return load_file(str(folder / f"step-{step}.safetensors"))
    worlds: dict[int, dict[int, Path]] = {}
    for path in folder.glob(f"step-{step}.rank*-of-*.safetensors"):
        rank, _, world = path.name[len(f"step-{step}.rank"):-len(".safetensors")].partition("-of-")
        if rank.isdigit() and world.isdigit():
            worlds.setdefault(int(world), {})[int(rank)] = path
    complete = [w for w, found in worlds.items() if set(found) == set(range(w))]
    if not complete:
        return None
    parts = [load_file(str(worlds[complete[0]][r])) for r in range(complete[0])]
    out = {}
    for name in parts[0]:
        total = rows.get(name)  # unknown: every part's rows (no replicas to leave out)
        taken, have = [], 0
        for part in parts:
            if total is not None and have >= total:
                break
            taken.append(part[name])
            have += part[name].shape[0]
        if total is not None and have != total:
            return None
        out[name] = torch.cat(taken)
    return out


def _finite(value):
    """JSON without NaN/inf (a failed branch's reward is -inf): those become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
