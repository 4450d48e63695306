"""CPU use of `apr monitor` while it watches a running training (docs/performance.md, "Monitor").

Issue 9's target: under 5% of one core at the default refresh (1000 ms). The script starts a real
training in the background (`apr train apply`, a tiny CPU model at `log_interval: 1`, so the state
file changes between every two refreshes: the monitor's worst case), then runs the monitor in a
pseudo-terminal (80x24, TERM=xterm) exactly as a user would, and reads the monitor process's CPU
time from /proc before and after a measuring window that starts once the dashboard is up. It also
counts the bytes the monitor writes to the terminal (what an SSH link carries).

Cases (each its own monitor process):
  dashboard-live   `apr monitor RUN_DIR` on the running training          (the target)
  dashboard-idle   `apr monitor RUN_DIR` on a finished run (nothing changes)
  json-follow      `apr monitor --json --follow RUN_DIR` on the running training
  web-live         `apr monitor RUN_DIR --web` on the running training with one viewer: a websocket
                   client reading the screen as the page's xterm.js does; CPU of the server and
                   the dashboard process it runs for that viewer, together (issue 22's target:
                   under 5% of a core per viewer)

    .venv/bin/python benchmarks/bench_monitor.py [--seconds 30] [--warmup 4] [--refresh MS] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "train"))  # the run-loop tests' tiny dataset and config

TARGET_PCT = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_training(root: Path, env: dict, steps: int) -> tuple[subprocess.Popen, Path]:
    from run_helpers import make_dataset, write_config

    make_dataset(root, train_rows=4000)  # 1,000 steps per epoch
    cfg = write_config(root, training={"epochs": max(1, steps // 1000 + 1), "max_steps": steps, "log_interval": 1,
                                       "eval_interval": 0, "save_interval": 100_000})
    log = open(root / "train.log", "w")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "apr", "train", "apply", str(cfg)], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    run_dir = root / "run"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if json.loads((run_dir / "training_state.json").read_text()).get("step", 0) > 0:
                return proc, run_dir
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"training exited {proc.returncode}: {(root / 'train.log').read_text()}")
        time.sleep(0.2)
    raise SystemExit("training did not start within 120 s")


def measure(args: list[str], env: dict, seconds: float, warmup: float, pty: bool, state: Path) -> dict:
    """Run `apr monitor ARGS`, let it start, then measure CPU and output over ``seconds``."""
    import pexpect

    cmd = [sys.executable, "-m", "apr", "monitor", *args]
    if pty:
        child = pexpect.spawn(cmd[0], cmd[1:], env=env, dimensions=(24, 80), encoding="utf-8",
                              codec_errors="replace")
        pid = child.pid

        def drain(timeout: float) -> int:
            try:
                return len(child.read_nonblocking(1 << 16, timeout=timeout).encode("utf-8"))
            except pexpect.TIMEOUT:
                return 0
    else:
        child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        pid = child.pid
        os.set_blocking(child.stdout.fileno(), False)

        def drain(timeout: float) -> int:
            time.sleep(timeout)
            try:
                return len(child.stdout.read() or b"")
            except (BlockingIOError, TypeError):
                return 0

    t_start, cpu_start = time.monotonic(), cpu_seconds(pid)
    while time.monotonic() - t_start < warmup:
        drain(0.1)
    t0, cpu0, nbytes = time.monotonic(), cpu_seconds(pid), 0
    step0 = json.loads(state.read_text()).get("step")
    while time.monotonic() - t0 < seconds:
        nbytes += drain(0.1)
    t1, cpu1 = time.monotonic(), cpu_seconds(pid)
    step1 = json.loads(state.read_text()).get("step")
    if pty:
        child.send("q")
        try:
            child.expect(pexpect.EOF, timeout=20)
        finally:
            child.close(force=True)
    else:
        child.send_signal(signal.SIGINT)
        child.wait(timeout=20)
    wall = t1 - t0
    return {
        "cpu_pct_of_one_core": round(100.0 * (cpu1 - cpu0) / wall, 2),
        "startup_cpu_s": round(cpu0 - cpu_start, 2),
        "window_s": round(wall, 1),
        "output_bytes_per_s": round(nbytes / wall),
        "steps_during_window": None if step0 is None or step1 is None else step1 - step0,
    }


def _family_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and all its descendants (the dashboard textual-serve runs per viewer)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def measure_web(run_dir: Path, env: dict, seconds: float, warmup: float, state: Path, refresh: list[str]) -> dict:
    """`apr monitor RUN_DIR --web` with one websocket viewer: CPU of the server + its dashboard."""
    import asyncio
    import socket
    import threading

    import aiohttp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "apr", "monitor", str(run_dir), "--web", "--port", str(port),
                               *refresh], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    started = server.stdout.readline()  # names the URL with its token (apr monitor --web)
    found = re.search(r"[?&]token=([\w-]+)", started)
    token = f"&token={found.group(1)}" if found else ""
    received = [0]
    stop = threading.Event()

    async def viewer():
        for _ in range(100):
            try:
                async with aiohttp.ClientSession() as session:
                    async with session.ws_connect(f"http://127.0.0.1:{port}/ws?width=80&height=24{token}") as ws:
                        while not stop.is_set():
                            try:
                                msg = await ws.receive(timeout=0.2)
                            except TimeoutError:
                                continue
                            if msg.type == aiohttp.WSMsgType.BINARY:
                                received[0] += len(msg.data)
                            elif msg.type != aiohttp.WSMsgType.TEXT:
                                return
                return
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)

    thread = threading.Thread(target=lambda: asyncio.run(viewer()), daemon=True)
    cpu_start = _family_cpu(server.pid)
    thread.start()
    time.sleep(warmup)
    t0, cpu0, bytes0 = time.monotonic(), _family_cpu(server.pid), received[0]
    step0 = json.loads(state.read_text()).get("step")
    time.sleep(seconds)
    t1, cpu1, bytes1 = time.monotonic(), _family_cpu(server.pid), received[0]
    step1 = json.loads(state.read_text()).get("step")
    stop.set()
    thread.join(timeout=10)
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    wall = t1 - t0
    return {
        "cpu_pct_of_one_core": round(100.0 * (cpu1 - cpu0) / wall, 2),
        "startup_cpu_s": round(cpu0 - cpu_start, 2),
        "window_s": round(wall, 1),
        "output_bytes_per_s": round((bytes1 - bytes0) / wall),
        "steps_during_window": None if step0 is None or step1 is None else step1 - step0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0, help="measuring window per case")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds for the monitor to start before measuring")
    ap.add_argument("--refresh", type=int, default=None, help="--refresh MS for the monitor (default: its default)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    refresh = [] if args.refresh is None else ["--refresh", str(args.refresh)]
    results: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "date": datetime.date.today().isoformat(),
        "refresh_ms": args.refresh or 1000,
        "target_pct": TARGET_PCT,
    }
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        env = {**os.environ, "APR_HOME": str(root / "apr-home"), "TERM": "xterm", "OMP_NUM_THREADS": "1"}
        env.pop("NO_COLOR", None)  # colours on: the more expensive rendering
        steps = 1_000_000
        trainer, run_dir = start_training(root, env, steps)
        try:
            state = run_dir / "training_state.json"
            results["dashboard-live"] = measure([str(run_dir), *refresh], env, args.seconds, args.warmup, True,
                                                state)
            results["json-follow"] = measure(["--json", "--follow", "--no-history", str(run_dir), *refresh], env,
                                             args.seconds, args.warmup, False, state)
            results["web-live"] = measure_web(run_dir, env, args.seconds, args.warmup, state, refresh)
        finally:
            trainer.send_signal(signal.SIGINT)  # stops after this step, checkpoint, status "stopped"
            try:
                trainer.wait(timeout=120)
            except subprocess.TimeoutExpired:
                trainer.kill()
                trainer.wait()
        results["dashboard-idle"] = measure([str(run_dir), *refresh], env, args.seconds, args.warmup, True,
                                            run_dir / "training_state.json")
    live = results["dashboard-live"]["cpu_pct_of_one_core"]
    results["ok"] = live < TARGET_PCT
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"apr monitor at {results['refresh_ms']} ms refresh, 80x24, TERM=xterm; {results['machine']}; "
          f"{results['date']}")
    for case in ("dashboard-live", "dashboard-idle", "json-follow", "web-live"):
        r = results[case]
        steps = "" if r["steps_during_window"] is None else f", training advanced {r['steps_during_window']} steps"
        print(f"  {case:<15} {r['cpu_pct_of_one_core']:5.2f}% of one core over {r['window_s']} s "
              f"(start-up {r['startup_cpu_s']} s CPU), {r['output_bytes_per_s']} B/s to the terminal{steps}")
    print(f"dashboard on a running training: {live:.2f}% (target < {TARGET_PCT}%): "
          f"{'ok' if results['ok'] else 'TOO MUCH'}")
    web = results["web-live"]["cpu_pct_of_one_core"]
    print(f"--web, one viewer, server + its dashboard: {web:.2f}% (target < {TARGET_PCT}% per viewer): "
          f"{'ok' if web < TARGET_PCT else 'TOO MUCH'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
