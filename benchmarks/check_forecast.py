"""The forecast-in-band check (docs/performance.md, "Forecast: the final loss from 30% of the run").

Trains the CPU demo (configs/train/demo-tiny.yaml: 200 steps, a third of an epoch of its corpus)
and the same model 5x longer (1000 steps: 1.66 epochs, so its second epoch reads rows again), each
validating 20 times (every 5% of the steps: the demo's own ``eval_interval: 50`` gives 1 validation
by 30% of its steps, and the forecast needs 4). From each run's validation losses up to 30% of its
steps, the forecast (apr/track/forecast.py: what `apr runs show`, the monitor and the progress line
show at that point) of the final validation loss and its band; then whether the band holds the
run's final validation loss, and how many of the forecasts made at every validation before the last
held it. Writes a plot of both curves (``forecast.svg``, hand-written SVG: no plotting library
needed) and ``forecast.json``.

The data is the demo's (`make demo` steps 1-2: a BPE tokenizer and shards of Python's standard
library), made in ``OUT/data`` unless ``--data`` names a folder holding ``tokenizer.json`` and
``data/{train,val}`` (e.g. ``demo-run``). ``--reuse`` reads runs already finished in ``OUT`` instead of
training again (to redraw the plot). ``--budget S`` bounds the training time of one call: a run
still going then is stopped (SIGTERM: a checkpoint of its step) and the next call resumes it, bitwise
as if it had not stopped (the script exits 2 meanwhile).

    .venv/bin/python benchmarks/check_forecast.py [--out /tmp/apr-forecast] [--data demo-run]
        [--lengths 1,5] [--at 0.3] [--reuse] [--budget S] [--svg docs/img/forecast-check.svg] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from apr.track.forecast import forecast  # noqa: E402

DEMO = REPO / "configs" / "train" / "demo-tiny.yaml"
VALIDATIONS = 20


def apr(*args: str, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "apr", *args], check=True, env=env, cwd=REPO,
                   stdout=subprocess.DEVNULL)


def make_data(out: Path, env: dict) -> Path:
    """The demo's tokenizer and shards (scripts/demo.sh steps 1-2) in ``out``."""
    if not (out / "tokenizer.json").is_file():
        apr("data", "train-tokenizer", "--builtin", "stdlib", "--vocab-size", "2048", "--overwrite",
            "--out", str(out / "tokenizer.json"), env=env)
    if not (out / "data" / "train").is_dir():
        apr("data", "pretokenize", "--builtin", "stdlib", "--tokenizer", str(out / "tokenizer.json"),
            "--seq-len", "128", "--val-fraction", "0.05", "--seed", "0", "--overwrite", "--out", str(out / "data"),
            env=env)
    return out


def train(factor: int, data: Path, out: Path, env: dict, reuse: bool, budget: float | None) -> tuple[dict, float]:
    """The demo ``factor`` times longer, validating every 5% of its steps: its training_state.json and
    the seconds this call trained. A run stopped by ``budget`` (SIGTERM: it finishes its step and
    writes a checkpoint) is resumed by the next call, bitwise as if it had not stopped."""
    run_dir = out / f"demo-{factor}x"
    state_file = run_dir / "training_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    if reuse and state.get("status") == "finished":
        return state, 0.0
    config = out / f"demo-{factor}x.yaml"
    resume = state.get("status") == "stopped" and config.is_file()
    if not resume:
        doc = yaml.safe_load(DEMO.read_text())
        steps = doc["training"]["max_steps"] * factor
        doc["data"].update(train=str(data / "data" / "train"), val=str(data / "data" / "val"),
                           tokenizer=str(data / "tokenizer.json"))
        doc["training"].update(max_steps=steps, epochs=factor + 1, eval_interval=steps // VALIDATIONS,
                               save_interval=steps, output_dir=str(run_dir))
        doc["monitoring"]["tracking"]["experiment"] = "forecast-check"
        config.write_text(yaml.safe_dump(doc, sort_keys=False))
        if run_dir.exists():
            shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "apr", "train", "apply", str(config),
                             *(["--resume", "latest"] if resume else [])], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL)
    try:
        code = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    if code not in (0, 143):
        raise SystemExit(f"apr train apply {config} exited {code}")
    return json.loads(state_file.read_text()), time.perf_counter() - t0


def check(state: dict, at: float) -> dict:
    """The forecast made at ``at`` of the steps against the final validation loss."""
    total = int(state["total_steps"])
    history = [(int(s), float(v)) for s, v in state["val_loss_history"]]
    cut = int(at * total)
    ahead = forecast([(s, v) for s, v in history if s <= cut], total)
    final_step, final = history[-1]
    out = {"total_steps": total, "forecast_at_step": cut, "final_step": final_step, "final_val_loss": final,
           "history": history, "forecast": None if ahead is None else ahead.to_dict()}
    if ahead is not None:
        out["inside"] = final_step == total and ahead.contains(final)
        out["error"] = ahead.loss - final  # forecast minus the final loss
        out["half_band"] = (ahead.high - ahead.low) / 2
        out["outside_by"] = max(ahead.low - final, final - ahead.high, 0.0)
    later = [forecast([p for p in history if p[0] <= s], total) for s, _ in history if 0 < s < total]
    out["held_from_each_validation"] = [sum(f.contains(final) for f in later if f), sum(1 for f in later if f)]
    return out


def svg(results: dict[str, dict], at: float) -> str:
    """One panel per run: the validation losses (filled: the forecast's input), the fitted law from
    there to the last step, its band at the last step, and the final loss."""
    w, h, pad = 420, 300, 48
    panels = []
    for i, (name, r) in enumerate(results.items()):
        x0 = i * w
        steps = [s for s, _ in r["history"] if s > 0]
        losses = [v for s, v in r["history"] if s > 0]
        f = r["forecast"]
        lo = min(losses + ([f["low"]] if f else []))
        hi = max(losses)
        lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)
        total = r["total_steps"]

        def px(s, x0=x0, total=total):
            return x0 + pad + (s / total) * (w - 1.5 * pad)

        def py(v, lo=lo, hi=hi):
            return pad / 2 + (hi - v) / (hi - lo) * (h - 1.5 * pad)

        items = [f'<rect x="{x0 + pad}" y="{pad / 2}" width="{w - 1.5 * pad}" height="{h - 1.5 * pad}" '
                 'fill="none" stroke="#999"/>',
                 f'<text x="{x0 + pad}" y="16" font-size="12">{name}: {total} steps, forecast at step '
                 f'{r["forecast_at_step"]} ({at:.0%})</text>',
                 f'<line x1="{px(r["forecast_at_step"]):.1f}" y1="{pad / 2}" x2="{px(r["forecast_at_step"]):.1f}" '
                 f'y2="{h - pad}" stroke="#bbb" stroke-dasharray="3,3"/>']
        for tick in (lo, (lo + hi) / 2, hi):
            items.append(f'<text x="{x0 + pad - 4}" y="{py(tick) + 4:.1f}" font-size="10" '
                         f'text-anchor="end">{tick:.2f}</text>')
        for tick in (0, total // 2, total):
            items.append(f'<text x="{px(tick):.1f}" y="{h - pad + 14}" font-size="10" '
                         f'text-anchor="middle">{tick}</text>')
        if f:
            curve = " ".join(f"{px(s):.1f},{py(f['floor'] + f['scale'] * s ** -f['alpha']):.1f}"
                             for s in range(max(1, steps[0]), total + 1, max(1, total // 100)))
            items.append(f'<polyline points="{curve}" fill="none" stroke="#d62728" stroke-width="1.5"/>')
            items.append(f'<line x1="{px(total) - 6:.1f}" y1="{py(f["low"]):.1f}" x2="{px(total) - 6:.1f}" '
                         f'y2="{py(f["high"]):.1f}" stroke="#d62728" stroke-width="5" opacity="0.4"/>')
            items.append(f'<line x1="{px(total) - 12:.1f}" y1="{py(f["loss"]):.1f}" x2="{px(total):.1f}" '
                         f'y2="{py(f["loss"]):.1f}" stroke="#d62728" stroke-width="2"/>')
        for s, v in zip(steps, losses, strict=True):
            used = s <= r["forecast_at_step"]
            items.append(f'<circle cx="{px(s):.1f}" cy="{py(v):.1f}" r="3" stroke="#1f77b4" '
                         f'fill="{"#1f77b4" if used else "white"}"/>')
        items.append(f'<circle cx="{px(r["final_step"]):.1f}" cy="{py(r["final_val_loss"]):.1f}" r="5" '
                     'fill="none" stroke="black" stroke-width="1.5"/>')
        verdict = "in band" if r.get("inside") else "OUTSIDE the band"
        if f:
            items.append(f'<text x="{x0 + pad + 6}" y="{h - pad - 8}" font-size="11">forecast {f["loss"]:.3f} '
                         f'[{f["low"]:.3f}, {f["high"]:.3f}], final {r["final_val_loss"]:.3f}: {verdict}</text>')
        panels.append("\n".join(items))
    legend = (f'<text x="{pad}" y="{h + 10}" font-size="10">filled: the validations the forecast used; hollow: '
              'later ones; red: the fitted law (floor >= 0), the forecast (tick) and its band at the last step; '
              'black ring: the final loss</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{w * len(results)}" height="{h + 18}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(panels) + "\n" + legend + "\n</svg>\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/apr-forecast")
    ap.add_argument("--data", default=None, help="a folder with tokenizer.json and data/ (default: made in OUT)")
    ap.add_argument("--lengths", default="1,5", help="run lengths, in demo lengths (200 steps)")
    ap.add_argument("--at", type=float, default=0.3, help="share of the steps the forecast is made at")
    ap.add_argument("--reuse", action="store_true", help="read runs already finished in OUT instead of training")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds of training for this call: a run still going then is stopped with a checkpoint "
                         "and resumed by the next call (exit 2 meanwhile)")
    ap.add_argument("--svg", default=None, help="also write the plot here (e.g. docs/img/forecast-check.svg)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "APR_HOME": str(out / "home"), "NO_COLOR": "1"}
    data = Path(args.data).resolve() if args.data else make_data(out / "data", env)
    results, took, started = {}, {}, time.perf_counter()
    for factor in (int(x) for x in args.lengths.split(",")):
        left = None if args.budget is None else max(args.budget - (time.perf_counter() - started), 1.0)
        state, seconds = train(factor, data, out, env, args.reuse, left)
        if state.get("status") != "finished":
            print(f"demo x{factor}: stopped at step {state.get('step')} of {state.get('total_steps')} after the "
                  f"--budget; run the same command again to continue it")
            return 2
        name = "demo" if factor == 1 else f"demo x{factor}"
        results[name], took[name] = check(state, args.at), seconds
    doc = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "loadavg": [round(x, 2) for x in os.getloadavg()], "at": args.at, "runs": results, "seconds": took}
    (out / "forecast.json").write_text(json.dumps(doc, indent=1))
    plot = svg(results, args.at)
    (out / "forecast.svg").write_text(plot)
    if args.svg:
        Path(args.svg).write_text(plot)
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{doc['date']}  load {doc['loadavg']}  forecast at {args.at:.0%} of the steps")
        for name, r in results.items():
            f = r["forecast"]
            if f is None:
                print(f"{name:10s} no forecast at step {r['forecast_at_step']} (fewer than 4 validations)")
                continue
            verdict = "in band" if r["inside"] else f"OUTSIDE by {r['outside_by']:.4f}"
            print(f"{name:10s} steps {r['total_steps']:5d}  forecast at {r['forecast_at_step']:4d} ({f['points']} "
                  f"points): {f['loss']:.4f} [{f['low']:.4f}, {f['high']:.4f}]  final {r['final_val_loss']:.4f}  "
                  f"error {r['error']:+.4f}  {verdict}" + (f"  ({took[name]:.0f} s)" if took[name] else ""))
            held, made = r["held_from_each_validation"]
            print(f"{'':10s} the forecasts made at each validation before the last: {held} of {made} held it")
        print(f"plot: {out / 'forecast.svg'}" + (f" and {args.svg}" if args.svg else ""))
    return 0 if all(r.get("inside") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
