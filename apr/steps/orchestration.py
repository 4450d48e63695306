"""Orchestrated training's torch-free half (docs/design.md, "Orchestrated training"): the built-in
strategies, a strategy resolved against the run's optimizer and clipping settings, the UCB1 bandit
that chooses among them, and the compute a decision point costs. The plan and the validator read
these; apr/train/orchestrator.py drives the run with them.

A strategy is data (optimizer, learning-rate factor, betas, weight decay, clip mode and threshold),
never code: switching one is setting the engine's updater and clipping between two steps.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

# The four strategies caramba names, as settings relative to the run's own: "conservative" is the
# run as configured; "aggressive" doubles the learning rate and clips each block on its own
# (looser than the global norm); "sgd_escape" is SGD with momentum (its learning rate is SGD's
# usual ~30x AdamW's, its decoupled decay scaled down by as much); "spike_resistant" lowers the
# learning rate and clips to a quarter of the threshold.
BUILTIN_STRATEGIES: dict[str, dict] = {
    "conservative_adamw": {"optimizer": "adamw", "lr_factor": 1.0, "clip_mode": "global"},
    "aggressive_adamw": {"optimizer": "adamw", "lr_factor": 2.0, "clip_mode": "per_block"},
    "sgd_escape": {"optimizer": "sgd", "lr_factor": 30.0, "clip_mode": "global", "weight_decay_factor": 1 / 30},
    "spike_resistant": {"optimizer": "adamw", "lr_factor": 0.3, "clip_mode": "global", "clip_factor": 0.25},
}


@dataclass(frozen=True)
class Strategy:
    """A strategy with every setting resolved against the run's config."""

    name: str
    optimizer: str  # adamw | sgd
    lr_factor: float
    beta1: float
    beta2: float
    weight_decay: float
    clip_mode: str  # global | per_block | adagc | off
    grad_clip: float | None  # None with clip_mode off

    def to_dict(self) -> dict:
        return asdict(self)


def strategy_table(config) -> dict[str, dict]:
    """Every strategy the run knows as raw settings: the built-ins, then the config's own (a
    built-in's name redefines it)."""
    table = {name: dict(s) for name, s in BUILTIN_STRATEGIES.items()}
    for name, s in config.training.orchestrator.strategies.items():
        table[name] = {k: (str(v) if hasattr(v, "value") else v) for k, v in s.model_dump().items()}
    return table


def resolve(config, name: str) -> Strategy:
    """The strategy ``name`` against the run's optimizer and clipping (KeyError for an unknown name)."""
    raw = strategy_table(config)[name]
    opt, tr = config.optimizer, config.training
    clip_mode = raw.get("clip_mode") or "run"
    if clip_mode == "run":
        clip_mode = str(tr.clip_mode)
    grad_clip = None if tr.grad_clip is None else tr.grad_clip * float(raw.get("clip_factor") or 1.0)
    if grad_clip is None or clip_mode == "off":
        clip_mode, grad_clip = "off", None
    decay = raw.get("weight_decay")
    if decay is None:
        decay = opt.weight_decay * float(raw.get("weight_decay_factor", 1.0))
    return Strategy(name=name, optimizer=str(raw.get("optimizer") or "adamw"),
                    lr_factor=float(raw.get("lr_factor") or 1.0),
                    beta1=float(opt.beta1 if raw.get("beta1") is None else raw["beta1"]),
                    beta2=float(opt.beta2 if raw.get("beta2") is None else raw["beta2"]),
                    weight_decay=float(decay), clip_mode=clip_mode, grad_clip=grad_clip)


def candidates(config) -> list[str]:
    orch = config.training.orchestrator
    return list(orch.candidates) if orch.candidates is not None else list(strategy_table(config))


def branch_count(config) -> int:
    """Branches trained at a decision point: ``branches``, at most one per candidate."""
    orch = config.training.orchestrator
    return min(orch.branches, len(candidates(config)))


def horizon_at(config, step: int, total_steps: int) -> int:
    """The horizon of a decision after ``step``: ``eval_horizon``, clipped so that the run's last
    step is a step of the loop (validated, checkpointed); 0: no decision fits."""
    return max(min(config.training.orchestrator.eval_horizon, total_steps - step - 1), 0)


def decision_steps(config, total_steps: int) -> list[int]:
    """The steps after which a decision is made: every ``decision_interval``, while a horizon
    still fits before the end of the run."""
    orch = config.training.orchestrator
    return [s for s in range(orch.decision_interval, total_steps, orch.decision_interval)
            if horizon_at(config, s, total_steps) > 0]


def overhead(config, total_steps: int) -> dict:
    """The compute a run's decision points add, in optimizer steps: each decision trains K branches
    for the horizon, one of which is kept (it is the run's own next steps), so K - 1 horizons are
    extra; a nowcast is a weight update and an evaluation, no steps. The scoring evaluations are
    counted in validation micro-batches."""
    orch = config.training.orchestrator
    k = branch_count(config)
    decisions = decision_steps(config, total_steps)
    horizons = [horizon_at(config, s, total_steps) for s in decisions]
    extra = sum(h * (k - 1) for h in horizons)
    scored = len(decisions) * (k + int(orch.nowcasting.enabled)) if (k > 1 or orch.nowcasting.enabled) else 0
    return {"decisions": len(decisions), "branches": k, "horizon": orch.eval_horizon,
            "extra_steps": extra, "extra_fraction": extra / total_steps if total_steps else 0.0,
            "scoring_evaluations": scored,
            "eval_batches": orch.eval_batches or config.training.eval_batches}


# ------------------------------------------------------------------------------------ the bandit


class UCB1:
    """UCB1 (Auer et al. 2002) over named arms: pull each arm once, then the arm with the largest
    mean reward + c * sqrt(ln N / n). Rewards are a strategy's validation-loss decrease per step of
    the horizon. Ties go to the arm listed first, so every rank (and a resumed run) decides alike."""

    def __init__(self, arms: list[str], exploration: float):
        self.arms = list(arms)
        self.c = float(exploration)
        self.pulls = {a: 0 for a in self.arms}
        self.total = {a: 0.0 for a in self.arms}

    def score(self, arm: str) -> float:
        n = self.pulls[arm]
        if n == 0:
            return math.inf
        pulled = sum(self.pulls.values())
        return self.total[arm] / n + self.c * math.sqrt(math.log(pulled) / n)

    def choose(self, k: int = 1) -> list[str]:
        """The ``k`` arms with the largest upper confidence bounds, best first."""
        ranked = sorted(self.arms, key=lambda a: (-self.score(a), self.arms.index(a)))
        return ranked[:k]

    def update(self, arm: str, reward: float) -> None:
        self.pulls[arm] += 1
        self.total[arm] += float(reward)

    def state_dict(self) -> dict:
        return {"pulls": dict(self.pulls), "total": dict(self.total)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            for arm in self.arms:
                self.pulls[arm] = int(state["pulls"].get(arm, 0))
                self.total[arm] = float(state["total"].get(arm, 0.0))
