"""`apr calibration ls` and `apr calibration show ID`: the probe results kept by `apr train plan
--probe` (apr/track/calibration.py; docs/plan.md, "Probe")."""

from __future__ import annotations

import json
import sys
import time

import typer

from apr.cli.render import error_exit
from apr.cli.table import text_table
from apr.errors import AprError, Finding
from apr.fmt import format_bytes, safe_text


def _summary(row: dict) -> dict:
    r, arch = row["result"], row["shape"]["architecture"]
    return {"id": row["id"], "source": r.get("source", "probe"), "run_id": r.get("run_id"), "time": row["time"],
            "device": row["device"], "device_name": row["device_name"],
            "torch": row["torch"], "cuda": row["cuda"], "apr": row["apr"], "shape_key": row["shape_key"],
            "model": f"{arch['num_hidden_layers']}x{arch['hidden_size']}",
            "batch": f"{row['shape']['batch_size']}x{row['shape']['seq_len']}",
            "tokens_per_s": r["tokens_per_s"], "step_seconds": r["step_seconds"],
            "transient_bytes": r.get("transient_bytes"), "modelled_transient_bytes": r.get("modelled_transient_bytes"),
            "threads": r.get("threads"), "load": r.get("load"), "estimated_seconds": r.get("estimated_seconds"),
            "low_seconds": r.get("low_seconds"), "high_seconds": r.get("high_seconds"),
            "actual_seconds": r.get("actual_seconds"), "inside_range": r.get("inside_range")}


def _warn_skipped() -> None:
    """Rows the store could not use, named on stderr (they never stop a listing or a plan)."""
    from apr.track.calibration import skipped_warnings

    for line in skipped_warnings():
        print(f"warning: {safe_text(line)}", file=sys.stderr)


def run_ls(json_out: bool) -> int:
    from apr.track.calibration import list_calibrations

    rows = [_summary(r) for r in list_calibrations()]
    _warn_skipped()
    if json_out:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    if not rows:
        print("no calibrations recorded (apr train plan CONFIG --probe records one)", file=sys.stderr)
        return 0
    def size(value) -> str:
        return format_bytes(value) if value is not None else "-"

    def versus(r: dict) -> str:  # a finished run: its actual seconds against its plan's estimate
        if r["actual_seconds"] is None or r["estimated_seconds"] is None:
            return "-"
        inside = "" if r["inside_range"] is None else (" in" if r["inside_range"] else " OUT")
        return f"{r['actual_seconds']:.0f}/{r['estimated_seconds']:.0f} s{inside}"

    print(text_table(["ID", "SOURCE", "DATE", "DEVICE", "MODEL", "BATCH", "THREADS", "TOK/S", "ACTUAL/EST",
                      "TRANSIENT", "MODELLED", "TORCH", "APR"], [
        [str(r["id"]), r["source"], time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["time"])),
         safe_text(r["device_name"]), r["model"], r["batch"], str(r["threads"] or "-"), f"{r['tokens_per_s']:,.0f}",
         versus(r), size(r["transient_bytes"]), size(r["modelled_transient_bytes"]), safe_text(r["torch"] or "-"),
         safe_text(r["apr"])]
        for r in rows]))
    return 0


def run_show(calibration_id: int, json_out: bool) -> int:
    from apr.track.calibration import list_calibrations

    found = [r for r in list_calibrations() if r["id"] == calibration_id]
    _warn_skipped()
    if not found:
        message = f"no calibration {calibration_id} in the global registry (apr calibration ls lists them)"
        return error_exit(AprError(message, [Finding("error", "calibration.not_found", message,
                                                     got=str(calibration_id))]))
    row = found[0]
    if json_out:
        sys.stdout.write(json.dumps(row, indent=2) + "\n")
        return 0
    s = _summary(row)
    print(f"calibration {s['id']}  {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(s['time']))} UTC  "
          f"from {'run ' + safe_text(s['run_id']) if s['source'] == 'run' else 'a probe'}")
    print(f"device      {safe_text(s['device'])} {safe_text(s['device_name'])}")
    print(f"versions    torch {safe_text(s['torch'] or '-')}, cuda {safe_text(s['cuda'] or '-')}, "
          f"apr {safe_text(s['apr'])}")
    print(f"shape       model {s['model']}, micro-batch {s['batch']} (key {s['shape_key']})")
    print(f"speed       {s['step_seconds']:.4f} s/step, {s['tokens_per_s']:,.1f} tokens/s")
    if s["threads"] is not None:
        print(f"threads     {s['threads']}" + (f", load {s['load']:.1f} at the start" if s["load"] is not None else ""))
    if s["actual_seconds"] is not None and s["estimated_seconds"] is not None:
        span = (f" (range {s['low_seconds']:.1f}-{s['high_seconds']:.1f} s: "
                f"{'inside' if s['inside_range'] else 'outside'})" if s["low_seconds"] is not None else "")
        print(f"time        {s['actual_seconds']:.1f} s actual against ~{s['estimated_seconds']:.1f} s estimated{span}")
    for r in row["result"]["rows"]:
        modelled = format_bytes(r["modelled"]) if r["modelled"] is not None else "-"
        print(f"  {r['component']:<20} modelled {modelled:>12}  measured {format_bytes(r['measured']):>12}")
    return 0


def register(app: typer.Typer) -> None:
    @app.command("ls")
    def ls(json_out: bool = typer.Option(False, "--json", help="Print a JSON array.")) -> None:
        """List the probe results kept in the global registry, oldest first."""
        raise typer.Exit(run_ls(json_out))

    @app.command("show")
    def show(calibration_id: int = typer.Argument(..., metavar="ID", help="A calibration id (apr calibration ls)."),
             json_out: bool = typer.Option(False, "--json", help="Print the whole record as JSON.")) -> None:
        """One probe result: device, versions, shape, speed, memory measured beside modelled."""
        raise typer.Exit(run_show(calibration_id, json_out))
