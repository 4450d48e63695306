"""`apr train lr-find`: Leslie Smith's learning-rate range test on a throwaway copy of the run.

The config's own run loop (engine, data, precision, clipping: ``apr.train.run``) trains fresh weights
for ``steps`` optimizer steps while the learning rate rises exponentially from ``min_lr`` to ``max_lr``
(its schedule is replaced; warmup, evaluation, alerts, sinks, early stopping, bad-step skipping and
rollback are off). Everything
the run writes goes to a temporary folder (output_dir and the global store both), removed at the
end: the config's output folder is never touched. The sweep ends early when the smoothed loss
exceeds ``diverge`` x its minimum or a step is non-finite.

Suggestion rules, both computed on the bias-corrected EMA of the loss (``smoothing``):
``steepest``: the LR where the smoothed loss falls fastest per unit of log LR (before its minimum);
``min10``: the LR of the smoothed loss's minimum divided by 10.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from ruamel.yaml import YAML

from apr.errors import AprError, Finding
from apr.fsutil import SQLITE_MAGIC, check_output_file, probe_writable, write_output
from apr.readers import read_text
from apr.train.lrplot import svg_plot
from apr.train.stop import StepReport, Stop

MAX_STEPS = 100_000  # a sweep is a few hundred steps; more is a typo (10**30) that would never end
MAX_LR = 1e3  # far past where any model diverges; 1e300 overflowed the float32 update (a traceback)

RULES = {
    "steepest": "steepest descent of the smoothed loss (most negative d loss / d ln lr, before its minimum)",
    "min10": "the smoothed loss's minimum LR / 10",
}


@dataclass
class RangeTest:
    min_lr: float = 1e-6
    max_lr: float = 1.0
    steps: int = 100
    smoothing: float = 0.98
    diverge: float = 4.0
    rule: str = "steepest"

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based): min_lr at 1, max_lr at ``steps``."""
        return self.min_lr * (self.max_lr / self.min_lr) ** ((step - 1) / max(self.steps - 1, 1))


def range_findings(test: RangeTest) -> list[Finding]:
    """The range test's options that cannot make a sweep, each named by its option."""
    out = []

    def bad(option: str, message: str, expected: str, got) -> None:
        out.append(Finding("error", "lr_find.options", f"{option}: {message}", path=option,
                           expected=expected, got=str(got)))

    for option, value in (("--min-lr", test.min_lr), ("--max-lr", test.max_lr)):
        if not (value > 0 and math.isfinite(value)):
            bad(option, "a learning rate must be a positive number", "a number > 0", value)
        elif value > MAX_LR:
            bad(option, f"a learning rate above {MAX_LR:,.0f} diverges at the first step", f"at most {MAX_LR:,.0f}",
                f"{value:g}")
    if not out and test.min_lr >= test.max_lr:
        bad("--min-lr", f"the range is empty: min {test.min_lr:g} >= max {test.max_lr:g}",
            f"below --max-lr ({test.max_lr:g})", test.min_lr)
    if test.steps < 10:
        bad("--steps", "too few steps to see a curve", "at least 10", test.steps)
    elif test.steps > MAX_STEPS:
        bad("--steps", "a range test needs a few hundred steps, not a training run", f"at most {MAX_STEPS:,}",
            test.steps)
    if not 0 <= test.smoothing < 1:
        bad("--smoothing", "the EMA decay must lie in [0, 1)", "0 <= smoothing < 1", test.smoothing)
    if not test.diverge > 1:
        bad("--diverge", "the divergence factor must exceed 1", "a number > 1", test.diverge)
    if test.rule not in RULES:
        bad("--rule", "unknown suggestion rule", " or ".join(RULES), test.rule)
    return out


@dataclass
class Curve:
    """What the sweep measured and what it suggests."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    stopped_early: str | None = None
    _avg: float = 0.0

    def add(self, lr: float, loss: float, beta: float) -> None:
        self.lrs.append(lr)
        self.losses.append(loss)
        self._avg = beta * self._avg + (1 - beta) * loss
        self.smoothed.append(self._avg / (1 - beta ** len(self.losses)))  # bias-corrected EMA

    def min_index(self) -> int:
        return min(range(len(self.smoothed)), key=self.smoothed.__getitem__)

    def steepest_index(self) -> int:
        """The point of the most negative slope of the smoothed loss against ln(lr), before the minimum
        (central differences; the first and last tenth of that stretch left out: the EMA's start-up
        and the turn at the minimum)."""
        end = self.min_index()
        if end < 2:
            return end
        logs = [math.log(x) for x in self.lrs]
        slopes = {i: (self.smoothed[i + 1] - self.smoothed[i - 1]) / (logs[i + 1] - logs[i - 1])
                  for i in range(1, end)}
        skip = max(1, end // 10)
        inner = {i: s for i, s in slopes.items() if skip <= i <= end - skip} or slopes
        return min(inner, key=inner.__getitem__)

    def suggest(self, rule: str) -> float:
        if rule == "min10":
            return self.lrs[self.min_index()] / 10
        return self.lrs[self.steepest_index()]


class _Sweep:
    """The StepHook that reads each step's loss (every step is a log step) and stops on divergence."""

    def __init__(self, test: RangeTest, curve: Curve):
        self.test, self.curve = test, curve

    def after_step(self, run, report: StepReport) -> Stop | None:
        loss = (report.metrics or {}).get("loss")
        if loss is None or not math.isfinite(loss):
            return None
        self.curve.add(report.lr, loss, self.test.smoothing)
        best = min(self.curve.smoothed)
        if len(self.curve.smoothed) > 5 and self.curve.smoothed[-1] > self.test.diverge * best:
            self.curve.stopped_early = (f"diverged at lr {report.lr:.3g} "
                                        f"(smoothed loss > {self.test.diverge:g} x its minimum)")
            return Stop("finished", self.curve.stopped_early, 0)
        return None


def sweep_config(config, test: RangeTest, output_dir: Path):
    """The config of the throwaway run: the sweep's length, nothing recorded outside ``output_dir``."""
    from apr.config.schema import AprConfig

    doc = config.model_dump(mode="json")
    tr = doc["training"]
    tr.update(max_steps=test.steps, warmup_steps=0, eval_interval=0, log_interval=1, save_interval=10**9,
              keep_last=1, output_dir=str(output_dir), epochs=10**6)
    tr["early_stopping"] = {"patience": None, "min_delta": 0.0}
    # the sweep drives the loss up on purpose: no skipped steps, no rollbacks
    tr["bad_steps"] = {**tr["bad_steps"], "loss_z": None, "grad_norm_z": None}
    tr["rollback"] = {**tr["rollback"], "threshold": None}
    doc["monitoring"]["alerts"] = []
    doc["monitoring"]["sinks"] = []
    doc["monitoring"]["block_norms"] = False  # a log every step: the telemetry would cost, and nothing reads it
    doc["evaluation"]["tasks"] = []
    doc["evaluation"]["samples"] = None
    return AprConfig.model_validate(doc)


def run_range_test(config_path: Path, test: RangeTest, *, settings: list[str] | None = None,
                   echo=None) -> Curve:
    """Plan the config (refusing on its errors), then sweep on a throwaway copy. Raises AprError."""
    from apr.apply import _device_budget, _plan_errors_error, command_line_overrides
    from apr.config import config_hash, load_config
    from apr.plan.build import build_plan, normalise_overrides, resolve_config

    problems = range_findings(test)
    if problems:
        raise AprError(f"apr train lr-find: {problems[0].message}", problems)
    overrides = command_line_overrides(settings, False)
    load_config(config_path, normalise_overrides(overrides) or None)  # a bad config fails before torch
    plan = build_plan(config_path, overrides=overrides or None, device_budget=_device_budget)
    if plan.errors:
        raise _plan_errors_error(plan, config_path)
    from apr.train.run import ApplyOptions, prepare_run

    curve = Curve()
    with tempfile.TemporaryDirectory(prefix="apr-lr-find-") as tmp:
        config = sweep_config(plan.config, test, Path(tmp) / "run")
        options = ApplyOptions(apr_home=Path(tmp) / "home", echo=echo or (lambda line: None),
                               handle_signals=False, hooks=[_Sweep(test, curve)])
        # the plan's policy on the throwaway copy; the exponential sweep is the schedule
        swept = replace(resolve_config(config, execution=plan.resolved.execution), schedule=test.lr)
        run = prepare_run(swept, config_hash=config_hash(config), config_path=Path(config_path), options=options)
        result = run.execute()
    if result.status == "failed" and curve.stopped_early is None:
        curve.stopped_early = result.reason
    if len(curve.losses) < 3:
        raise AprError(f"apr train lr-find: the sweep measured {len(curve.losses)} losses ({result.reason}); "
                       "lower --max-lr or raise --min-lr", [Finding(
                           "error", "lr_find.curve", "too few finite losses to suggest a learning rate",
                           path="--max-lr", expected="at least 3 finite losses", got=str(len(curve.losses)))])
    return curve


PLOT_NAME, JSON_NAME = "lr-find.svg", "lr-find.json"


@dataclass
class OutputTargets:
    """Where the sweep's files go, each checked (apr.fsutil.check_output_file) before the sweep."""

    plot: Path
    json_out: Path
    apply_to: Path | None
    inputs: list[Path]
    overwrite: bool
    replaceable: set[Path] = field(default_factory=set)  # default paths holding an earlier sweep's file


def _earlier_sweep_file(path: Path) -> bool:
    """A file an earlier ``apr train lr-find`` wrote at a default path (replaced without --overwrite)."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 16 << 20:
            return False
        head = path.read_bytes()[:4096]
    except OSError:
        return False
    if head.startswith(SQLITE_MAGIC):
        return False
    if path.suffix == ".json":
        return b'"format": "apr-lr-find"' in head
    return head.startswith(b"<svg") and b"LR range test" in head


def output_targets(config_path: Path, settings: list[str] | None, *, plot: Path | None, json_out: Path | None,
                   apply_to: Path | None, overwrite: bool, apply: bool | None = None) -> OutputTargets:
    """Resolve and check the sweep's outputs before any work. ``plot`` / ``json_out`` default to
    ``lr-find.svg`` / ``lr-find.json`` in the config's ``training.output_dir`` (the run's folder,
    never the current one); ``apply_to`` (given only with --apply) defaults to ``CONFIG.lr-find.yaml``
    beside the config. Each must be a new path (or, with ``overwrite``, an existing regular file),
    never the config, apr's stores or a run's records, a FIFO, a device or a symlink. Raises AprError."""
    from apr.apply import command_line_overrides
    from apr.config import load_config
    from apr.plan.build import normalise_overrides

    config_path = Path(config_path)
    wanted_apply = apply if apply is not None else apply_to is not None
    overrides = command_line_overrides(settings, False)
    loaded = load_config(config_path, normalise_overrides(overrides) or None)
    config = loaded.config
    folder = Path(config.training.output_dir).expanduser()
    # every file the sweep reads: the config, the bases it extends, the tokenizer
    inputs = [config_path, *(Path(f) for f in loaded.layers.files)]
    if config.data.tokenizer:
        inputs.append(Path(config.data.tokenizer).expanduser())
    targets = OutputTargets(plot=plot if plot is not None else folder / PLOT_NAME,
                            json_out=json_out if json_out is not None else folder / JSON_NAME,
                            apply_to=None, inputs=inputs, overwrite=overwrite)
    if wanted_apply:
        targets.apply_to = (apply_to if apply_to is not None
                            else config_path.with_name(config_path.stem + ".lr-find.yaml"))
    checked = [("--plot", targets.plot, plot is None), ("--json-out", targets.json_out, json_out is None)]
    if targets.apply_to is not None:
        checked.append(("--apply-to", targets.apply_to, False))
    seen: dict[str, str] = {}
    for option, path, default in checked:
        key = os.path.abspath(path)
        if key in seen:
            raise AprError(f"{option} {path} is also {seen[key]}: each output needs its own path", [Finding(
                "error", "output.refused", f"{option} and {seen[key]} name the same file", path=option,
                file=str(path), expected="distinct output paths", got=str(path))])
        seen[key] = option
        replace = overwrite or (default and _earlier_sweep_file(path))
        if default and replace and not overwrite:
            targets.replaceable.add(path)
        check_output_file(path, inputs=inputs, overwrite=replace, option=option)
    for option, path, _ in checked:  # a read-only folder fails now, not after the sweep
        probe_writable(path, option)
    return targets


def curve_document(curve: Curve, test: RangeTest, suggestion: float) -> dict:
    """The curve's JSON (``"format": "apr-lr-find"``): the range, both rules' values and every point."""
    return {"format": "apr-lr-find", "min_lr": test.min_lr, "max_lr": test.max_lr, "steps": test.steps,
            "smoothing": test.smoothing, "rule": test.rule, "suggested_lr": suggestion,
            "min10_lr": curve.suggest("min10"), "steepest_lr": curve.suggest("steepest"),
            "stopped_early": curve.stopped_early,
            "points": [{"step": i + 1, "lr": lr, "loss": loss, "smoothed": sm}
                       for i, (lr, loss, sm) in enumerate(zip(curve.lrs, curve.losses, curve.smoothed, strict=True))]}


def _write(targets: OutputTargets, option: str, path: Path, text: str) -> None:
    write_output(path, text, inputs=targets.inputs, overwrite=targets.overwrite or path in targets.replaceable,
                 option=option)


def write_results(curve: Curve, test: RangeTest, suggestion: float, targets: OutputTargets) -> None:
    """The SVG plot and the JSON curve, through the checked writer (checked again at the write)."""
    _write(targets, "--plot", targets.plot, svg_plot(curve.lrs, curve.losses, curve.smoothed, suggestion, test.rule))
    _write(targets, "--json-out", targets.json_out, json.dumps(curve_document(curve, test, suggestion), indent=2)
           + "\n")


def apply_suggestion(config_path: Path, target: Path, lr: float, targets: OutputTargets | None = None) -> None:
    """A copy of the config file (comments and layout kept) with ``optimizer.lr`` set to ``lr``."""
    yaml = YAML()  # round trip
    doc = yaml.load(read_text(Path(config_path), "config", "config", error=AprError))
    doc.setdefault("optimizer", {})["lr"] = float(f"{lr:.3g}")
    buf = io.StringIO()
    yaml.dump(doc, buf)
    targets = targets or OutputTargets(Path(), Path(), target, [Path(config_path)], False)
    _write(targets, "--apply-to", target, buf.getvalue())
