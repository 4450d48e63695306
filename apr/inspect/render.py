"""The text form of an inspect report (the CLI prints it; `--json` prints ``to_dict`` instead)."""

from __future__ import annotations

from apr.fmt import format_count
from apr.inspect import draw
from apr.inspect.report import InspectReport, Weights


def _g(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def _weights_lines(w: Weights) -> list[str]:
    step = f" step {w.source.step}" if w.source.step is not None else ""
    head = f"{w.source.path} ({w.source.kind}{step}): {len(w.tensors)} tensors"
    rows = [[r.layer, str(r.tensors), format_count(r.stats["numel"]), _g(r.stats["mean"]), _g(r.stats["std"]),
             _g(r.stats["min"]), _g(r.stats["max"]), _g(r.stats["zero_fraction"]), str(r.stats["nonfinite"]),
             draw.sparkline(r.counts)] for r in w.layers]
    header = ["layer", "tensors", "numel", "mean", "std", "min", "max", "zeros", "nonfinite", "histogram (min..max)"]
    return [head] + ["  " + line for line in _table(header, rows)]


def _update_lines(report: InspectReport) -> list[str]:
    u = report.updates
    before, after = (w.source.path for w in report.weights)
    lines = [f"update from {before} to {after} (relative: ||B - A|| / ||A||)"]
    labels = [r.layer for r in u.layers]
    bars = draw.text_bars(labels, [r.stats["relative_update"] for r in u.layers], width=30)
    lines += [f"  {bar}   cosine {_g(r.stats['cosine'])}" for bar, r in zip(bars, u.layers, strict=True)]
    lines += [f"  {r.layer}: {r.stats['nonfinite']} positions where a weight is inf or NaN, left out of these sums"
              for r in u.layers if r.stats.get("nonfinite")]
    for what, names in (("only in the first", u.only_before), ("only in the second", u.only_after)):
        if names:
            lines.append(f"  {len(names)} tensors {what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    lines += [f"  {r['name']}: shape {r['before']} -> {r['after']} (not compared)" for r in u.reshaped]
    return lines


def _attention_lines(report: InspectReport) -> list[str]:
    lines = []
    for a in report.attention:
        lines += ["", f"attention layer {a.layer} head {a.head} "
                      "(rows: queries, columns: keys; each row scaled to its maximum)"]
        lines += ["  " + row for row in draw.shade_map(a.weights)]
    if report.attention:
        tokens = report.attention[0].tokens
        lines.append("  tokens: " + " ".join(f"{i}:{t!r}" for i, t in enumerate(tokens[:40]))
                     + (" ..." if len(tokens) > 40 else ""))
    return lines


def render_text(report: InspectReport) -> str:
    lines: list[str] = []
    for w in report.weights:
        lines += _weights_lines(w) + [""]
    if report.updates:
        lines += _update_lines(report)
    lines += _attention_lines(report)
    if report.written:
        lines += ["", "wrote " + ", ".join(str(p) for p in report.written)]
    return "\n".join(lines).rstrip()
