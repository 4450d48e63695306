"""How fast `apr runs ls --global --json` answers on a big registry (docs/performance.md, "Run records").

Builds a global registry ($APR_HOME/experiments.db, the real schema through `StoreWriter`) holding
``--runs`` runs (default 10,000, of 50 experiments; 80% finished, 10% failed, 10% running with a
dead heartbeat, so stale detection runs on every row) and ``--rows`` metric rows (default
1,000,000, spread evenly over the runs), then times, each as the median of ``--repeat`` fresh
processes (what a user or an agent pays, interpreter start included):

  ls_global_json     apr runs ls --global --json          (the target: under 0.5 s)
  ls_global_table    apr runs ls --global
  ls_status_stale    apr runs ls --global --json --status stale
  ls_limit_20        apr runs ls --global --json --limit 20
  show_global_json   apr runs show ID --global --json
  apr_version        apr --version                        (the floor: interpreter + CLI start)
  ls_global_json_fast_path   the same listing through apr.cli.cmd_runs.fast_path (no typer)

plus `list_runs(global_=True)` + `json.dumps` in this process (no start-up cost).

    .venv/bin/python benchmarks/bench_runs.py [--runs 10000] [--rows 1000000] [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TARGET_S = 0.5
METRIC_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s")


def run_id(i: int) -> str:
    return f"2026{1 + i // 2_000_000 % 12:02d}01-{i // 3600 % 24:02d}{i // 60 % 60:02d}{i % 60:02d}-{i:06x}"


def build_registry(home: Path, runs: int, rows: int) -> Path:
    """A registry with ``runs`` runs and ``rows`` metric rows, shaped like real ones."""
    from apr.config import load_config
    from apr.track.store import RUN_COLUMNS, Batch, StoreWriter, flatten_params

    loaded = load_config(REPO / "configs" / "train" / "demo-tiny.yaml")
    params = flatten_params(loaded.config.model_dump(mode="json"))
    db = home / "experiments.db"
    w = StoreWriter(db)
    w.write(Batch(run={"id": "bootstrap", "experiment": "bootstrap", "status": "finished"},
                  register={"params": {}}))  # creates the schema (migrations) like a first run does
    conn = w.db.conn
    now = time.time()
    per_run = max(rows // runs, 1)
    conn.execute("BEGIN")
    conn.execute("DELETE FROM params")
    conn.execute("DELETE FROM status_history")
    conn.execute("DELETE FROM runs")
    conn.execute("DELETE FROM experiments")
    conn.executemany("INSERT INTO experiments (name, created) VALUES (?, ?)",
                     [(f"exp-{e}", now) for e in range(50)])
    columns = list(RUN_COLUMNS)
    insert_run = f"INSERT INTO runs ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
    insert_metric = "INSERT INTO metrics (run_id, step, key, value, time) VALUES (?, ?, ?, ?, ?)"
    run_rows, metric_rows, status_rows = [], [], []
    for i in range(runs):
        rid = run_id(i)
        started = now - (runs - i) * 600.0
        kind = i % 10
        status = "failed" if kind == 8 else "running" if kind == 9 else "finished"
        ended = None if status == "running" else started + 500.0
        row = {
            "id": rid, "experiment": f"exp-{i % 50}", "status": status,
            "status_reason": "non-finite loss at step 1201" if status == "failed" else None,
            "config_hash": loaded.config_hash, "started": started, "ended": ended,
            "heartbeat": started + 500.0, "log_period_s": 1.0, "host": "gpu-box", "pid": 1000 + i,
            "output_dir": f"/runs/{rid}", "config_path": "configs/train/demo-tiny.yaml", "step": per_run * 10,
            "total_steps": 5000, "last_loss": 2.5, "last_val_loss": 2.7, "tokens_seen": per_run * 20480,
            "model_params": 500_000,
        }
        run_rows.append(tuple(row[c] for c in columns))
        status_rows.append((rid, "running", None, started))
        if ended is not None:
            status_rows.append((rid, status, row["status_reason"], ended))
        for k in range(per_run):
            metric_rows.append((rid, (k // 4 + 1) * 10, METRIC_KEYS[k % 4], 3.0 - k * 1e-3, started + k))
        if len(metric_rows) >= 200_000:
            conn.executemany(insert_metric, metric_rows)
            metric_rows.clear()
    conn.executemany(insert_run, run_rows)
    conn.executemany(insert_metric, metric_rows)
    conn.executemany("INSERT INTO status_history (run_id, status, reason, time) VALUES (?, ?, ?, ?)", status_rows)
    # Params of every 10th run: enough to make the file realistic; `runs ls` never reads them.
    conn.executemany("INSERT INTO params (run_id, key, value, type) VALUES (?, ?, ?, ?)",
                     ((run_id(i), k, v, t) for i in range(0, runs, 10) for k, (v, t) in params.items()))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    w.close()
    return db


def _median_s(fn, repeat: int) -> dict:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4)}


def bench(home: Path, runs: int, rows: int, repeat: int) -> dict:
    from apr.track.runs import list_runs

    t0 = time.perf_counter()
    db = build_registry(home, runs, rows)
    build_s = time.perf_counter() - t0
    conn = sqlite3.connect(db)
    n_runs = conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    n_rows = conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0]
    conn.close()

    env = {**os.environ, "APR_HOME": str(home), "NO_COLOR": "1"}
    apr = str(Path(sys.executable).parent / "apr")

    def cli(*args: str) -> str:
        p = subprocess.run([apr, *args], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"apr {' '.join(args)} exited {p.returncode}: {p.stderr}")
        return p.stdout

    listed = json.loads(cli("runs", "ls", "--global", "--json"))
    stale = json.loads(cli("runs", "ls", "--global", "--json", "--status", "stale"))
    timings = {
        "ls_global_json": _median_s(lambda: cli("runs", "ls", "--global", "--json"), repeat),
        "ls_global_table": _median_s(lambda: cli("runs", "ls", "--global"), repeat),
        "ls_status_stale": _median_s(lambda: cli("runs", "ls", "--global", "--json", "--status", "stale"), repeat),
        "ls_limit_20": _median_s(lambda: cli("runs", "ls", "--global", "--json", "--limit", "20"), repeat),
        "show_global_json": _median_s(lambda: cli("runs", "show", run_id(runs - 1), "--global", "--json"), repeat),
        "apr_version": _median_s(lambda: cli("--version"), repeat),
        # `apr.cli.cmd_runs.fast_path`, which answers `runs ls [--global] [--json]` without building
        # the typer app, as the console script would run it if apr/cli/entry.py called it.
        "ls_global_json_fast_path": _median_s(lambda: subprocess.run(
            [sys.executable, "-c", "import sys; from apr.cli.cmd_runs import fast_path; "
             "sys.exit(fast_path(['runs', 'ls', '--global', '--json']))"], env=env, capture_output=True, check=True),
            repeat),
        "in_process_list_runs_json": _median_s(
            lambda: json.dumps(list_runs(global_=True, apr_home=home).runs), repeat),
    }
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                   f"SQLite {sqlite3.sqlite_version}",
        "date": datetime.date.today().isoformat(),
        "runs": n_runs,
        "metric_rows": n_rows,
        "db_mib": round(db.stat().st_size / 2**20, 1),
        "build_s": round(build_s, 1),
        "listed": len(listed),
        "listed_stale": len(stale),
        "timings": timings,
        "target_s": TARGET_S,
        "ok": timings["ls_global_json"]["median_s"] < TARGET_S,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        home = Path(d) / "apr-home"
        home.mkdir()
        result = bench(home, args.runs, args.rows, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"registry: {result['runs']:,} runs, {result['metric_rows']:,} metric rows, {result['db_mib']} MiB "
          f"(built in {result['build_s']} s); ls lists {result['listed']:,}, {result['listed_stale']:,} stale")
    for name, t in result["timings"].items():
        print(f"  {name:<28} median {t['median_s']:.3f} s  (min {t['min_s']:.3f}, max {t['max_s']:.3f})")
    verdict = "ok" if result["ok"] else "TOO SLOW"
    print(f"apr runs ls --global --json: {result['timings']['ls_global_json']['median_s']:.3f} s "
          f"(target < {TARGET_S} s): {verdict}")
    print(f"{result['machine']}; {result['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
