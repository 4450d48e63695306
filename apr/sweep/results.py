"""What a sweep leaves for people and programs: the trials' table (`apr sweep status`), the best
trial and its config (`apr sweep best`, ``best.yaml``), Optuna's parameter importances
(``importance.json``) and a plot of the metric against each parameter (``metric_vs_params.svg``).
"""

from __future__ import annotations

import fcntl
import html
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

from apr.config import load_config
from apr.plan.examples import to_yaml
from apr.sweep.folder import REPORT_FILES, write_report
from apr.sweep.planning import trial_dir
from apr.sweep.spec import Param, SweepSpec

STATUS_FORMAT = "apr-sweep-status"


def _lock_held(path: Path) -> bool | None:
    """Whether a process holds ``path``'s flock (None when there is no such file here)."""
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def trial_state(frozen, folder: Path, retried: bool = False) -> str:
    """finished, pruned, invalid (its plan had errors: never trained), failed, retried (failed for a
    stale heartbeat: its worker died; a later trial resumes it), running, waiting (a queued retry),
    or interrupted (RUNNING in storage, but no worker holds it: the next `apr sweep run` resumes it)."""
    name = frozen.state.name
    if name == "COMPLETE":
        return "finished"
    if name == "PRUNED":
        return "pruned"
    if name == "FAIL":
        return "invalid" if frozen.user_attrs.get("findings") else "retried" if retried else "failed"
    if name == "RUNNING":
        held = _lock_held(trial_dir(folder, frozen.number).with_suffix(".lock"))
        return "interrupted" if held is False else "running"
    return name.lower()


def trial_rows(study, spec: SweepSpec, folder: Path) -> list[dict]:
    keys = [p.key for p in spec.params]
    rows = []
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus")]
    retried_by = {t.user_attrs["retry_of"]: t.number for t in trials if t.user_attrs.get("retry_of") is not None}
    for t in trials:
        settings = t.user_attrs.get("settings") or {}
        retry = retried_by.get(t.number)
        reason = t.user_attrs.get("reason")
        if retry is not None and t.state.name == "FAIL":
            reason = (f"its worker ({t.user_attrs.get('worker', '?')}) sent no heartbeat for the grace period; "
                      f"retried as trial {retry}")
        rows.append({
            "number": t.number, "state": trial_state(t, folder, retry is not None), "value": t.value,
            "params": {k: settings.get(k, t.params.get(k)) for k in keys},
            "reason": reason, "findings": t.user_attrs.get("findings") or [],
            "retry_of": t.user_attrs.get("retry_of"),
            "run_id": t.user_attrs.get("run_id"), "run_dir": t.user_attrs.get("run_dir"),
            "resumes": t.user_attrs.get("resumes", 0), "plan": t.user_attrs.get("plan"),
            "last_evaluation": max(t.intermediate_values) if t.intermediate_values else None,
            "seconds": (t.datetime_complete - t.datetime_start).total_seconds()
            if t.datetime_complete and t.datetime_start else None,
        })
    return rows


def best_row(rows: list[dict], spec: SweepSpec) -> dict | None:
    done = [r for r in rows if r["state"] == "finished" and r["value"] is not None]
    if not done:
        return None
    sign = 1 if spec.goal == "minimize" else -1
    return min(done, key=lambda r: (sign * r["value"], r["number"]))  # ties: the earlier trial


def status_doc(study, spec: SweepSpec, folder: Path, url: str, budget: int | None = None) -> dict:
    rows = trial_rows(study, spec, folder)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    best = best_row(rows, spec)
    return {"format": STATUS_FORMAT, "format_version": "1", "sweep": spec.name, "method": spec.method,
            "metric": spec.metric, "goal": spec.goal, "storage": url, "folder": str(folder), "budget": budget,
            "counts": counts, "best": best, "trials": rows,
            "files": {k: str(folder / v) for k, v in REPORT_FILES.items() if (folder / v).exists()}}




def write_best_config(spec: SweepSpec, base: Path, best: dict, folder: Path) -> Path:
    """``best.yaml``: the base config (its bases merged in) with the best trial's parameters and a
    fresh output folder. `apr train apply best.yaml`, run from the same folder as the sweep, trains
    the best trial again, bitwise on the same device."""
    settings = {**best["params"], "training.output_dir": str(folder / "best-run"),
                "monitoring.tracking.experiment": spec.name}
    loaded = load_config(base, settings)
    path = folder / REPORT_FILES["best_config"]
    return write_report(path, f"# the best trial ({best['number']}, {spec.metric} {best['value']!r}) of sweep "
                              f"{spec.name}, on {base}\n" + to_yaml(loaded.raw), spec)


def importances(study) -> dict[str, float] | None:
    """Optuna's fANOVA importances over the finished trials; None with fewer than two, or nothing varied."""
    import optuna

    finished = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(finished) < 2:
        return None
    try:
        with warnings.catch_warnings():  # Optuna warns about degenerate splits of a few trials: not the user's to fix
            warnings.simplefilter("ignore")
            found = optuna.importance.get_param_importances(study)
        return {k: float(v) for k, v in found.items()}
    except (ValueError, RuntimeError):  # a single distinct value of every parameter, and the like
        return None


def write_reports(study, spec: SweepSpec, base: Path, folder: Path) -> dict[str, Path]:
    rows = trial_rows(study, spec, folder)
    written = {}
    best = best_row(rows, spec)
    if best is not None:
        written["best_config"] = write_best_config(spec, base, best, folder)
    found = importances(study)
    if found is not None:
        path = folder / REPORT_FILES["importance"]
        doc = {"sweep": spec.name, "metric": spec.metric, "evaluator": "fanova", "importances": found}
        written["importance"] = write_report(path, json.dumps(doc, indent=2, allow_nan=False) + "\n", spec)
    if any(r["state"] == "finished" for r in rows):
        written["plot"] = write_report(folder / REPORT_FILES["plot"], metric_svg(rows, spec), spec)
    return written


# ------------------------------------------------------------------------------------ the plot
PANEL_W, PANEL_H, PAD = 300, 220, 44


def _axis(values: list, param: Param) -> tuple[Any, list[tuple[float, str]]]:
    """A mapping value -> [0, 1] and its tick labels: categories evenly, log ranges on a log scale."""
    if param.kind in ("constant", "categorical") or not all(isinstance(v, (int, float)) for v in values):
        cats = list(dict.fromkeys([*param.values, *values])) if param.values else list(dict.fromkeys(values))
        n = max(len(cats) - 1, 1)
        where = {json.dumps(c): (i / n if len(cats) > 1 else 0.5) for i, c in enumerate(cats)}
        return (lambda v: where.get(json.dumps(v), 0.5)), [(where[json.dumps(c)], str(c)) for c in cats]
    lo, hi = float(param.low if param.low is not None else min(values)), float(
        param.high if param.high is not None else max(values))
    if param.log and lo > 0:
        lo, hi = math.log10(lo), math.log10(hi)

        def scale(v):
            return (math.log10(v) - lo) / ((hi - lo) or 1)

        return scale, [(0.0, f"{10 ** lo:.3g}"), (1.0, f"{10 ** hi:.3g}")]
    return (lambda v: (v - lo) / ((hi - lo) or 1)), [(0.0, f"{lo:.4g}"), (1.0, f"{hi:.4g}")]


def metric_svg(rows: list[dict], spec: SweepSpec) -> str:
    """One scatter panel per parameter: the finished trials' metric against the parameter's value."""
    done = [r for r in rows if r["state"] == "finished" and r["value"] is not None]
    ys = [r["value"] for r in done] or [0.0]
    y_lo, y_hi = min(ys), max(ys)
    width, height = PANEL_W * max(len(spec.params), 1), PANEL_H + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="8" y="16" font-size="13">sweep {html.escape(spec.name)}: {spec.metric} ({spec.goal}) '
           f'of {len(done)} finished trial(s)</text>']
    for i, p in enumerate(spec.params):
        x0, y0 = i * PANEL_W + PAD, 30
        w, h = PANEL_W - PAD - 12, PANEL_H - PAD - 10
        values = [r["params"].get(p.key) for r in done]
        scale, ticks = _axis([v for v in values if v is not None], p)
        out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 34}" text-anchor="middle">{html.escape(p.key)}</text>')
        for at, label in ticks:
            out.append(f'<text x="{x0 + at * w:.1f}" y="{y0 + h + 14}" text-anchor="middle">'
                       f'{html.escape(label)}</text>')
        out.append(f'<text x="{x0 - 4}" y="{y0 + 10}" text-anchor="end">{y_hi:.4g}</text>'
                   f'<text x="{x0 - 4}" y="{y0 + h}" text-anchor="end">{y_lo:.4g}</text>')
        for r, v in zip(done, values, strict=True):
            if v is None:
                continue
            cx = x0 + min(max(scale(v), 0.0), 1.0) * w
            cy = y0 + h - ((r["value"] - y_lo) / ((y_hi - y_lo) or 1)) * h
            out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="4" fill="#1f77b4" fill-opacity="0.75">'
                       f'<title>trial {r["number"]}: {html.escape(str(v))} -> {r["value"]:.6g}</title></circle>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
