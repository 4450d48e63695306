"""What each dashboard panel shows, as plain data derived from a state: no Textual here.

The app hands every panel a small immutable value built by these functions and the panel redraws
only when that value changed, which is what keeps the dashboard cheap over a slow SSH link.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from apr.fmt import (
    DASH,
    fmt_count,
    fmt_duration,
    fmt_gib,
    fmt_int,
    fmt_loss,
    fmt_percent,
    fmt_sci,
)
from apr.monitor.charts import Mark
from apr.monitor.state import Reading, heartbeat_age, num
from apr.severity import SEVERITIES, count_by_severity, severity_of

# Status -> (label shown in the header, style name). Text alone says it all (NO_COLOR).
STATUS_LABELS = {
    "waiting": ("… WAITING", "status.waiting"),
    "starting": ("○ STARTING", "status.starting"),
    "running": ("● RUNNING", "status.running"),
    "stale": ("▲ STALE", "status.stale"),
    "dead": ("✗ DEAD", "status.failed"),
    "finished": ("✓ FINISHED", "status.finished"),
    "failed": ("✗ FAILED", "status.failed"),
    "stopped": ("■ STOPPED", "status.stopped"),
    "unknown": ("? UNKNOWN", "status.unknown"),
}


def status_label(status: str) -> tuple[str, str]:
    return STATUS_LABELS.get(status, (f"? {status.upper()}", "status.unknown"))


@dataclass(frozen=True)
class HeaderView:
    title: str
    status: str
    paused: bool
    step: int | None
    total_steps: int | None
    epoch: float | None
    keep_end: bool = False  # a title ending in a path: shorten it from the left (the run folder stays)

    def fit_title(self, width: int) -> str:
        """The title in at most ``width`` cells, "…" marking what was cut."""
        title = self.title
        if len(title) <= width:
            return title
        if width <= 1:
            return "…"[:width]
        return "…" + title[len(title) - width + 1 :] if self.keep_end else title[: width - 1] + "…"

    @property
    def fraction(self) -> float | None:
        if self.step is None or not self.total_steps:
            return None
        return min(1.0, max(0.0, self.step / self.total_steps))

    @property
    def step_text(self) -> str:
        total = f" / {fmt_int(self.total_steps)}" if self.total_steps else ""
        return f"step {fmt_int(self.step)}{total}"


def header_view(state: dict | None, status: str, paused: bool, run_dir: str) -> HeaderView:
    if state is None:
        return HeaderView(f"apr monitor · {run_dir}", status, paused, None, None, None, keep_end=True)
    experiment = state.get("experiment") or "?"
    run_id = state.get("run_id") or "?"
    return HeaderView(
        f"{experiment} · run {run_id}",
        status,
        paused,
        state.get("step"),
        state.get("total_steps"),
        state.get("epoch"),
    )


def stats_lines(state: dict | None, show_eta: bool = True) -> tuple[tuple[str, str], ...]:
    """(label, value) rows of the run panel: throughput, budget, time, loss, last checkpoint."""
    if state is None:
        return (("", "no data yet"),)
    tokens_seen, tokens_total = num(state.get("tokens_seen")), num(state.get("tokens_total"))
    tokens = fmt_count(tokens_seen)
    if tokens_total:
        tokens += f" / {fmt_count(tokens_total)}"
        if tokens_seen is not None:
            tokens += f"  {fmt_percent(tokens_seen / tokens_total)}"
    loss = fmt_loss(state.get("loss"))
    if state.get("val_loss") is not None:
        loss += f"  val {fmt_loss(state.get('val_loss'))}"
    rows = [
        ("tok/s", fmt_int(state.get("tokens_per_s")) + (f"  MFU {fmt_percent(state['mfu'])}"
                                                        if state.get("mfu") is not None else "")),
        ("tokens", tokens),
        ("elapsed", fmt_duration(state.get("elapsed_s"))),
    ]
    if show_eta:
        eta = state.get("eta_s")
        rows.append(("ETA", fmt_duration(eta) if state.get("status") in ("starting", "running") else DASH))
    rows.append(("loss", loss))
    if state.get("cost"):  # training.price_per_gpu_hour
        rows.append(("cost", cost_text(state["cost"])))
    if state.get("evals"):  # in-training task scores (evaluation.tasks)
        rows.append(("eval", "  ".join(f"{name} {fmt_percent(s.get('acc'))}" for name, s in state["evals"].items())))
    rows.append(("ckpt", checkpoint_text(state)))
    return tuple(rows)


# A loss-chart mark per event kind: the letter in the plot's top row and its style (apr train steer, fork)
MARKED_EVENTS = {"steer": ("S", "steer"), "fork": ("F", "fork")}


def chart_marks(state: dict | None) -> tuple[Mark, ...]:
    """The loss chart's vertical marks: each steer (``S``, at the step it was applied) and a fork's
    start (``F``, at the parent's step it started from), from the state's events."""
    out = []
    for event in (state or {}).get("events") or []:
        mark = MARKED_EVENTS.get(event.get("kind"))
        if mark is not None and event.get("step") is not None:
            out.append(Mark(float(event["step"]), *mark))
    return tuple(out)


def forecast_view(state: dict | None) -> dict | None:
    """The final validation loss forecast (apr/track/forecast.py) from the state's validation
    history: ``{"step", "loss", "low", "high", ...}``, or None before 4 validations, for a curve no
    law fits, or once the run is at its last step."""
    if state is None:
        return None
    total, step, history = num(state.get("total_steps")), num(state.get("step")), state.get("val_loss_history")
    if not total or not history or len(history) < 4 or (step is not None and step >= total):
        return None
    return _forecast(tuple(history), int(total))


@lru_cache(maxsize=16)
def _forecast(history: tuple[tuple[int, float], ...], total_steps: int) -> dict | None:
    """Fitted once per validation history (each refresh asks again)."""
    from apr.track.forecast import forecast

    predicted = forecast(list(history), total_steps)
    return None if predicted is None else predicted.to_dict()


def forecast_text(ahead: dict) -> str:
    """'val forecast 2.190 ±0.040': the val loss forecast for the run's last step and its band's half
    width (the band is symmetric); the loss chart's border shows it."""
    return f"val forecast {ahead['loss']:.3f} ±{(ahead['high'] - ahead['low']) / 2:.3f}"


def cost_text(cost: dict) -> str:
    """'12.34 so far, ~40.10 at the end (2.5/GPU-hour x 8)': the live cost of a priced run."""
    out = f"{cost['spent']:,.2f} so far"
    if cost.get("projected") is not None:
        out += f", ~{cost['projected']:,.2f} at the end"
    return out + f" ({cost['price_per_gpu_hour']:,.4g}/GPU-hour x {cost['gpus']})"


def checkpoint_text(state: dict) -> str:
    """'step 12,000 @ 3h 02m': the run's elapsed time at the save, on the same clock as the
    ``elapsed`` row (never later than it, also after a resume), the same on every screen."""
    ckpt = state.get("last_checkpoint")
    if not ckpt or ckpt.get("step") is None:
        return "none yet"
    text = f"step {fmt_int(ckpt['step'])}"
    saved, elapsed, heartbeat = num(ckpt.get("time")), num(state.get("elapsed_s")), num(state.get("heartbeat"))
    if saved is not None and elapsed is not None and heartbeat is not None and saved <= heartbeat:
        at = elapsed - (heartbeat - saved)
        if at >= 0:
            text += f" @ {fmt_duration(at)}"
    return text


def gpu_lines(gpu: dict | None) -> tuple[str, float | None, tuple[str, ...]] | None:
    """(name, utilisation fraction, detail rows) of the GPU panel; None hides the panel."""
    if not gpu or all(v is None for v in gpu.values()):
        return None
    util = gpu.get("utilization")
    used, total = gpu.get("memory_used"), gpu.get("memory_total")
    vram = f"VRAM {fmt_gib(used)} / {fmt_gib(total)} GiB"
    if used is not None and total:
        vram += f"  {100 * used / total:.0f}%"
    temp = f"{gpu['temperature']:.0f}°C" if gpu.get("temperature") is not None else f"{DASH}°C"
    power = f"{gpu['power_w']:.0f} W" if gpu.get("power_w") is not None else f"{DASH} W"
    return (gpu.get("name") or "GPU", None if util is None else util / 100.0, (vram, f"{temp}  {power}"))


@dataclass(frozen=True)
class SparkView:
    """A sparkline's values, the step of each (a thinned history's steps are uneven), a caption."""

    values: tuple[float, ...]
    caption: str
    steps: tuple[float, ...] | None = None


def fit_caption(caption: str, width: int, lines: int = 1) -> str:
    """``caption`` (parts joined by two spaces: ``now 3.1  min 2.0  max 9.4``) in ``width``
    columns and at most ``lines`` lines: as is; with single spaces; wrapped between parts; else
    without its first parts, so the last (``max``) stays whole, never cut off mid-number."""
    if len(caption) <= width:
        return caption
    parts = caption.split("  ")
    if len(" ".join(parts)) <= width:
        return " ".join(parts)
    if lines > 1:
        rows: list[str] = []
        for part in parts:
            if rows and len(rows[-1]) + 2 + len(part) <= width:
                rows[-1] += "  " + part
            else:
                rows.append(part)
        if len(rows) <= lines and all(len(r) <= width for r in rows):
            return "\n".join(rows)
    while len(parts) > 1 and len(" ".join(parts)) > width:
        parts = parts[1:]
    return " ".join(parts)[:width]


def lr_view(state: dict | None) -> SparkView:
    hist = state.get("lr_history", ()) if state else ()
    values = tuple(v for _, v in hist)
    if not values:
        return SparkView((), f"now {fmt_sci(state.get('lr'))}" if state else "no data yet")
    return SparkView(values, f"{fmt_sci(values[0])} → {fmt_sci(values[-1])}  max {fmt_sci(max(values))}",
                     tuple(s for s, _ in hist))


def metric_view(state: dict | None, metric: str) -> SparkView:
    """A dashboard spark panel: the history the state keeps of ``metric`` (apr/monitor/dashboard.py)."""
    hist = state.get(f"{metric}_history", ()) if state else ()
    values = tuple(v for _, v in hist)
    if not values:
        now = state.get(metric) if state else None
        return SparkView((), f"now {fmt_sci(now)}" if now is not None else "no data yet")
    return SparkView(values, f"now {fmt_sci(values[-1])}  min {fmt_sci(min(values))}  max {fmt_sci(max(values))}",
                     tuple(s for s, _ in hist))


def grad_view(state: dict | None) -> SparkView:
    hist = state.get("grad_norm_history", ()) if state else ()
    values = tuple(v for _, v in hist)
    if not values:
        return SparkView((), f"now {fmt_sci(state.get('grad_norm'))}" if state else "no data yet")
    last = state.get("grad_norm") if state.get("grad_norm") is not None else values[-1]
    return SparkView(values, f"now {fmt_sci(last)}  max {fmt_sci(max(values))}", tuple(s for s, _ in hist))


@dataclass(frozen=True)
class BlockView:
    """The last recorded per-block norms (monitoring.block_norms): one row of bars each for the
    gradient and the update norms, block 0 (nearest the embedding) on the left."""

    step: int | None
    grads: tuple[float | None, ...]
    updates: tuple[float | None, ...]

    @staticmethod
    def peak(values: tuple[float | None, ...]) -> str:
        """'1.20e-1 #3': the largest value and its block; '!' names the first non-finite block."""
        if any(v is None for v in values):
            return f"! #{values.index(None)}"
        if not values:
            return DASH
        i = max(range(len(values)), key=values.__getitem__)
        return f"{fmt_sci(values[i])} #{i}"


def block_view(state: dict | None) -> BlockView | None:
    """None hides the panel: no state, or a run that records no per-block norms."""
    norms = state.get("block_norms") if state else None
    if not norms:
        return None
    return BlockView(norms.get("step"), tuple(norms.get("block_grad_norm") or ()),
                     tuple(norms.get("block_update_norm") or ()))


@dataclass(frozen=True)
class HistRow:
    """One layer: its weight and gradient histograms (counts over fixed bins) and their true ranges."""

    name: str
    weights: tuple[float, ...]
    grads: tuple[float, ...]
    weight_range: tuple[float | None, float | None]
    grad_range: tuple[float | None, float | None]


@dataclass(frozen=True)
class HistView:
    """The latest per-layer histograms (monitoring.histograms), layers in the model's order."""

    step: int | None
    rows: tuple[HistRow, ...]

    def shown(self, lines: int) -> tuple[HistRow, ...]:
        """At most ``lines`` layers, spread evenly from the first to the last."""
        n = len(self.rows)
        if lines >= n:
            return self.rows
        if lines <= 1:
            return self.rows[:max(lines, 0)]
        return tuple(self.rows[round(i * (n - 1) / (lines - 1))] for i in range(lines))


def _layer_order(name: str) -> tuple[int, int]:
    """embed, block.0, block.1, ..., head."""
    if name == "embed":
        return (0, 0)
    if name.startswith("block.") and name[6:].isdigit():
        return (1, int(name[6:]))
    return (2, 0)


def hist_view(state: dict | None) -> HistView | None:
    """None hides the panel: no state, or a run that records no histograms."""
    hist = state.get("histograms") if state else None
    if not hist:
        return None
    by_layer: dict[str, dict] = {}
    for h in hist["layers"]:
        by_layer.setdefault(h["name"], {})[h["kind"]] = h
    rows = tuple(HistRow(name, tuple(k.get("weight", {}).get("counts", ())), tuple(k.get("grad", {}).get("counts", ())),
                         (k.get("weight", {}).get("min"), k.get("weight", {}).get("max")),
                         (k.get("grad", {}).get("min"), k.get("grad", {}).get("max")))
                 for name, k in sorted(by_layer.items(), key=lambda item: _layer_order(item[0])))
    return HistView(hist["step"], rows)


def span_text(span: tuple[float | None, float | None]) -> str:
    """'±1.2e-2': the largest magnitude of a range."""
    finite = [abs(v) for v in span if v is not None]
    return f"±{fmt_sci(max(finite))}" if finite else DASH


@dataclass(frozen=True)
class EvalBars:
    """Task scores of the latest evaluation of each stage (or of the latest evaluations, for a run of
    one stage): groups of (label, ((task, acc), ...)), oldest first."""

    groups: tuple[tuple[str, tuple[tuple[str, float | None], ...]], ...]


def eval_bars_view(state: dict | None, groups: int = 6) -> EvalBars | None:
    """None hides the panel: no task evaluation yet."""
    history = state.get("eval_history") if state else None
    if not history:
        return None
    if any(e["stage"] for e in history):  # the last evaluation of each stage
        last: dict[str | None, dict] = {}
        for e in history:
            last.pop(e["stage"], None)
            last[e["stage"]] = e
        chosen = list(last.values())[-groups:]
    else:
        chosen = list(history)[-groups:]
    return EvalBars(tuple((f"{e['stage'] + ' ' if e['stage'] else ''}@{fmt_int(e['step'])}",
                           tuple(sorted(e["scores"].items()))) for e in chosen))


def alert_lines(alerts: list[dict]) -> list[tuple[str, str]]:
    """A count by severity (when there are several alerts: one shows its severity on its line), then
    each alert, newest first, styled by its severity; a record from before severities shows its
    action and is styled by what that meant."""
    if not alerts:
        return []
    out = []
    if len(alerts) > 1:
        counts = count_by_severity(alerts)
        worst = next(s for s in SEVERITIES if counts[s])
        out.append(("alerts: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), f"alert.{worst}"))
    for alert in reversed(alerts):
        step = f"step {fmt_int(alert['step'])} " if alert.get("step") is not None else ""
        what = alert.get("severity") or alert.get("action")
        arrow = f" → {what}" if what else ""
        text = alert.get("message") or ""
        cond = alert.get("condition") or ""
        severity = severity_of(alert.get("severity"), alert.get("action"))
        out.append((f"{step}{cond}{arrow}{': ' + text if text else ''}", f"alert.{severity}"))
    return out



# Events that report the run's course rather than a problem (data stages, stacking, distillation,
# orchestration's decisions: apr/train/orchestrator.py).
INFO_EVENTS = ("stage", "stack", "distill", "strategy", "decision", "branch", "switch", "nowcast", "steer", "fork")


def current_strategy(events: list[dict]) -> str | None:
    """An orchestrated run's strategy in force and its decisions so far, from its events."""
    decisions = sum(1 for e in events if e.get("kind") == "decision")
    for event in reversed(events):
        name = event.get("strategy")  # apr/monitor/state.py ``_events``
        if name:
            return f"strategy {name} ({decisions} decision{'s' if decisions != 1 else ''})"
    return None


def messages(
    reading: Reading | None, state: dict | None, status: str, now: float, stale_after_s: float, limit: int = 8
) -> tuple[tuple[str, str], ...]:
    """(text, style) lines, most important first: file problems, the end reason, staleness, the
    latest alerts (newest first), skipped bad steps and rollbacks (newest first), store warnings."""
    out: list[tuple[str, str]] = []
    if reading is not None and not reading.ok:
        suffix = " (showing the last good state)" if state is not None and reading.kind != "missing" else ""
        prefix = "waiting: " if reading.kind == "missing" else ""
        out.append((prefix + (reading.problem or reading.kind) + suffix, "msg.problem"))
    elif reading is not None and reading.missing_fields:
        shown = ", ".join(reading.missing_fields[:4]) + (" ..." if len(reading.missing_fields) > 4 else "")
        out.append((f"state file lacks: {shown}", "msg.warning"))
    if state is not None:
        reason = state.get("status_reason")
        if status in ("failed", "stopped", "finished") and reason:
            out.append((f"{status}: {reason}", "msg.problem" if status == "failed" else "msg.info"))
        elif status == "failed":
            out.append(("failed (no reason recorded)", "msg.problem"))
        if status == "dead":
            out.append((f"the trainer (pid {state.get('pid')} on this host) is gone without recording an end: "
                        "killed (SIGKILL, out of memory)? Resume with apr train apply --resume latest",
                        "msg.problem"))
        if status == "stale":
            age = heartbeat_age(state, now)
            out.append(
                (
                    f"no heartbeat for {fmt_duration(age)} (stale after {fmt_duration(stale_after_s)}): "
                    "the trainer may have died",
                    "msg.warning",
                )
            )
        out += alert_lines(state.get("alerts") or [])
        drift = state.get("drift")
        if drift and drift.get("tokens_per_s") is not None:
            planned = drift.get("planned_tokens_per_s")
            shown = ", ".join(f"{k.removeprefix('drift_')} {drift[k]:+.0%}" for k in
                              ("drift_step_time", "drift_tokens_per_s", "drift_memory") if drift.get(k) is not None)
            out.append((f"plan vs actual at step {fmt_int(drift['step'])}: {drift['tokens_per_s']:,.0f} tokens/s"
                        + (f" against {planned:,.0f} planned" if planned else f" ({drift.get('planned_from')})")
                        + (f"; {shown}" if shown else ""), "msg.info"))
        mixture = state.get("mixture")
        if mixture and mixture.get("sources"):
            parts = [f"{name} {fmt_int(f['tokens'])} tok ({f['epochs']:.2f} ep)"
                     + (f" val {f['val_loss']:.3f}" if f.get("val_loss") is not None else "")
                     for name, f in mixture["sources"].items() if f.get("tokens") is not None]
            out.append((f"data stage {mixture.get('stage_name') or mixture.get('stage')}: " + ", ".join(parts),
                        "msg.info"))
        events = state.get("events") or []
        skipped = sum(1 for e in events if e.get("kind") == "bad_step")
        rollbacks = sum(1 for e in events if e.get("kind") == "rollback")
        if skipped or rollbacks:
            out.append((f"{skipped} bad steps skipped, {rollbacks} rollbacks (apr runs ledger lists the rows)",
                        "msg.warning"))
        strategy = current_strategy(events)
        if strategy is not None:
            out.append((strategy, "msg.info"))
        for event in reversed(events):
            step = f"step {fmt_int(event['step'])} " if event.get("step") is not None else ""
            rows = f" [{event['rows']} rows]" if event.get("rows") else ""
            out.append((f"{step}{event.get('message') or event.get('kind') or ''}{rows}",
                        "msg.info" if event.get("kind") in INFO_EVENTS else "msg.alert"))
        for warning in state.get("store_warnings") or []:
            out.append((f"store: {warning}", "msg.warning"))
    if not out:
        out.append(("no alerts", "msg.none"))
    return tuple(out[:limit])
