"""The dashboard's definition: rows of panels, each panel a view of the run (docs/monitor.md,
"Dashboard layout"). One definition drives `apr monitor` in the terminal and `apr monitor --web`
(each browser tab runs the same dashboard with the same ``--dashboard`` file).

```yaml
rows:
  - height: 1fr                          # a share of the free lines, or a number of lines
    panels:
      - {panel: loss, width: 1fr}        # a share of the row's width, or a number of columns
      - {column: [run, gpu], width: 34}  # panels stacked in one column
  - height: 4
    panels: [lr, grad, blocks]
  - height: 4
    panels: [alerts]
```

Panels: ``loss`` (train and val loss chart), ``run`` (step, tokens, ETA, checkpoint), ``gpu``,
``lr``, ``grad`` (grad norm), ``blocks`` (per-block norms), ``alerts`` (alerts and messages),
``hist`` (per-layer weight and gradient histograms, monitoring.histograms), ``evals`` (task scores
across stages, evaluation.tasks), and
``{panel: spark, metric: NAME, title: TEXT}``: a sparkline of any metric the state file keeps a
history of. Plain YAML, validated here: an unknown panel or metric is an error naming the file,
the entry and what exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from apr.config.yamlfile import read_yaml
from apr.errors import AprError, Finding
from apr.quoting import describe, key_path, key_text, of_kind, quote_key, what_it_holds
from apr.track.state import HISTORY_KEYS

# panel kind -> widget id (the ids the app and its CSS know; a kind appears at most once)
FIXED_PANELS = {"loss": "loss", "run": "stats", "gpu": "gpu", "lr": "lr", "grad": "grad", "blocks": "blocks",
                "alerts": "messages", "hist": "hist", "evals": "evals"}
SPARK = "spark"
SIZE = re.compile(r"^(\d+)(fr)?$")  # 4 (lines or columns) or 1fr (a share of what is left)
MAX_SIZE = 1000  # lines, columns or shares: no terminal is larger, and Textual's layout grows with it

DEFAULT_YAML = """\
rows:
  - height: 1fr
    panels:
      - {panel: loss, width: 1fr}
      - {column: [run, gpu], width: 34}
  - height: 4
    panels: [lr, grad, blocks]
  - height: 4
    panels: [alerts]
"""


class DashboardError(AprError):
    """A dashboard file that cannot be read or names a panel or metric that does not exist."""


@dataclass(frozen=True)
class PanelSpec:
    kind: str  # a FIXED_PANELS key or "spark"
    id: str
    width: str | None = None  # CSS width: "1fr", "34"; None: share the row equally
    metric: str | None = None  # spark panels: the history they draw
    title: str | None = None


@dataclass(frozen=True)
class Cell:
    """One place in a row: one panel, or a column of panels stacked."""

    panels: tuple[PanelSpec, ...]
    width: str | None = None
    stacked: bool = False


@dataclass(frozen=True)
class RowSpec:
    height: str
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class Dashboard:
    rows: tuple[RowSpec, ...]
    source: str = "default"
    panel_ids: frozenset[str] = field(default_factory=frozenset)

    def has(self, panel_id: str) -> bool:
        return panel_id in self.panel_ids

    @property
    def sparks(self) -> list[PanelSpec]:
        return [p for r in self.rows for c in r.cells for p in c.panels if p.kind == SPARK]


def _loc(path: str) -> tuple:
    """``rows[1].panels[0].metric`` -> ("rows", 1, "panels", 0, "metric")."""
    return tuple(int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path))


class _Builder:
    """Turns the parsed YAML into a Dashboard; the first problem is raised with its line."""

    def __init__(self, where: str, source=None):
        self.where, self.source = where, source
        self.ids: set[str] = set()
        self.sparks = 0

    def fail(self, path: str, message: str, expected: str, got: str) -> DashboardError:
        line, column = self.source.locate(_loc(path)) if self.source is not None else (None, None)
        path = key_path(_loc(path))
        return DashboardError(f"{self.where}: {path}: {message}", [Finding(
            "error", "monitor.dashboard", message, path=path, file=self.where, line=line, column=column,
            expected=expected, got=got)])

    def size(self, value, path: str, default: str | None) -> str | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, int) and value <= 0):
            raise self.fail(path, "not a size", "a positive number of lines/columns, or a share such as 1fr",
                            describe(value))
        text = str(min(value, MAX_SIZE + 1)) if isinstance(value, int) else value.strip()
        match = SIZE.match(text)
        if match is None or int(match.group(1)[:6]) == 0:
            raise self.fail(path, "not a size", "a positive number of lines/columns, or a share such as 1fr",
                            describe(value))
        if len(match.group(1)) > 6 or int(match.group(1)) > MAX_SIZE:
            raise self.fail(path, "too large", f"at most {MAX_SIZE} lines/columns (or a share such as 1fr)",
                            describe(value))
        return text

    def panel(self, entry, path: str) -> PanelSpec:
        if isinstance(entry, str):
            entry = {"panel": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("panel"), str):
            raise self.fail(path, "not a panel", "a panel name or {panel: NAME, ...}", describe(entry))
        unknown = set(entry) - {"panel", "width", "metric", "title"}
        if unknown:
            first = sorted(map(str, unknown))[0]
            raise self.fail(path, f"unknown key {quote_key(first)}", "panel, width, metric, title", key_text(first))
        kind = entry["panel"]
        width = self.size(entry.get("width"), f"{path}.width", None)
        if kind == SPARK:
            return self.spark(entry, path, width)
        if kind not in FIXED_PANELS:
            raise self.fail(path, f"no panel {describe(kind)}", ", ".join([*FIXED_PANELS, SPARK]), describe(kind))
        if entry.get("metric") is not None:
            raise self.fail(f"{path}.metric", f"the {kind} panel shows a fixed view; metric is for spark panels",
                            "no metric", describe(entry["metric"]))
        panel_id = FIXED_PANELS[kind]
        if panel_id in self.ids:
            raise self.fail(path, f"the {kind} panel appears twice", "each panel once", kind)
        self.ids.add(panel_id)
        return PanelSpec(kind, panel_id, width, title=_title(entry, path, self))

    def spark(self, entry: dict, path: str, width: str | None) -> PanelSpec:
        metric = entry.get("metric")
        if metric not in HISTORY_KEYS:
            raise self.fail(f"{path}.metric", f"metric {describe(metric)} does not exist in the run's state",
                            "one of " + ", ".join(HISTORY_KEYS) + " (training_state.json keeps their history)",
                            describe(metric))
        panel_id = f"spark-{self.sparks}"
        self.sparks += 1
        self.ids.add(panel_id)
        return PanelSpec(SPARK, panel_id, width, metric=metric, title=_title(entry, path, self) or metric)

    def cell(self, entry, path: str) -> Cell:
        if isinstance(entry, dict) and "column" in entry:
            inner = entry["column"]
            if not isinstance(inner, list) or not inner or set(entry) - {"column", "width"}:
                raise self.fail(path, "not a column", "{column: [PANEL, ...], width: SIZE}", describe(entry))
            panels = tuple(self.panel(p, f"{path}.column[{i}]") for i, p in enumerate(inner))
            return Cell(panels, self.size(entry.get("width"), f"{path}.width", None), stacked=True)
        spec = self.panel(entry, path)
        return Cell((spec,), spec.width)

    def row(self, entry, path: str) -> RowSpec:
        if not isinstance(entry, dict) or not isinstance(entry.get("panels"), list) or not entry["panels"]:
            raise self.fail(path, "not a row", "{height: SIZE, panels: [PANEL, ...]}", describe(entry))
        if set(entry) - {"height", "panels"}:
            first = sorted(map(str, set(entry) - {"height", "panels"}))[0]
            raise self.fail(path, f"unknown key {quote_key(first)}", "height, panels", key_text(first))
        cells = tuple(self.cell(c, f"{path}.panels[{i}]") for i, c in enumerate(entry["panels"]))
        return RowSpec(self.size(entry.get("height"), f"{path}.height", "1fr"), cells)


def _title(entry: dict, path: str, builder: _Builder) -> str | None:
    title = entry.get("title")
    if title is not None and not isinstance(title, str):
        raise builder.fail(f"{path}.title", "not text", "a string", describe(title))
    return title


def parse_dashboard(doc, where: str = "default", source=None) -> Dashboard:
    """A Dashboard from parsed YAML; ``source`` (a SourceMap) puts line numbers on the errors."""
    builder = _Builder(where, source)
    if not of_kind(doc, ("rows",)):  # not a dashboard file at all: what it holds in words, never its lines
        raise builder.fail("rows", "not a dashboard file", "a mapping with rows: [ROW, ...]", what_it_holds(doc))
    if not isinstance(doc.get("rows"), list) or not doc["rows"]:
        raise builder.fail("rows", "no rows", "a mapping with rows: [ROW, ...]", describe(doc.get("rows")))
    if set(doc) - {"rows"}:
        first = sorted(map(str, set(doc) - {"rows"}))[0]
        raise builder.fail(key_text(first), "unknown key", "rows", key_text(first))
    rows = tuple(builder.row(r, f"rows[{i}]") for i, r in enumerate(doc["rows"]))
    return Dashboard(rows, where, frozenset(builder.ids))


def load_dashboard(path: str | Path | None) -> Dashboard:
    """The dashboard in ``path`` (YAML), or the default layout for None."""
    if path is None:
        return default_dashboard()
    try:
        doc, source, _ = read_yaml(Path(path), "config", "dashboard file")
    except AprError as err:
        raise DashboardError(f"{path}: cannot read the dashboard: {err.message}", err.findings) from None
    return parse_dashboard(doc, str(path), source)


def default_dashboard() -> Dashboard:
    from ruamel.yaml import YAML  # lazy: only the dashboard reads YAML in the monitor

    return parse_dashboard(YAML(typ="safe").load(DEFAULT_YAML))
