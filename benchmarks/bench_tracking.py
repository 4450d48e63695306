"""Cost of the run records (docs/performance.md, "Run records").

1. recorder: what RunRecorder costs a training step at log_interval 1 with the demo config
   (configs/train/demo-tiny.yaml, its alert included): the training thread's time in
   log_step + check_alerts, the background writer's CPU time, and both as a share of a step
   shaped like the demo's (a small torch transformer step, batch 16 x seq 128, d 128, 2 layers).
   It also times the same steps with and without the recorder (wall clock; noisy on a shared box).
2. registry: builds a global registry with 10,000 runs and 1,000,000 metric rows, then times
   `list_runs(global_=True)` in-process and `apr runs ls --global --json` as a subprocess.

    .venv/bin/python benchmarks/bench_tracking.py [--steps 40] [--runs 10000] [--rows 1000000] [--skip-torch]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _demo_config():
    from apr.config import load_config

    loaded = load_config(REPO / "configs" / "train" / "demo-tiny.yaml")
    cfg = loaded.config
    cfg.training.log_interval = 1
    return cfg, loaded.config_hash


def _recorder(tmp: Path, name: str):
    from apr.track.recorder import RunRecorder

    cfg, chash = _demo_config()
    return RunRecorder(tmp / name, cfg, config_hash=chash, total_steps=100_000, tokens_per_step=16 * 128,
                       apr_home=tmp / "home", config_path="configs/train/demo-tiny.yaml", model_params=500_000)


def _instrument(rec) -> dict:
    """Accumulate the background writer's CPU time (thread_time) and pass count."""
    stats = {"cpu_s": 0.0, "passes": 0, "max_s": 0.0}
    work = rec._work

    def timed():
        t0 = time.thread_time()
        try:
            work()
        finally:
            dt = time.thread_time() - t0
            stats["cpu_s"] += dt
            stats["max_s"] = max(stats["max_s"], dt)
            stats["passes"] += 1

    rec._work = timed
    return stats


def _metrics(step: int, loss: float) -> dict:
    return {"loss": loss, "lr": 3e-3, "grad_norm": 0.8, "tokens_per_s": 9000.0, "tokens_seen": step * 2048,
            "epoch": step / 1000, "step": step}


def bench_calls(tmp: Path, n: int = 3000) -> dict:
    """Training-thread cost of log_step + check_alerts with nothing else running."""
    rec = _recorder(tmp, "calls")
    stats = _instrument(rec)
    rec.start()
    samples = []
    for step in range(1, n + 1):
        m = _metrics(step, 3.0)
        t0 = time.perf_counter()
        rec.log_step(step, m)
        rec.check_alerts(m)
        samples.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    rec.finish("finished")
    finish_s = time.perf_counter() - t0
    samples.sort()
    return {
        "calls": n,
        "median_us": statistics.median(samples) * 1e6,
        "mean_us": statistics.fmean(samples) * 1e6,
        "p99_us": samples[int(0.99 * n)] * 1e6,
        "writer_passes": stats["passes"],
        "writer_cpu_us_per_pass": stats["cpu_s"] / max(stats["passes"], 1) * 1e6,
        "finish_s": finish_s,
        "warnings": rec.warnings,
    }


def _demo_step_fn():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    vocab, d, layers, batch, seq = 2048, 128, 2, 16, 128
    emb = nn.Embedding(vocab, d)
    body = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 384, batch_first=True, dropout=0.0), layers)
    params = list(emb.parameters()) + list(body.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    mask = nn.Transformer.generate_square_subsequent_mask(seq)
    x = torch.randint(0, vocab, (batch, seq + 1))

    def step() -> float:
        h = body(emb(x[:, :-1]), mask=mask, is_causal=True)
        loss = nn.functional.cross_entropy((h @ emb.weight.T).reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def bench_steps(tmp: Path, steps: int) -> dict:
    """Demo-shaped torch steps, alternating blocks with and without the recorder."""
    step_fn = _demo_step_fn()
    for _ in range(3):
        step_fn()
    rec = _recorder(tmp, "steps")
    stats = _instrument(rec)
    rec.start()
    plain, recorded, rec_main = [], [], []
    n = 0
    for block in range(2 * (steps // 5)):
        with_rec = block % 2 == 1
        for _ in range(5):
            n += 1
            t0 = time.perf_counter()
            loss = step_fn()
            t1 = time.perf_counter()
            if with_rec:
                m = _metrics(n, loss)
                rec.log_step(n, m)
                rec.check_alerts(m)
                rec_main.append(time.perf_counter() - t1)
                recorded.append(time.perf_counter() - t0)
            else:
                plain.append(time.perf_counter() - t0)
    rec.finish("finished")
    step_s = statistics.median(plain)
    main_us = statistics.fmean(rec_main) * 1e6
    main_median_us = statistics.median(rec_main) * 1e6
    worker_us = stats["cpu_s"] / max(len(recorded), 1) * 1e6
    return {
        "steps_each": len(plain),
        "plain_step_ms_median": step_s * 1e3,
        "recorded_step_ms_median": statistics.median(recorded) * 1e3,
        "recorder_main_thread_us_per_step": main_us,
        "recorder_main_thread_us_median": main_median_us,
        "recorder_writer_cpu_us_per_step": worker_us,
        "recorder_writer_passes": stats["passes"],
        "recorder_writer_max_pass_ms": stats["max_s"] * 1e3,
        "recorder_share_of_step_pct": (main_us + worker_us) / (step_s * 1e6) * 100,
        "wall_clock_delta_pct": (statistics.median(recorded) / step_s - 1) * 100,
    }


def build_registry(home: Path, runs: int, rows: int) -> Path:
    """A registry with `runs` runs and `rows` metric rows, shaped like real ones."""
    from apr.track.store import Batch, StoreWriter, flatten_params

    cfg, chash = _demo_config()
    params = flatten_params(cfg.model_dump(mode="json"))
    db = home / "experiments.db"
    w = StoreWriter(db)
    w.write(Batch(run={"id": "00000000-000000-000000", "experiment": "warmup", "status": "finished"},
                  register={"params": params}))
    conn = w.db.conn
    now = time.time()
    per_run = max(rows // runs, 1)
    statuses = ["finished"] * 8 + ["failed", "running"]
    conn.execute("BEGIN")
    conn.execute("DELETE FROM runs")
    conn.executemany("INSERT OR IGNORE INTO experiments (name, created) VALUES (?, ?)",
                     [(f"exp-{e}", now) for e in range(50)])
    run_rows, metric_rows, param_rows = [], [], []
    for i in range(runs):
        rid = f"20260101-{i // 3600 % 24:02d}{i // 60 % 60:02d}{i % 60:02d}-{i:06x}"
        started = now - (runs - i) * 600
        status = statuses[i % len(statuses)]
        run_rows.append((rid, f"exp-{i % 50}", status, chash, started, None if status == "running" else started + 500,
                         started + 500, 1.0, "gpu-box", 1000 + i, f"/runs/{rid}", "cfg.yaml", per_run * 10, 5000,
                         2.5, 2.7, per_run * 20480, 500_000))
        for k in range(per_run):
            key = ("loss", "lr", "grad_norm", "tokens_per_s")[k % 4]
            metric_rows.append((rid, (k // 4 + 1) * 10, key, 3.0 - k * 1e-3, started + k))
        if i % 100 == 0:  # params for a sample of runs keeps the build quick; ls never reads them
            param_rows.extend((rid, key, v, t) for key, (v, t) in params.items())
    conn.executemany("INSERT INTO runs (id, experiment, status, config_hash, started, ended, heartbeat, log_period_s,"
                     " host, pid, output_dir, config_path, step, total_steps, last_loss, last_val_loss, tokens_seen,"
                     " model_params) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)", run_rows)
    conn.executemany("INSERT INTO metrics (run_id, step, key, value, time) VALUES (?,?,?,?,?)", metric_rows)
    conn.executemany("INSERT OR REPLACE INTO params (run_id, key, value, type) VALUES (?,?,?,?)", param_rows)
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("ANALYZE")
    w.close()
    return db


def bench_registry(tmp: Path, runs: int, rows: int) -> dict:
    from apr.track.runs import list_runs

    home = tmp / "registry-home"
    home.mkdir()
    t0 = time.perf_counter()
    db = build_registry(home, runs, rows)
    build_s = time.perf_counter() - t0
    import sqlite3

    conn = sqlite3.connect(db)
    counts = (conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0],
              conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0])
    conn.close()

    def timed(fn, repeat=5):
        out = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    inproc = timed(lambda: json.dumps(list_runs(global_=True, apr_home=home).runs))
    inproc_running = timed(lambda: list_runs(global_=True, apr_home=home, status="running"))
    env = {**os.environ, "APR_HOME": str(home), "NO_COLOR": "1"}
    apr = str(Path(sys.executable).parent / "apr")

    def cli(*args):
        p = subprocess.run([apr, *args], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        return p.stdout

    n_listed = len(json.loads(cli("runs", "ls", "--global", "--json")))
    cli_s = timed(lambda: cli("runs", "ls", "--global", "--json"))
    cli_version_s = timed(lambda: subprocess.run([apr, "--version"], env=env, capture_output=True))
    fast = [sys.executable, "-c", "import sys; from apr.cli.cmd_runs import fast_path; "
            "sys.exit(fast_path(['runs','ls','--global','--json']))"]
    fast_s = timed(lambda: subprocess.run(fast, env=env, capture_output=True, check=True))
    show_s = timed(lambda: cli("runs", "show", "20260101-000000-000000", "--global", "--json"))
    return {
        "runs": counts[0],
        "metric_rows": counts[1],
        "db_mib": db.stat().st_size / 2**20,
        "build_s": build_s,
        "listed": n_listed,
        "list_runs_inprocess_s": inproc,
        "list_runs_status_running_inprocess_s": inproc_running,
        "cli_runs_ls_global_json_s": cli_s,
        "cli_apr_version_s": cli_version_s,
        "typer_free_fast_path_s": fast_s,
        "cli_runs_show_s": show_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="torch steps with and without the recorder (each)")
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ["APR_HOME"] = str(tmp / "home")
        results = {"calls": bench_calls(tmp)}
        print(json.dumps({"calls": results["calls"]}, indent=2), flush=True)
        if not args.skip_torch:
            results["steps"] = bench_steps(tmp, args.steps)
            print(json.dumps({"steps": results["steps"]}, indent=2), flush=True)
        results["registry"] = bench_registry(tmp, args.runs, args.rows)
        print(json.dumps({"registry": results["registry"]}, indent=2), flush=True)


if __name__ == "__main__":
    main()
