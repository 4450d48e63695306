"""Is a checkpoint's config compatible with the config a run resumes under?

Every changed key is classified. *Breaking* keys change what the steps after the resume point
compute, so the resumed run would no longer equal an uninterrupted one (model shape, data, seed,
batch, accumulation, precision, optimizer, engine, ...): `apply --resume` refuses them without
`--force`. *Harmless* keys only change how long the run goes, what it records or where
(max_steps, epochs, save/log/eval intervals, monitoring, output_dir, plan-only hardware hints, and
init-only settings a resumed run never reads): they are allowed and listed. A key not named here
(a newer schema's) counts as breaking, the safe side. docs/checkpoints.md has the table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from apr.errors import AprError, Finding

# Exact key paths or prefixes ("a.b." matches everything under a.b). Checked in this order:
# the first harmless match wins, then everything else is breaking.
HARMLESS: dict[str, str] = {
    "training.max_steps": "the run's length; decaying LR schedules are stretched or shortened from here on",
    "training.epochs": "the run's length (caps the step count)",
    "training.save_interval": "how often checkpoints are written",
    "training.keep_last": "how many step checkpoints are kept",
    "training.log_interval": "how often metrics are logged",
    "training.eval_interval": "how often validation runs",
    "training.eval_batches": "how many batches validation averages",
    "training.early_stopping.": "when a val-loss plateau ends the run; the steps taken train the same weights",
    "training.output_dir": "where records and checkpoints go",
    "training.gpu": "the plan's hardware target only",
    "training.execution.activations": "what is kept or recomputed; every policy trains the same weights",
    "training.execution.gradients": "where gradients live; every policy trains the same weights",
    "training.vram": "the plan's hardware target only",
    "model.path": "initial weights; a resumed run takes its weights from the checkpoint",
    "model.init_from": "initial weights; a resumed run takes its weights from the checkpoint",
    "model.architecture.initializer_range": "initialisation only; a resumed run does not initialise",
    "monitoring.": "dashboards, tracking and alerts",
}

WHY_BREAKING: dict[str, str] = {
    "model.": "the model's shape or arithmetic",
    "data.": "which tokens are read, in which order and shape",
    "optimizer.": "the optimizer's update rule",
    "training.seed": "data order and every random draw",
    "training.gradient_accumulation": "the effective batch",
    "training.world_size": "the effective batch and each rank's slice of the data",
    "training.mixed_precision": "the arithmetic (not bitwise equal)",
    "training.warmup_steps": "the learning-rate schedule",
    "training.lr_scheduler": "the learning-rate schedule",
    "training.decay_fraction": "the learning-rate schedule",
    "training.decay_stage": "the learning-rate schedule",
    "training.grad_clip": "the gradients",
    "training.clip_mode": "the gradients",
    "training.engine": "the order of floating-point operations",
    "training.kernels": "the order of floating-point operations",
    "training.device": "the order of floating-point operations",
    "training.loss_chunk_size": "the order of floating-point operations",
    "training.mode": "the objective",
}


def _match(path: str, table: dict[str, str]) -> str | None:
    for key, why in table.items():
        if path == key or (key.endswith(".") and path.startswith(key)):
            return why
    return None


def classify(path: str) -> tuple[bool, str]:
    """(breaking, why) for a dotted key path."""
    why = _match(path, HARMLESS)
    if why is not None:
        return False, why
    why = _match(path, WHY_BREAKING)
    return True, why or "not known to be safe to change on resume"


@dataclass(frozen=True)
class Change:
    path: str
    old: Any
    new: Any
    breaking: bool
    why: str

    def line(self) -> str:
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


_ABSENT = object()


def _show(v: Any) -> str:
    if v is _ABSENT:
        return "(absent)"
    return json.dumps(v, default=str)


@dataclass
class ConfigDiff:
    changes: list[Change] = field(default_factory=list)

    @property
    def breaking(self) -> list[str]:
        return [c.line() for c in self.changes if c.breaking]

    @property
    def harmless(self) -> list[str]:
        return [c.line() for c in self.changes if not c.breaking]

    @property
    def ok(self) -> bool:
        """No breaking change: resuming is exact."""
        return not any(c.breaking for c in self.changes)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def render(self) -> str:
        if not self.changes:
            return "config unchanged since the checkpoint"
        lines = ["config changed since the checkpoint (old -> new):"]
        for title, flag in (("breaking (exact resume impossible; refused without --force)", True),
                            ("harmless (allowed)", False)):
            group = [c for c in self.changes if c.breaking is flag]
            if group:
                lines.append(f"  {title}:")
                lines += [f"    {'!' if flag else '~'} {c.line()}    # {c.why}" for c in group]
        return "\n".join(lines)

    def findings(self, file: str | None = None) -> list[Finding]:
        return [
            Finding("error" if c.breaking else "info",
                    "resume.config_breaking" if c.breaking else "resume.config_harmless",
                    f"changed since the checkpoint: {c.why}", path=c.path, file=file,
                    expected=_show(c.old), got=_show(c.new))
            for c in self.changes
        ]

    def check(self, force: bool = False, file: str | None = None) -> None:
        """Raise AprError listing the breaking changes, unless there are none or ``force``."""
        if self.ok or force:
            return
        raise AprError(
            f"the config changed in {len(self.breaking)} way(s) that break an exact resume "
            "(pass --force to resume anyway)\n" + self.render(),
            [f for f in self.findings(file) if f.severity == "error"])


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; lists are leaves (an alert list changes as a whole)."""
    if isinstance(doc, dict) and doc:
        out: dict[str, Any] = {}
        for k, v in doc.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: doc}


def normalise_config(old: dict) -> dict:
    """Fill defaults into a stored config so that a default spelled out and one left implicit compare
    equal; a config the current schema rejects is compared as stored."""
    from apr.config.schema import AprConfig

    try:
        return AprConfig.model_validate(old).model_dump(mode="json")
    except Exception:  # pydantic ValidationError: an older or newer schema
        return old


def compare_configs(old_config: dict, new_config: Any) -> ConfigDiff:
    """Classify every difference between a checkpoint's stored config (a JSON dict) and the config a
    run resumes under (an AprConfig or a dict)."""
    new_doc = new_config if isinstance(new_config, dict) else new_config.model_dump(mode="json")
    old_flat = _flatten(normalise_config(old_config))
    new_flat = _flatten(normalise_config(new_doc) if isinstance(new_config, dict) else new_doc)
    changes = []
    for path in sorted(set(old_flat) | set(new_flat)):
        old = old_flat.get(path, _ABSENT)
        new = new_flat.get(path, _ABSENT)
        if old == new:
            continue
        breaking, why = classify(path)
        changes.append(Change(path, old, new, breaking, why))
    return ConfigDiff(changes)
