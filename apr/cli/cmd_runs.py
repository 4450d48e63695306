"""`apr runs ls` and `apr runs show`: list and inspect recorded runs (JSON schemas in docs/runs.md).

The module imports typer only inside `register`, so `fast_path` can answer `apr runs ls ...`
without building the typer app.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from apr.cli.render import error_exit, use_colour
from apr.cli.table import text_table
from apr.errors import AprError
from apr.fmt import fmt_clock, fmt_loss, fmt_timestamp, fmt_value, safe_text
from apr.fsutil import check_output_file, write_output
from apr.severity import count_by_severity
from apr.track.state import BLOCK_NORM_LISTS

if TYPE_CHECKING:
    import typer


def parent_cell(parent: dict | None) -> str:
    """``RUN_ID@STEP`` of the run and step a fork started from; ``-`` for a run that is no fork."""
    if not parent:
        return "-"
    return f"{safe_text(parent.get('run_id') or '?')}@{fmt_value(parent.get('step'))}"


def runs_table(runs: list[dict]) -> str:
    """One line per run; a PARENT column (``RUN_ID@STEP``) when any listed run is a fork."""
    lineage = any(r.get("parent") for r in runs)
    header = ["RUN ID", "EXPERIMENT", "STATUS", "STEP", "LOSS", "STARTED", "DURATION", *(["PARENT"] if lineage else [])]
    rows = [
        [
            safe_text(r["run_id"]),
            safe_text(r["experiment"]),
            safe_text(r["status"]),
            f"{r['step'] if r['step'] is not None else '-'}/{r['total_steps'] if r['total_steps'] else '-'}",
            fmt_loss(r["last_loss"]),
            fmt_timestamp(r["started_at"]),
            fmt_clock(r["duration_s"]),
            *([parent_cell(r.get("parent"))] if lineage else []),
        ]
        for r in runs
    ]
    return text_table(header, rows)


def runs_json(runs: list[dict]) -> str:
    """The `apr runs ls --json` array: one run object per line (greppable, and twice as fast to
    write as an indented document for a registry of 10,000 runs)."""
    if not runs:
        return "[]\n"
    dumps = json.JSONEncoder(separators=(", ", ": ")).encode
    return "[\n" + ",\n".join(dumps(r) for r in runs) + "\n]\n"


def run_ls(
    global_: bool = False,
    json_out: bool = False,
    status: str | None = None,
    experiment: str | None = None,
    limit: int | None = None,
    stale_after: float | None = None,
) -> int:
    from apr.track.runs import list_runs

    try:
        listing = list_runs(
            global_=global_, status=status, experiment=experiment, limit=limit, stale_after_s=stale_after
        )
    except AprError as err:
        return error_exit(err)
    for w in listing.warnings:
        print(f"warning: {safe_text(w)}", file=sys.stderr)
    if json_out:
        sys.stdout.write(runs_json(listing.runs))
    elif listing.runs:
        print(runs_table(listing.runs))
    else:
        where = "the global registry" if global_ else f"experiment stores under {Path.cwd()}"
        print(f"no runs found in {where}", file=sys.stderr)
    return 0


def _split_lists(final: dict) -> tuple[dict, dict[str, list[tuple[int, dict]]]]:
    """Final metrics apart from list metrics: a list is recorded one row per element as
    ``name.0``, ``name.1``, ... (the per-block norms); those are grouped under ``name``, by index."""
    indexed: dict[str, list[tuple[int, dict]]] = {}
    for key, m in final.items():
        base, _, index = key.rpartition(".")
        if base and index.isdigit() and base not in final:
            indexed.setdefault(base, []).append((int(index), m))
    lists = {base: sorted(items, key=lambda item: item[0]) for base, items in indexed.items()
             if base in BLOCK_NORM_LISTS or len(items) > 1}
    scalars = {k: m for k, m in final.items() if k.rpartition(".")[0] not in lists}
    return scalars, lists


def list_metric_lines(lists: dict[str, list[tuple[int, dict]]], per_line: int = 6) -> list[str]:
    """Each list metric on its own lines: a summary (how many values, the step, max and min with
    where they are, the mean, the non-finite ones) then every value, ``per_line`` to a line, named
    by its block (``block 3: 0.52``) for the per-block norms, by its index (``#3: 0.52``) otherwise."""
    out: list[str] = []
    for name, items in lists.items():
        label = "block " if name in BLOCK_NORM_LISTS else "#"
        known = [(m["value"], i) for i, m in items
                 if isinstance(m["value"], (int, float)) and not isinstance(m["value"], bool)
                 and math.isfinite(m["value"])]
        steps = {m["step"] for _, m in items}
        step = fmt_value(max(steps)) if len(steps) == 1 else f"{fmt_value(min(steps))}-{fmt_value(max(steps))}"
        count = f"{len(items)} blocks" if label == "block " else f"{len(items)} values"
        summary = f"  {safe_text(name)}: {count} at step {step}"
        if known:
            lo, hi = min(known), max(known, key=lambda vi: (vi[0], -vi[1]))
            summary += (f"; max {fmt_value(hi[0])} ({label}{hi[1]}), min {fmt_value(lo[0])} ({label}{lo[1]}), "
                        f"mean {fmt_value(sum(v for v, _ in known) / len(known))}")
        bad = [i for i, m in items if (m["value"], i) not in known]
        if bad:
            summary += f"; not finite: {', '.join(f'{label}{i}' for i in bad)}"
        out.append(summary)
        cells = [f"{label}{i}: {fmt_value(m['value']) if (m['value'], i) in known else '-'}" for i, m in items]
        width = max(len(c) for c in cells)
        for start in range(0, len(cells), per_line):
            out.append("    " + "   ".join(c.ljust(width) for c in cells[start:start + per_line]).rstrip())
    return out


def cost_lines(detail: dict) -> list[str]:
    """The run's cost (training.price_per_gpu_hour x GPUs x its elapsed time), from the last recorded
    ``cost`` metric; none for a run without a price."""
    price, cost = detail["params"].get("training.price_per_gpu_hour"), detail["final_metrics"].get("cost")
    if price is None or cost is None:
        return []
    gpus = detail["params"].get("training.world_size", 1)
    return [f"cost       {fmt_value(cost['value'])} at step {fmt_value(cost['step'])} "
            f"({fmt_value(price)} per GPU-hour x {fmt_value(gpus)} GPU(s) x elapsed time)"]


SEVERITY_COLOURS = {"critical": "\x1b[1;37;41m", "error": "\x1b[1;31m", "warning": "\x1b[33m", "info": "\x1b[36m"}


def _severity_cell(severity: str) -> str:
    """The severity, padded, in its colour on a terminal (never with NO_COLOR)."""
    cell = f"{severity:<8}"
    return f"{SEVERITY_COLOURS[severity]}{cell}\x1b[0m" if use_colour(sys.stdout) else cell


def show_text(detail: dict) -> str:
    r = detail["run"]
    t = safe_text
    reason = f" ({t(r['status_reason'])})" if r["status_reason"] else ""
    if r["status"] == "dead":  # recorded as running; its process is gone (docs/runs.md, stale and dead runs)
        reason = (f" (recorded as {t(r['recorded_status'])}; its trainer, pid {fmt_value(r['pid'])} on this host, "
                  "is gone: killed or out of memory?)")
    out = [
        f"run        {t(r['run_id'])}",
        f"experiment {t(r['experiment'])}",
        f"status     {t(r['status'])}{reason}",
        f"step       {fmt_value(r['step'])}/{fmt_value(r['total_steps'])}",
        f"started    {fmt_timestamp(r['started_at'])}   duration {fmt_clock(r['duration_s'])}",
        f"host       {t(r['host'])} (pid {fmt_value(r['pid'])})",
        *([f"parent     {parent_cell(detail['parent'])} (apr train fork)"] if detail.get("parent") else []),
        *([f"forks      {', '.join(parent_cell(f) for f in detail['forks'])}"] if detail.get("forks") else []),
        *cost_lines(detail),
        f"output     {t(r['output_dir'])}",
        f"config     {t(r['config_path'] or '-')}  hash {t(str(r['config_hash'] or '-')[:12])}",
        f"store      {t(r['store'])}",
        *([f"tags       {', '.join(f'{t(k)}={t(v)}' for k, v in detail['tags'].items())}"]
          if detail.get("tags") else []),
        "",
        "final metrics:",
    ]
    scalars, lists = _split_lists(detail["final_metrics"])
    width = max([14, *(len(t(k)) for k in scalars)])  # eval.<task>.acc_norm is long
    for key, m in scalars.items():
        out.append(f"  {t(key):<{width}} {fmt_value(m['value']):<12} (step {fmt_value(m['step'])})")
    if detail["best_val_loss"]:
        b = detail["best_val_loss"]
        out.append(f"  best val_loss  {fmt_value(b['value'])} (step {fmt_value(b['step'])})")
    if detail.get("forecast"):
        f = detail["forecast"]
        out.append(f"  forecast       val_loss {f['loss']:.4f} [{f['low']:.4f}, {f['high']:.4f}] at step "
                   f"{fmt_value(f['step'])} (from {f['points']} validations to step {fmt_value(f['last_step'])})")
    if lists:
        out += ["", "per-block and other list metrics (block 0 is the one nearest the embedding):",
                *list_metric_lines(lists)]
    out += ["", "checkpoints:"]
    for a in detail["checkpoints"] or []:
        sha = t((a["sha256"] or "-")[:16])
        gone = "" if a.get("exists", True) else "  (deleted)"
        out.append(f"  step {fmt_value(a['step']):<8} {t(a['kind']):<16} {fmt_value(a['size'] or 0):>12} B  "
                   f"sha256 {sha}  {t(a['path'])}{gone}")
    if not detail["checkpoints"]:
        out.append("  (none)")
    out += ["", "status history:"]
    out += [f"  {fmt_timestamp(s['time'])}  {t(s['status'])}" + (f" ({t(s['reason'])})" if s["reason"] else "")
            for s in detail["status_history"]]
    if detail["alerts"]:
        counts = count_by_severity(detail["alerts"])
        out += ["", "alerts: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
        out += [f"  step {fmt_value(a['step'])}  {_severity_cell(a['severity'])}  {t(a['message'])}"
                for a in detail["alerts"]]
    if detail.get("events"):
        out += ["", "events:"]
        for e in detail["events"]:
            rows = len((e.get("detail") or {}).get("rows") or [])
            out.append(f"  step {fmt_value(e['step'])}  {t(e['kind']):<8}  {t(e['message'])}"
                       + (f"  [{rows} rows: apr runs ledger]" if rows else ""))
    out += ["", "params:"]
    out += [f"  {t(k)} = {fmt_value(v)}" for k, v in detail["params"].items()]
    return "\n".join(out)


def run_show(run_id: str, global_: bool = False, json_out: bool = False) -> int:
    from apr.track.runs import show_run

    warnings: list[str] = []
    try:
        detail = show_run(run_id, global_=global_, warnings=warnings)
    except AprError as err:
        return error_exit(err)
    for w in warnings:
        print(f"warning: {safe_text(w)}", file=sys.stderr)
    if json_out:
        sys.stdout.write(json.dumps(detail, indent=2, default=str) + "\n")
    else:
        print(show_text(detail))
    return 0


def run_ledger(run_id: str, global_: bool = False, fmt: str = "table", output: Path | None = None,
               overwrite: bool = False) -> int:
    """Print (or write to ``output``) the rows a run's skipped steps and rollbacks left out."""
    from apr.track.runs import LEDGER_COLUMNS, ledger, show_run

    warnings: list[str] = []
    try:
        if output is not None:  # refused before any work: a device, a FIFO, a symlink, apr's store, ...
            check_output_file(output, overwrite=overwrite, option="--output")
        entries = ledger(show_run(run_id, global_=global_, warnings=warnings))
    except AprError as err:
        return error_exit(err)
    for w in warnings:
        print(f"warning: {safe_text(w)}", file=sys.stderr)
    if fmt == "json":
        text = json.dumps(entries, indent=2) + "\n"
    elif fmt == "jsonl":
        text = "".join(json.dumps(e) + "\n" for e in entries)
    elif fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=LEDGER_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(entries)
        text = buf.getvalue()
    else:
        rows = [[safe_text(e["event"]), fmt_value(e["step"]), fmt_value(e["micro_batch"]), safe_text(e["shard"]),
                 fmt_value(e["row"]), fmt_value(e["index"]), fmt_loss(e["loss"])] for e in entries]
        text = (text_table(["EVENT", "STEP", "MICRO-BATCH", "SHARD", "ROW", "INDEX", "LOSS"], rows) + "\n" if rows
                else "no rows were skipped in this run\n")
    if output is None:
        sys.stdout.write(text)
        return 0
    try:
        write_output(output, text, overwrite=overwrite, option="--output")
    except AprError as err:
        return error_exit(err)
    print(f"wrote {len(entries)} ledger rows to {output}", file=sys.stderr)
    return 0


def blame_text(result: dict) -> str:
    """The ranked rows of a step: loss, source, shard, row and the start of the decoded text."""
    head = (f"run {safe_text(result['run_id'])} step {fmt_value(result['step'])}: {len(result['rows'])} of "
            f"{fmt_value(result['row_count'])} rows by loss (mean {fmt_loss(result['mean_loss'])})")
    rows = [[fmt_value(r["rank"]), fmt_loss(r["loss"]), safe_text(r["source"] or "-"), safe_text(r["shard"] or "-"),
             fmt_value(r["row"]), fmt_value(r["micro_batch"]),
             "-" if r["text"] is None else safe_text(" ".join(r["text"].split()))[:60]] for r in result["rows"]]
    return head + "\n" + text_table(["RANK", "LOSS", "SOURCE", "SHARD", "ROW", "MICRO-BATCH", "TEXT"], rows)


def run_blame(run_id: str, step: int, top: int | None = 10, global_: bool = False, json_out: bool = False,
              decode: bool = True) -> int:
    """Print the rows of a logged step ranked by loss (apr/track/blame.py)."""
    from apr.track.blame import blame

    warnings: list[str] = []
    try:
        result = blame(run_id, step, top=top, decode=decode, global_=global_, warnings=warnings)
    except AprError as err:
        return error_exit(err)
    for w in warnings:
        print(f"warning: {safe_text(w)}", file=sys.stderr)
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    print(blame_text(result))
    for note in result["notes"]:
        print(f"note: {safe_text(note)}", file=sys.stderr)
    return 0


def fast_path(argv: list[str]) -> int | None:
    """Answer `apr runs ls [--global] [--json]` without typer (listing is what agents poll).
    Returns None for anything else, which then goes through typer as usual."""
    if argv[:2] != ["runs", "ls"]:
        return None
    rest = set(argv[2:])
    if not rest <= {"--global", "--json"} or len(rest) != len(argv) - 2:
        return None
    return run_ls(global_="--global" in rest, json_out="--json" in rest)


def register(app: typer.Typer) -> None:
    import typer

    @app.command("ls")
    def ls(
        global_: bool = typer.Option(False, "--global", help="Read the global registry ($APR_HOME, default ~/.apr)."),
        json_out: bool = typer.Option(False, "--json", help="Print a JSON array (schema in docs/runs.md)."),
        status: str | None = typer.Option(
            None, "--status",
            help="Only runs with this status: starting, running, finished, failed, stopped, stale, dead.",
        ),
        experiment: str | None = typer.Option(None, "--experiment", help="Only runs of this experiment."),
        limit: int | None = typer.Option(None, "--limit", min=0, help="At most this many runs (newest first)."),
        stale_after: float | None = typer.Option(
            None, "--stale-after", min=0, help="Seconds without a heartbeat before a running run is stale."
        ),
    ) -> None:
        """List runs, newest first: the stores under this folder, or the global registry."""
        raise typer.Exit(run_ls(global_, json_out, status, experiment, limit, stale_after))

    @app.command("show")
    def show(
        run_id: str = typer.Argument(..., help="Run id (a unique prefix is enough).", show_default=False),
        global_: bool = typer.Option(False, "--global", help="Look only in the global registry."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON (schema in docs/runs.md)."),
    ) -> None:
        """Params, final metrics, checkpoints, status history, alerts and events of one run."""
        raise typer.Exit(run_show(run_id, global_, json_out))

    @app.command("blame")
    def blame_cmd(
        run_id: str = typer.Argument(..., help="Run id (a unique prefix is enough).", show_default=False),
        step: int = typer.Option(..., "--step", min=0, help="A logged step (the rows' losses are recorded at "
                                                            "each logged step).", show_default=False),
        top: int = typer.Option(10, "--top", min=1, help="How many rows, highest loss first."),
        all_rows: bool = typer.Option(False, "--all", help="Every row of the step (instead of --top)."),
        global_: bool = typer.Option(False, "--global", help="Look only in the global registry."),
        json_out: bool = typer.Option(False, "--json", help="Print JSON (schema in docs/runs.md)."),
        no_text: bool = typer.Option(False, "--no-text", help="Do not decode the rows' text."),
    ) -> None:
        """The rows of a logged step ranked by loss: source, shard, row, loss and the decoded text."""
        raise typer.Exit(run_blame(run_id, step, None if all_rows else top, global_, json_out, not no_text))

    @app.command("ledger")
    def ledger_cmd(
        run_id: str = typer.Argument(..., help="Run id (a unique prefix is enough).", show_default=False),
        global_: bool = typer.Option(False, "--global", help="Look only in the global registry."),
        fmt: str = typer.Option("table", "--format", help="table, csv, json or jsonl."),
        output: Path | None = typer.Option(None, "--output", "-o", help="Write to this file (atomically; a new "
                                                                          "path unless --overwrite)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing --output file."),
    ) -> None:
        """The bad-batch ledger: every data row a skipped bad step or a rollback left out."""
        if fmt not in ("table", "csv", "json", "jsonl"):
            raise typer.BadParameter(f"expected table, csv, json or jsonl, got {fmt!r}", param_hint="--format")
        raise typer.Exit(run_ledger(run_id, global_, fmt, output, overwrite))
