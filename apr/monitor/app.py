"""The live dashboard: a Textual app over one run's `training_state.json`.

Every refresh period the app `stat`s the state file; only when the file changed does it parse it
and hand each panel its new value, and a panel redraws only when its value differs from the last
one. Time enters through one injected ``clock`` (staleness), never through the render of a
recorded state, so snapshots of a fixture are identical on every machine and every day.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.screen import ModalScreen, Screen
from textual.widget import Widget
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from apr.fmt import fmt_duration, fmt_epoch, fmt_percent
from apr.monitor.charts import Series, bar, ema, level_bars, line_chart, sparkline
from apr.monitor.dashboard import Cell, Dashboard, PanelSpec, default_dashboard
from apr.monitor.discover import ActiveRun
from apr.monitor.settings import MonitorSettings, load_settings
from apr.monitor.state import StateReader, effective_status, stale_threshold
from apr.monitor.view import (
    BlockView,
    EvalBars,
    HeaderView,
    HistView,
    SparkView,
    block_view,
    chart_marks,
    eval_bars_view,
    fit_caption,
    forecast_text,
    forecast_view,
    gpu_lines,
    grad_view,
    header_view,
    hist_view,
    lr_view,
    messages,
    metric_view,
    span_text,
    stats_lines,
    status_label,
)

STYLES = {
    "axis": "dim",
    "train": "bold cyan",
    "val": "bold yellow",
    "steer": "bold magenta",
    "fork": "bold green",
    "label": "dim",
    "status.waiting": "bold",
    "status.starting": "bold cyan",
    "status.running": "bold green",
    "status.stale": "bold black on yellow",
    "status.finished": "bold blue",
    "status.failed": "bold white on red",
    "status.stopped": "bold magenta",
    "status.unknown": "bold",
    "msg.problem": "bold red",
    "msg.warning": "yellow",
    "msg.alert": "bold",
    "alert.critical": "bold white on red",
    "alert.error": "bold red",
    "alert.warning": "bold yellow",
    "alert.info": "cyan",
    "msg.info": "",
    "msg.none": "dim",
}


def _style(name: str | None) -> str:
    return STYLES.get(name, "") if name else ""


class Panel(Widget):
    """A widget that shows one immutable value and redraws only when the value changes."""

    DEFAULT_CSS = "Panel { height: auto; }"
    RESIZES = False  # True where the value decides the height (height: auto): relayout on change

    def __init__(self, *, id: str, title: str | None = None) -> None:
        super().__init__(id=id)
        self.value: object = None
        self.updates = 0  # how many times the value changed (tests check idle refreshes cost nothing)
        self._set = False
        if title:
            self.border_title = title

    def set_value(self, value: object) -> bool:
        if self._set and value == self.value:
            return False
        # A relayout lands a frame later than a plain redraw: ask for one only when the height
        # changes, so a panel's new text and the header's new step show in the same frame.
        relayout = self.RESIZES and (not self._set or self.lines(value) != self.lines(self.value))
        self.value, self._set = value, True
        self.updates += 1
        self.refresh(layout=relayout)
        return True

    def lines(self, value: object) -> int | None:
        """The height ``value`` needs (RESIZES panels); None when unknown (always relayout)."""
        return None

    def build(self, width: int, height: int) -> Text:  # overridden
        return Text(str(self.value))

    def render(self) -> Text:
        return self.build(max(1, self.content_size.width), max(1, self.content_size.height))

    @property
    def plain(self) -> str:
        """The panel's text at its current size, without styles (what a reader of the screen sees)."""
        return self.render().plain


class HeaderBar(Panel):
    DEFAULT_CSS = "HeaderBar { height: 2; padding: 0 1; background: $panel; }"

    def build(self, width: int, height: int) -> Text:
        view: HeaderView | None = self.value  # type: ignore[assignment]
        if view is None:
            return Text("")
        label, style = status_label(view.status)
        if view.paused:
            label = "[paused] " + label
        title = view.fit_title(max(0, width - len(label) - 1))
        line1 = Text(title, style="bold")
        line1.append(" " * max(1, width - len(title) - len(label)))
        line1.append(label, style=_style(style))
        if view.step is None:
            return line1
        left = view.step_text + " "
        right = "" if view.fraction is None else f" {100 * view.fraction:.1f}%"
        if view.epoch is not None:
            right += f"  ep {fmt_epoch(view.epoch)}"
        line2 = Text(left)
        bar_w = width - len(left) - len(right)
        if view.fraction is not None and bar_w >= 5:
            line2.append(bar(view.fraction, bar_w), style=_style("train"))
        line2.append(right)
        return Text("\n").join([line1, line2])


class LossChart(Panel):
    """Train loss (EMA-smoothed braille line) and val loss (• markers) over steps, with a dotted
    rule at each steer (S) and fork point (F)."""

    DEFAULT_CSS = "LossChart { height: 1fr; }"

    def build(self, width: int, height: int) -> Text:
        if self.value is None:
            return Text("no loss recorded yet", style="dim")
        train, val, window, log_y, marks = self.value  # type: ignore[misc]
        series = []
        if train:
            series.append(Series(ema(train, window), "train"))
        if val:
            series.append(Series(val, "val", marker="•"))
        rows, _ = line_chart(series, width, height, log_y, marks)
        if not rows:
            return Text("no loss recorded yet", style="dim")
        text = Text()
        for i, row in enumerate(rows):
            if i:
                text.append("\n")
            for piece, style in row:
                text.append(piece, style=_style(style))
        return text


class StatsPanel(Panel):
    RESIZES = True

    def lines(self, value: object) -> int | None:
        return len(value) if isinstance(value, tuple) else None

    def build(self, width: int, height: int) -> Text:
        rows = self.value or ()
        text = Text()
        for i, (label, value) in enumerate(rows):  # type: ignore[misc]
            if i:
                text.append("\n")
            text.append(f"{label:<8}", style=_style("label"))
            text.append(value)
        return text


class GpuPanel(Panel):
    RESIZES = True

    def lines(self, value: object) -> int | None:
        return 0 if value is None else 1 + len(value[2])  # type: ignore[index]

    def build(self, width: int, height: int) -> Text:
        if self.value is None:
            return Text("")
        name, util, details = self.value  # type: ignore[misc]
        self.border_title = f"GPU {name}"[: max(3, width - 2)]
        pct = "  –%" if util is None else f" {100 * util:3.0f}%"
        text = Text("util ", style=_style("label"))
        text.append(bar(util, max(1, width - 5 - len(pct))), style=_style("train"))
        text.append(pct)
        for line in details:
            text.append("\n" + line)
        return text


class SparkPanel(Panel):
    def build(self, width: int, height: int) -> Text:
        view: SparkView | None = self.value  # type: ignore[assignment]
        if view is None:
            return Text("")
        text = Text(sparkline(view.values, width, view.steps), style=_style("train"))
        text.append("\n" + fit_caption(view.caption, width, max(1, height - 1)), style=_style("label"))
        return text


class BlockPanel(Panel):
    """Per-block gradient (``g``) and update (``u``) norms of the last log step as bars, block 0 on
    the left, each row scaled to its own largest value, which follows the bars with its block."""

    def build(self, width: int, height: int) -> Text:
        view: BlockView | None = self.value  # type: ignore[assignment]
        if view is None:
            return Text("")
        self.border_title = f"Blocks @ step {view.step}" if view.step is not None else "Blocks"
        text = Text()
        for i, (label, values) in enumerate((("g ", view.grads), ("u ", view.updates))):
            peak = " " + view.peak(values)
            bars = level_bars(values, max(1, width - len(label) - len(peak)), fill=True)
            if i:
                text.append("\n")
            text.append(label, style=_style("label"))
            text.append(bars, style=_style("train"))
            text.append(peak[: max(0, width - len(label) - len(bars))], style=_style("label"))
        return text


def _summed(counts: tuple[float, ...], width: int) -> list[float]:
    """Counts summed into at most ``width`` buckets (a histogram keeps its mass when narrowed)."""
    n = len(counts)
    if n <= width:
        return list(counts)
    return [sum(counts[i * n // width:(i + 1) * n // width]) for i in range(width)]


class HistPanel(Panel):
    """Per-layer histograms of the latest record: one line per layer (spread evenly from the embedding
    to the head when there are more layers than lines): its name, the weights' histogram (``w``) and
    the gradient's (``g``), each over the layer's fixed bins, and the gradient's largest magnitude."""

    def build(self, width: int, height: int) -> Text:
        view: HistView | None = self.value  # type: ignore[assignment]
        if view is None:
            return Text("")
        rows = view.shown(height)
        self.border_title = f"Histograms @ step {view.step}" if view.step is not None else "Histograms"
        self.border_subtitle = f"{len(rows)} of {len(view.rows)} layers" if len(rows) < len(view.rows) else ""
        label = max((len(r.name) for r in rows), default=0) + 1
        text = Text()
        for i, row in enumerate(rows):
            peak = " " + span_text(row.grad_range)
            each = max(1, (width - label - 5 - len(peak)) // 2)
            if i:
                text.append("\n")
            text.append(f"{row.name:<{label}}", style=_style("label"))
            text.append("w ", style=_style("label"))
            text.append(level_bars(_summed(row.weights, each), each, fill=True), style=_style("train"))
            text.append(" g ", style=_style("label"))
            text.append(level_bars(_summed(row.grads, each), each, fill=True), style=_style("val"))
            text.append(peak[: max(0, width - label - 5 - 2 * each)], style=_style("label"))
        return text


class EvalBarsPanel(Panel):
    """Task scores (accuracy) across stages: one bar per stage (or evaluation) and task, scaled 0 to 1."""

    def build(self, width: int, height: int) -> Text:
        view: EvalBars | None = self.value  # type: ignore[assignment]
        if view is None:
            return Text("")
        lines = [(label if j == 0 else "", task, acc) for label, scores in view.groups
                 for j, (task, acc) in enumerate(scores)][-height:]
        left = max((len(a) for a, _, _ in lines), default=0) + 1
        name = max((len(t) for _, t, _ in lines), default=0) + 1
        text = Text()
        for i, (label, task, acc) in enumerate(lines):
            value = " " + fmt_percent(acc)
            if i:
                text.append("\n")
            text.append(f"{label:<{left}}", style=_style("label"))
            text.append(f"{task:<{name}}"[: max(0, width - left)], style=_style("label"))
            text.append(bar(acc, max(1, width - left - name - len(value))), style=_style("train"))
            text.append(value)
        return text


class MessagesPanel(Panel):
    """Messages, most important first, each wrapped to the panel's width; "…" ends the last line
    shown when more did not fit."""

    def build(self, width: int, height: int) -> Text:
        rows: list[tuple[str, str | None]] = []
        for line, style in self.value or ():  # type: ignore[misc]
            wrapped = textwrap.wrap(line, width, break_on_hyphens=False) or [""]
            rows.extend((piece, style) for piece in wrapped)
        if len(rows) > height:
            rows = rows[:height]
            last, style = rows[-1]
            rows[-1] = ((last if len(last) < width else last[: width - 1]) + "…", style)
        text = Text()
        for i, (line, style) in enumerate(rows):
            if i:
                text.append("\n")
            text.append(line, style=_style(style))
        return text


HELP = """\
apr monitor: keys

  q   quit
  p   pause / resume refreshing
  l   loss chart: log / linear scale
  ?   this help (esc or ? closes it)

The loss line is an EMA over {window} steps; • marks validation loss.
Refresh every {refresh} ms. STALE: the state file's heartbeat is older
than {stale}; the trainer may have died. The monitor only reads files.
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help { width: 74; height: auto; border: round $accent; padding: 0 1; background: $surface; }
    """
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("question_mark", "close", "Close"),
        Binding("q", "app.quit", "Quit"),
    ]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        yield Static(self.text, id="help")

    def action_close(self) -> None:
        self.dismiss(None)


class PickRunScreen(Screen[Path | None]):
    """`apr monitor` with several active runs: pick one with the arrow keys and Enter."""

    DEFAULT_CSS = """
    PickRunScreen { align: center middle; }
    #pick-title { height: 1; padding: 0 1; }
    #runs { height: 1fr; border: round $accent; }
    """
    BINDINGS = [Binding("escape", "app.quit", "Quit"), Binding("q", "app.quit", "Quit")]

    def __init__(self, runs: Sequence[ActiveRun]) -> None:
        super().__init__()
        self.runs = list(runs)

    def compose(self) -> ComposeResult:
        yield Static(f"{len(self.runs)} active runs: pick one (↑/↓, Enter)", id="pick-title")
        yield OptionList(*[Option(r.describe(), id=str(i)) for i, r in enumerate(self.runs)], id="runs")
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(Path(self.runs[int(event.option.id)].output_dir))


TITLES = {"loss": "Loss", "run": "Run", "gpu": "GPU", "lr": "Learning rate", "grad": "Grad norm",
          "blocks": "Blocks", "alerts": "Alerts", "hist": "Histograms", "evals": "Evals"}
WIDGETS = {"loss": LossChart, "run": StatsPanel, "gpu": GpuPanel, "lr": SparkPanel, "grad": SparkPanel,
           "blocks": BlockPanel, "alerts": MessagesPanel, "spark": SparkPanel, "hist": HistPanel,
           "evals": EvalBarsPanel}


def _widget(spec: PanelSpec) -> Panel:
    widget = WIDGETS[spec.kind](id=spec.id, title=spec.title or TITLES.get(spec.kind))
    if spec.kind == "spark":
        widget.add_class("metric-spark")
    return widget


def _sized(widget: Panel, cell: Cell) -> Panel:
    """A panel alone in its place fills the row's height, at the cell's width when one is given."""
    widget.styles.height = "100%"
    if cell.width:
        widget.styles.width = cell.width
    return widget


class MonitorApp(App[None]):
    """`apr monitor RUN_DIR`. With ``run_dir`` None and several ``candidates``, asks first."""

    TITLE = "apr monitor"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    Screen { layout: vertical; }
    #main { height: 1fr; min-height: 8; }
    #loss { width: 1fr; border: round $accent; }
    #side { width: 34; height: 100%; }
    #stats { height: auto; border: round $primary; }
    #gpu { height: auto; border: round $primary; }
    #sparks { height: 4; }
    #lr, #grad, #blocks { width: 1fr; height: 4; border: round $primary; }
    #messages { height: 4; border: round $primary; }
    #hist, #evals { width: 1fr; border: round $primary; }
    .metric-spark { width: 1fr; height: 4; border: round $primary; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),  # what a terminal user tries first
        Binding("p", "toggle_pause", "Pause"),
        Binding("l", "toggle_log", "Log/linear"),
        Binding("question_mark", "help", "Help", key_display="?"),
    ]

    paused: reactive[bool] = reactive(False, init=False)
    log_scale: reactive[bool] = reactive(False, init=False)
    status: reactive[str] = reactive("waiting", init=False)

    def __init__(
        self,
        run_dir: str | Path | None,
        settings: MonitorSettings | None = None,
        clock: Callable[[], float] = time.time,
        candidates: Sequence[ActiveRun] = (),
        quit_after_s: float | None = None,
        refresh_ms: int | None = None,
        dashboard: Dashboard | None = None,
    ) -> None:
        super().__init__()
        self.dashboard = dashboard or default_dashboard()  # the layout (apr/monitor/dashboard.py)
        self.refresh_ms = refresh_ms  # the --refresh option; wins over the run's config.yaml
        self.clock = clock
        self.candidates = list(candidates)
        self.quit_after_s = quit_after_s
        self._fixed_settings = settings
        self.reader: StateReader | None = None
        self.run_dir: Path | None = None
        self.settings = settings or MonitorSettings()
        self.ticks = 0
        self._pending_run_dir = Path(run_dir) if run_dir is not None else None

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        columns = 0
        for r, row in enumerate(self.dashboard.rows):
            # the default layout's rows keep the ids the CSS (and older tests) name
            with Horizontal(id={0: "main", 1: "sparks"}.get(r, f"row-{r}")) as container:
                container.styles.height = row.height
                for cell in row.cells:
                    if cell.stacked:
                        with Vertical(id="side" if columns == 0 else f"col-{columns}") as column:
                            columns += 1
                            if cell.width:
                                column.styles.width = cell.width
                            yield from (_widget(p) for p in cell.panels)
                    else:
                        yield _sized(_widget(cell.panels[0]), cell)
        yield Footer()

    def _panel(self, panel_id: str):
        """The dashboard's panel of that id, or None when the layout leaves it out."""
        return self.query_one(f"#{panel_id}") if self.dashboard.has(panel_id) else None

    def on_mount(self) -> None:
        for hidden in ("gpu", "blocks"):  # shown once the run records them
            if self.dashboard.has(hidden):
                self.query_one(f"#{hidden}").display = False
        if self.quit_after_s is not None:
            self.set_timer(self.quit_after_s, self.exit)
        if self._pending_run_dir is not None:
            self.open_run(self._pending_run_dir)
        elif len(self.candidates) == 1:
            self.open_run(Path(self.candidates[0].output_dir))
        else:
            self.push_screen(PickRunScreen(self.candidates), self._picked)

    def _picked(self, run_dir: Path | None) -> None:
        if run_dir is None:
            self.exit()
        else:
            self.open_run(run_dir)

    def open_run(self, run_dir: Path) -> None:
        """Start watching ``run_dir`` (its config.yaml sets the refresh unless settings were given)."""
        self.run_dir = Path(run_dir)
        self.reader = StateReader(self.run_dir)
        if self._fixed_settings is None:
            self.settings = load_settings(self.run_dir, self.refresh_ms)
        self.poll()
        self.set_interval(self.settings.refresh_s, self.tick)

    # ------------------------------------------------------------------ refresh

    def tick(self) -> None:
        if self.paused:
            return
        try:
            self.poll()
        except NoMatches:  # the refresh timer fired while the app was shutting down: nothing to draw
            return

    @property
    def stale_after_s(self) -> float:
        state = self.reader.state if self.reader else None
        return stale_threshold(self.settings.refresh_s, state)

    def poll(self) -> None:
        """One refresh: stat (and maybe read) the file, then update what changed."""
        if self.reader is None:
            return
        self.ticks += 1
        changed = self.reader.poll()
        state = self.reader.state
        now = self.clock()
        self.status = "waiting" if state is None else effective_status(state, now, self.stale_after_s)
        if changed or self.ticks == 1:
            self._push_data()
        self._push_header()
        self._push_messages(now)

    def _push_data(self) -> None:
        state = self.reader.state if self.reader else None
        self._push_chart()
        if stats := self._panel("stats"):
            stats.set_value(stats_lines(state, self.settings.show_eta))
        if gpu_panel := self._panel("gpu"):
            gpu = gpu_lines(state.get("gpu") if state else None)
            gpu_panel.display = gpu is not None
            gpu_panel.set_value(gpu)
        for panel_id, view in (("lr", lr_view), ("grad", grad_view)):
            if panel := self._panel(panel_id):
                panel.set_value(view(state))
        for spec in self.dashboard.sparks:
            self.query_one(f"#{spec.id}", SparkPanel).set_value(metric_view(state, spec.metric))
        if block_panel := self._panel("blocks"):
            blocks = block_view(state)
            block_panel.display = blocks is not None
            block_panel.set_value(blocks)
        for panel_id, view in (("hist", hist_view), ("evals", eval_bars_view)):
            if panel := self._panel(panel_id):  # empty until the run records them
                panel.set_value(view(state))

    def _push_chart(self) -> None:
        state = self.reader.state if self.reader else None
        chart = self._panel("loss")
        if chart is None:
            return
        window = self._ema_window(state)
        chart.border_title = f"Loss (EMA {window})"
        if state is None or not (state["loss_history"] or state["val_loss_history"]):
            chart.border_subtitle = ""
            chart.set_value(None)
            return
        train, val = state["loss_history"], state["val_loss_history"]
        log_used = self.log_scale and all(v > 0 for _, v in (*train, *val))
        scale = "log" if log_used else ("linear (log needs loss > 0)" if self.log_scale else "linear")
        ahead = forecast_view(state)
        chart.border_subtitle = scale if ahead is None else f"{forecast_text(ahead)} · {scale}"
        chart.set_value((train, val, window, log_used, chart_marks(state)))

    def _ema_window(self, state: dict | None) -> int:
        state = state or {}
        history = state.get("loss_history") or ()
        return self.settings.window_for(state.get("total_steps"), history[-1][0] if history else None)

    def _push_header(self) -> None:
        state = self.reader.state if self.reader else None
        run_dir = str(self.run_dir) if self.run_dir else "?"
        self.query_one("#header", HeaderBar).set_value(header_view(state, self.status, self.paused, run_dir))

    def _push_messages(self, now: float) -> None:
        reader = self.reader
        panel = self._panel("messages")
        if panel is None:
            return
        panel.set_value(
            messages(
                reader.reading if reader else None,
                reader.state if reader else None,
                self.status,
                now,
                self.stale_after_s,
            )
        )

    # ------------------------------------------------------------------ reactive state

    def watch_status(self, old: str, new: str) -> None:
        self.sub_title = new
        self._push_header()

    def watch_paused(self, paused: bool) -> None:
        self._push_header()
        if not paused:
            self.poll()

    def watch_log_scale(self, log_scale: bool) -> None:
        self._push_chart()

    # ------------------------------------------------------------------ actions

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def action_toggle_log(self) -> None:
        self.log_scale = not self.log_scale

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss(None)
            return
        self.push_screen(
            HelpScreen(
                HELP.format(
                    window=self._ema_window(self.reader.state if self.reader else None),
                    refresh=self.settings.refresh_ms,
                    stale=fmt_duration(self.stale_after_s),
                )
            )
        )
