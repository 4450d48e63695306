"""The sweep file: W&B's sweep format (what DantinoX users already have) read into a ``SweepSpec``.

Every problem is a ``SweepError`` listing findings with the sweep file, the key path and the line
(read through apr/config/yamlfile.py like a config). Parameter names are apr config key paths; a
DantinoX flat name that maps to one apr key is accepted with a warning naming that key. Nothing
here imports Optuna or torch: docs/sweeps.md is the user's page.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apr.config.loader import did_you_mean, schema_key_paths
from apr.config.yamlfile import SourceMap, read_yaml
from apr.errors import AprError, Finding
from apr.quoting import describe, is_name, key_path, key_text, of_kind, quote_key, what_it_holds


class SweepError(AprError):
    """A sweep file, a sweep storage or a sweep command line that cannot be used (exit 1)."""


# Top-level keys. W&B's own keys first; the apr additions say where the trials come from and go.
TOP_KEYS = ("method", "metric", "parameters", "early_terminate", "run_cap", "name", "description",
            "config", "seed", "output_dir")
# W&B keys that name its agent's program and project: nothing for apr to do, so a warning, not an error.
WANDB_ONLY = ("program", "command", "project", "entity")
METHODS = ("grid", "random", "bayes")
GOALS = ("minimize", "maximize")
# Metrics a run records in training_state.json (docs/training-state.md), by the name a sweep uses.
METRICS = {"val_loss": "val_loss", "loss": "loss", "val_ppl": "val_ppl"}
METRIC_ALIASES = {"train_loss": "loss", "val_perplexity": "val_ppl"}  # DantinoX / habit -> apr
DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "uniform", "q_uniform", "log_uniform",
                 "log_uniform_values", "q_log_uniform", "q_log_uniform_values")
# W&B distributions Optuna has no sampler for: refused by name rather than approximated.
UNSUPPORTED = ("normal", "q_normal", "log_normal", "q_log_normal", "inv_log_uniform", "inv_log_uniform_values",
               "beta", "q_beta")
PARAM_KEYS = ("value", "values", "distribution", "min", "max", "q")
EARLY_KEYS = ("type", "min_iter", "max_iter", "eta", "s", "strict")
PRUNERS = ("hyperband", "median", "forecast")
# DantinoX's flat config names (shared/reference/dantinox-training-and-sweeps.txt) -> apr key paths.
DANTINOX_NAMES = {
    "lr": "optimizer.lr", "learning_rate": "optimizer.lr", "weight_decay": "optimizer.weight_decay",
    "optimizer": "optimizer.name", "batch_size": "data.batch_size", "grad_accum": "training.gradient_accumulation",
    "warmup_steps": "training.warmup_steps", "dim": "model.architecture.hidden_size",
    "num_blocks": "model.architecture.num_hidden_layers", "n_heads": "model.architecture.num_attention_heads",
    "grad_clip": "training.grad_clip", "lr_schedule": "training.lr_scheduler", "max_steps": "training.max_steps",
    "seq_len": "data.seq_len", "context_len": "data.seq_len",
}
# Keys the sweep sets on every trial itself: a parameter may not set them.
RESERVED = ("training.output_dir", "monitoring.tracking.experiment")
GRID_LIMIT = 100_000  # points; a grid larger than this is a mistake, not a sweep
MAX_Q_STEPS = 2**52  # a q_ distribution's bounds / q: past it, round(x / q) * q is no longer exact in a float
MAX_TRIALS = 1_000_000  # run_cap and --count: a sweep of more trials is a mistake (each trial is a run)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class Param:
    """One searched config key. ``kind`` is a distribution of DISTRIBUTIONS; ``values`` holds the
    choices (categorical, constant); ``low``/``high`` the range as values (log_uniform's exponents
    already turned into values)."""

    key: str  # the apr config key path
    kind: str
    values: tuple = ()
    low: float | int | None = None
    high: float | int | None = None
    q: float | None = None
    name: str = ""  # as written in the sweep file (a DantinoX name, or the key)
    line: int | None = None

    @property
    def log(self) -> bool:
        return "log" in self.kind

    @property
    def is_int(self) -> bool:
        return self.kind == "int_uniform"


@dataclass(frozen=True)
class EarlyTerminate:
    """``early_terminate``: prune by W&B iterations, which apr counts as evaluations of the metric."""

    type: str
    min_iter: int = 1
    max_iter: int | None = None
    eta: int = 3


@dataclass
class SweepSpec:
    path: Path
    method: str
    metric: str  # a key of METRICS
    goal: str
    params: list[Param]
    name: str
    config: Path | None = None  # the base config, relative paths resolved against the sweep file
    run_cap: int | None = None
    seed: int = 0
    output_dir: str | None = None
    early_terminate: EarlyTerminate | None = None
    description: str | None = None
    source: SourceMap | None = None
    warnings: list[Finding] = field(default_factory=list)
    text: str = ""

    @property
    def direction(self) -> str:
        return self.goal

    def fingerprint(self) -> str:
        """What makes two runs of the command the same sweep (method, metric, space, pruning, seed):
        a storage holding this sweep under another fingerprint is refused, never mixed."""
        doc = {"method": self.method, "metric": self.metric, "goal": self.goal, "seed": self.seed,
               "params": [[p.key, p.kind, list(p.values), p.low, p.high, p.q] for p in self.params],
               "early_terminate": None if self.early_terminate is None else vars(self.early_terminate)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def where(self, *loc) -> tuple[str, int | None, int | None]:
        return self.source.where(tuple(loc)) if self.source else (str(self.path), None, None)


class _Collector:
    """Findings gathered over the whole file, so one run of the command names every problem."""

    def __init__(self, path: Path, source: SourceMap):
        self.path, self.source = path, source
        self.errors: list[Finding] = []
        self.warnings: list[Finding] = []

    def add(self, loc: tuple, code: str, message: str, expected: str | None = None, got: Any = None,
            severity: str = "error") -> None:
        file, line, column = self.source.where(loc)
        finding = Finding(severity, code, message, path=key_path(loc), file=file, line=line,
                          column=column, expected=expected, got=None if got is None else _short(got))
        (self.errors if severity == "error" else self.warnings).append(finding)


def _short(value: Any) -> str:
    return describe(value)  # the one rule of what an error may quote (apr/quoting.py)


def _close(word: str, choices) -> str:
    if not is_name(word):
        return ""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_sweep(path: str | Path, config: str | Path | None = None) -> SweepSpec:
    """Read and check a sweep file. ``config``: the base config from the command line (it wins over
    the file's ``config:`` key). Raises SweepError listing every problem, each with its line."""
    path = Path(path)
    data, source, text = read_yaml(path, kind="config", what="sweep file")
    c = _Collector(path, source)
    if not of_kind(data, (*TOP_KEYS, *WANDB_ONLY)):
        # not a sweep file at all: refused whole, saying what it holds in words, never its lines
        c.add((), "sweep.type", "a sweep file is a mapping (method:, metric:, parameters:)", "a mapping with "
              "method, parameters", what_it_holds(data))
        raise SweepError(f"{path}: not a sweep file", c.errors)
    for key in data:
        if key in WANDB_ONLY:
            c.add((key,), "sweep.ignored_key", f"'{key}' names W&B's agent program; apr runs `apr train apply` "
                  "on the base config instead, so it is ignored", severity="warning")
        elif key not in TOP_KEYS:
            c.add((key,), "sweep.unknown_key", f"unknown key {quote_key(key)}{_close(key, TOP_KEYS)}",
                  "one of: " + ", ".join(TOP_KEYS), key_text(key))
    method = _choice(c, data, "method", METHODS, required=True)
    metric, goal = _metric(c, data.get("metric"))
    params = _parameters(c, data.get("parameters"))
    if method == "grid":
        _check_grid(c, params)
    spec = SweepSpec(path=path, method=method or "random", metric=metric, goal=goal, params=params,
                     name=_name(c, data, path), source=source, text=text,
                     config=_base_config(c, data, path, config), run_cap=_count(c, data, "run_cap"),
                     seed=_seed(c, data), output_dir=_str(c, data, "output_dir"),
                     early_terminate=_early(c, data.get("early_terminate")),
                     description=_str(c, data, "description"))
    if spec.early_terminate is not None and spec.early_terminate.type == "forecast" and goal != "minimize":
        c.add(("early_terminate", "type"), "sweep.bad_value", "type: forecast forecasts a falling loss curve: "
              "it needs metric.goal minimize", "metric.goal: minimize", goal)
    if c.errors:
        n = len(c.errors)
        raise SweepError(f"{path}: {n} error{'s' if n != 1 else ''} in the sweep file",
                         sorted(c.errors, key=lambda f: (f.line or 0, f.column or 0)))
    spec.warnings = c.warnings
    return spec


def _choice(c: _Collector, data: dict, key: str, choices: tuple, required: bool = False, loc: tuple = ()) -> str | None:
    value = data.get(key)
    if value is None:
        if required:
            c.add((*loc, key) if key in data else loc, "sweep.missing", f"'{'.'.join((*loc, key))}' is required",
                  "one of: " + ", ".join(choices), "nothing")
        return None
    if value not in choices:
        c.add((*loc, key), "sweep.bad_value", f"{key} must be one of {', '.join(choices)}{_close(value, choices)}",
              "one of: " + ", ".join(choices), value)
        return None
    return value


def _metric(c: _Collector, metric: Any) -> tuple[str, str]:
    if metric is None:
        return "val_loss", "minimize"  # W&B without a metric cannot optimise; apr's runs all record val_loss
    if not isinstance(metric, dict):
        c.add(("metric",), "sweep.type", "metric is a mapping {name, goal}", "a mapping", metric)
        return "val_loss", "minimize"
    for key in metric:
        if key not in ("name", "goal", "target"):
            c.add(("metric", key), "sweep.unknown_key",
                  f"unknown key {quote_key(key)}{_close(key, ('name', 'goal'))}", "name, goal", key_text(key))
    goal = _choice(c, metric, "goal", GOALS, loc=("metric",)) or "minimize"
    name = metric.get("name")
    if name in METRIC_ALIASES:
        c.add(("metric", "name"), "sweep.renamed", f"metric '{name}' is apr's '{METRIC_ALIASES[name]}'",
              severity="warning")
        name = METRIC_ALIASES[name]
    if name not in METRICS:
        known = [*METRICS, *METRIC_ALIASES]
        c.add(("metric", "name"), "sweep.unknown_metric",
              f"unknown metric {_short(name)}{_close(name, known)}; a run records " + ", ".join(METRICS),
              "one of: " + ", ".join(METRICS), name)
        return "val_loss", goal
    return name, goal


def parameter_key(name: str) -> tuple[str | None, str | None]:
    """(the apr config key path for a sweep parameter name, a note when it was a DantinoX name)."""
    paths = {".".join(p) for p in schema_key_paths()}
    if name in paths and (name not in DANTINOX_NAMES or name not in _sections()):
        return name, None
    if name in DANTINOX_NAMES:
        return DANTINOX_NAMES[name], f"'{name}' is DantinoX's name for apr's '{DANTINOX_NAMES[name]}'"
    leaves = [p for p in paths if p.rsplit(".", 1)[-1] == name]
    if "." not in name and len(leaves) == 1:  # a flat name only one apr key ends with
        return leaves[0], f"'{name}' is taken as apr's '{leaves[0]}'"
    return None, None


def _unknown_parameter(name: str) -> str:
    """The config's did-you-mean (apr/config/loader.py), always naming the whole key path."""
    paths = [".".join(p) for p in schema_key_paths()]
    hint = _close(name, paths)
    if not hint and "." in name:
        section, _, leaf = name.rpartition(".")
        hint = did_you_mean(tuple(name.split(".")))
        close = re.fullmatch(r"; did you mean '([^'.]+)'\?", hint)
        if close:  # a close name in the same section: say its whole path
            hint = f"; did you mean '{section}.{close[1]}'?"
    if not is_name(name):
        return f"{quote_key(name)} is not an apr config key"
    return f"'{name}' is not an apr config key{hint or _close(name, DANTINOX_NAMES)}"


def _sections() -> set[str]:
    paths = schema_key_paths()
    return {".".join(p[:i]) for p in paths for i in range(1, len(p))}


def _parameters(c: _Collector, params: Any) -> list[Param]:
    if not isinstance(params, dict) or not params:
        c.add(("parameters",), "sweep.missing" if params is None else "sweep.type",
              "parameters must map apr config keys to their values or distributions",
              "a mapping such as {optimizer.lr: {min: 1e-4, max: 1e-2}}", params if params is not None else "nothing")
        return []
    out, seen, sections = [], {}, _sections()
    for name, body in params.items():
        loc = ("parameters", name)
        key, note = parameter_key(str(name))
        if key is None:
            c.add(loc, "sweep.unknown_parameter", _unknown_parameter(str(name)), "an apr config key path",
                  key_text(name))
            continue
        if key in sections:
            c.add(loc, "sweep.section", f"'{key}' is a section; a parameter sets one value", "a key inside it", key)
            continue
        if key in RESERVED:
            c.add(loc, "sweep.reserved", f"'{key}' is set by the sweep on every trial", "another key", key)
            continue
        if key in seen:
            c.add(loc, "sweep.duplicate", f"'{name}' sets {key}, already set by '{seen[key]}'", "one of the two", name)
            continue
        seen[key] = name
        if note:
            c.add(loc, "sweep.renamed", note, severity="warning")
        param = _param(c, loc, key, str(name), body)
        if param is not None:
            out.append(param)
    return out


def _param(c: _Collector, loc: tuple, key: str, name: str, body: Any) -> Param | None:
    line = c.source.where(loc)[1]
    if not isinstance(body, dict):
        c.add(loc, "sweep.type", f"parameter '{name}' is a mapping with value, values or min/max",
              "{values: [...]} or {min: A, max: B}", body)
        return None
    bad = [k for k in body if k not in PARAM_KEYS]
    for k in bad:
        message = (f"'{k}' is not supported (Optuna samples each value with equal weight)" if k == "probabilities"
                   else f"unknown key {quote_key(k)}{_close(k, PARAM_KEYS)}")
        c.add((*loc, k), "sweep.unknown_key", message, "one of: " + ", ".join(PARAM_KEYS), key_text(k))
    if bad:
        return None
    dist = body.get("distribution")
    if dist in UNSUPPORTED:
        c.add((*loc, "distribution"), "sweep.unsupported", f"distribution {dist} has no Optuna sampler",
              "one of: " + ", ".join(DISTRIBUTIONS), dist)
        return None
    if dist is not None and dist not in DISTRIBUTIONS:
        c.add((*loc, "distribution"), "sweep.bad_value",
              f"unknown distribution {_short(dist)}{_close(dist, DISTRIBUTIONS)}",
              "one of: " + ", ".join(DISTRIBUTIONS), dist)
        return None
    if "value" in body:
        return Param(key, "constant", (body["value"],), name=name, line=line) if _scalars(c, loc, "value",
                                                                                            [body["value"]]) else None
    if "values" in body:
        values = body["values"]
        if not isinstance(values, list) or not values:
            c.add((*loc, "values"), "sweep.type", "values is a non-empty list", "a list", values)
            return None
        return Param(key, "categorical", tuple(values), name=name, line=line) if _scalars(
            c, loc, "values", values) else None
    return _range(c, loc, key, name, body, dist, line)


def _scalars(c: _Collector, loc: tuple, key: str, values: list) -> bool:
    for i, v in enumerate(values):
        if not (v is None or isinstance(v, (str, bool, int)) or _is_number(v)):
            c.add((*loc, key, i) if key == "values" else (*loc, key), "sweep.type",
                  "a sweep value is a number, a string, a boolean or null", "a scalar", v)
            return False
    return True


def _range(c: _Collector, loc: tuple, key: str, name: str, body: dict, dist: str | None,
           line: int | None) -> Param | None:
    lo, hi, q = body.get("min"), body.get("max"), body.get("q")
    if lo is None or hi is None:
        c.add(loc, "sweep.missing", f"parameter '{name}' needs value, values, or min and max",
              "values: [...] or min/max", "nothing")
        return None
    for k, v in (("min", lo), ("max", hi), ("q", q)):
        if v is not None and not _is_number(v):
            c.add((*loc, k), "sweep.type", f"{k} must be a finite number", "a number", v)
            return None
    if dist is None:  # W&B: int_uniform when both bounds are integers, else uniform
        dist = "int_uniform" if isinstance(lo, int) and isinstance(hi, int) else "uniform"
    if dist in ("constant", "categorical"):
        c.add((*loc, "distribution"), "sweep.bad_value", f"{dist} takes value/values, not min and max",
              "a range distribution", dist)
        return None
    if lo > hi:
        c.add((*loc, "min"), "sweep.bad_range", f"min {lo} is above max {hi}", f"min <= {hi}", lo)
        return None
    if dist == "int_uniform" and not (isinstance(lo, int) and isinstance(hi, int)):
        c.add((*loc, "min"), "sweep.type", "int_uniform needs integer min and max", "integers", [lo, hi])
        return None
    if dist.startswith("q_") and (q is None or q <= 0):
        c.add((*loc, "q"), "sweep.bad_range", f"{dist} needs a step q above zero", "q > 0", q)
        return None
    if dist in ("log_uniform_values", "q_log_uniform_values") and lo <= 0:
        c.add((*loc, "min"), "sweep.bad_range", f"{dist} takes the log of min and max: min must be above zero",
              "min > 0", lo)
        return None
    if dist in ("log_uniform", "q_log_uniform"):  # W&B: min and max are natural logs of the bounds
        if max(abs(lo), abs(hi)) > 700:
            c.add((*loc, "max"), "sweep.bad_range", f"{dist} takes exponents: e**{hi} overflows", "|exponent| <= 700",
                  hi)
            return None
        lo, hi = math.exp(lo), math.exp(hi)
    if dist.startswith("q_"):  # a draw is round(x / q) * q: a step below the bounds' float precision means nothing
        try:
            steps = max(abs(lo), abs(hi)) / q
        except OverflowError:
            steps = math.inf
        if not steps <= MAX_Q_STEPS:
            least = max(abs(lo), abs(hi)) / MAX_Q_STEPS
            c.add((*loc, "q"), "sweep.bad_range", f"q {q:g} is finer than a float can tell apart between {lo:g} and "
                  f"{hi:g}", f"q >= {least:.3g}" if math.isfinite(least) else "a smaller range", q)
            return None
    return Param(key, dist, (), lo, hi, q, name=name, line=line)


def grid_count(param: Param) -> float | None:
    """How many points a grid visits for ``param``, counted without listing them (``q_uniform`` with a
    tiny ``q`` has more points than memory holds); None for a continuous range; inf past any bound."""
    if param.kind in ("constant", "categorical"):
        return len(param.values)
    if param.kind == "int_uniform":
        return int(param.high) - int(param.low) + 1
    if param.kind == "q_uniform":
        try:
            span = (param.high - param.low) / param.q
        except (OverflowError, ZeroDivisionError):
            return math.inf
        return math.floor(span + 1e-9) + 1 if math.isfinite(span) else math.inf
    return None


def grid_values(param: Param) -> list | None:
    """The points a grid visits for ``param``; None for a continuous range (a grid cannot list it).
    Call it only after ``grid_count`` (load_sweep's grid check) bounded the count."""
    if param.kind in ("constant", "categorical"):
        return list(param.values)
    if param.kind == "int_uniform":
        return list(range(int(param.low), int(param.high) + 1))
    if param.kind == "q_uniform":
        n = int(math.floor((param.high - param.low) / param.q + 1e-9))
        return [_round_q(param.low + i * param.q, param.q) for i in range(n + 1)]
    return None


def quantize(param: Param, value: float) -> float | int:
    """A drawn value of a ``q_`` distribution as W&B gives it: ``round(value / q) * q`` (at least
    ``q`` on a log scale), a whole number when ``q`` is one (an integer key takes it), else a float
    without the step arithmetic's noise (0.95, not 0.9500000000000001). Other kinds: unchanged."""
    if param.q is None or not param.kind.startswith("q_"):
        return value
    out = _round_q(value, param.q)
    return _round_q(param.q, param.q) if param.log and out < param.q else out


def _round_q(value: float, q: float) -> float | int:
    out = round(value / q) * q
    return int(out) if float(q).is_integer() and float(out).is_integer() else round(out, 12)


def _check_grid(c: _Collector, params: list[Param]) -> None:
    size: float = 1
    for p in params:
        count = grid_count(p)
        if count is None:
            c.add(("parameters", p.name), "sweep.grid_continuous",
                  f"method grid cannot list the {p.kind} range of '{p.name}'",
                  "values, value, int_uniform or q_uniform", p.kind)
            continue
        if count > GRID_LIMIT:  # one range alone: named at its key, before anything is listed
            c.add(("parameters", p.name), "sweep.grid_too_large",
                  f"'{p.name}' alone has {_points(count)} grid points", f"at most {GRID_LIMIT:,} in the whole grid",
                  _points(count))
            return
        size *= max(count, 1)
    if size > GRID_LIMIT:
        c.add(("method",), "sweep.grid_too_large", f"the grid has {_points(size)} points", f"at most {GRID_LIMIT:,}",
              _points(size))


def _points(count: float) -> str:
    return f"{int(count):,}" if math.isfinite(count) and count < 10**15 else "more than 10**15"


def _name(c: _Collector, data: dict, path: Path) -> str:
    name = data.get("name")
    if name is None:
        name = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip("-._") or "sweep"
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        c.add(("name",), "sweep.bad_name", "the sweep's name (also its experiment) is 1-128 characters of "
              "A-Z a-z 0-9 . _ -, starting with a letter or digit", "a name such as lr-sweep", name)
        return "sweep"
    return name


def _base_config(c: _Collector, data: dict, path: Path, given: str | Path | None) -> Path | None:
    if given is not None:
        return Path(given)
    value = data.get("config")
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        c.add(("config",), "sweep.type", "config names the base config file", "a path", value)
        return None
    base = Path(value).expanduser()
    return base if base.is_absolute() else path.parent / base


def _count(c: _Collector, data: dict, key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TRIALS:
        c.add((key,), "sweep.bad_value", f"{key} is a number of trials, from 1 to {MAX_TRIALS:,}",
              f"an integer from 1 to {MAX_TRIALS:,}", value)
        return None
    return value


def check_count(count: int | None) -> int | None:
    """``--count``: like ``run_cap``, 1 to MAX_TRIALS trials."""
    if count is not None and not 1 <= count <= MAX_TRIALS:
        message = f"--count is a number of trials, from 1 to {MAX_TRIALS:,}"
        raise SweepError(message, [Finding("error", "sweep.bad_value", message, path="--count",
                                           expected=f"an integer from 1 to {MAX_TRIALS:,}", got=describe(count))])
    return count


def _seed(c: _Collector, data: dict) -> int:
    value = data.get("seed", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        c.add(("seed",), "sweep.bad_value", "seed is an integer from 0 to 2**32 - 1", "an integer", value)
        return 0
    return value


def _str(c: _Collector, data: dict, key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        c.add((key,), "sweep.type", f"{key} is a string", "a string", value)
        return None
    return value


def _early(c: _Collector, body: Any) -> EarlyTerminate | None:
    if body is None:
        return None
    loc = ("early_terminate",)
    if not isinstance(body, dict):
        c.add(loc, "sweep.type", "early_terminate is a mapping {type, min_iter, eta}", "a mapping", body)
        return None
    for key in body:
        if key not in EARLY_KEYS:
            c.add((*loc, key), "sweep.unknown_key", f"unknown key {quote_key(key)}{_close(key, EARLY_KEYS)}",
                  "one of: " + ", ".join(EARLY_KEYS), key_text(key))
    kind = _choice(c, body, "type", PRUNERS, required=True, loc=loc)
    values = {}
    for key, least in (("min_iter", 1), ("max_iter", 1), ("eta", 2)):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            c.add((*loc, key), "sweep.bad_value", f"{key} is an integer of at least {least}",
                  f"an integer >= {least}", v)
        elif v is not None:
            values[key] = v
    if values.get("max_iter") is not None and values.get("min_iter", 1) > values["max_iter"]:
        c.add((*loc, "min_iter"), "sweep.bad_range", f"min_iter {values['min_iter']} is above max_iter "
              f"{values['max_iter']}", f"min_iter <= {values['max_iter']}", values["min_iter"])
    if "s" in body or "strict" in body:
        c.add(loc, "sweep.ignored_key", "'s' and 'strict' are W&B's bracket settings; Optuna's Hyperband sets "
              "its brackets from min_iter, max_iter and eta", severity="warning")
    return EarlyTerminate(kind, **values) if kind else None
