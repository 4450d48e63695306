"""Records of a real (tiny, CPU) `apr train apply` when the stores cannot be written.

Issue 8: with the global registry read-only and the local store's folder unwritable, training
finishes with exit 0, each store warns once, the failure is in training_state.json, and
`PRAGMA integrity_check` is ok on every store afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apr.track import store
from apr.track.store import Batch, StoreWriter, connect_readonly, integrity_check

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from run_helpers import make_dataset, write_config  # noqa: E402


def _earlier_run(db: Path, run_id: str) -> None:
    """A store holding one finished run, closed cleanly (no -wal file left), like after a real run."""
    w = StoreWriter(db)
    now = time.time()
    w.write(Batch(run={"id": run_id, "experiment": "earlier", "status": "finished", "started": now - 60,
                       "ended": now - 30, "heartbeat": now - 30, "step": 4, "total_steps": 4},
                  register={"params": {"optimizer.lr": (1e-3, "float")}},
                  metrics=[(run_id, s, "loss", 3.0 / s, now - 60 + s) for s in range(1, 5)]))
    w.close()


@pytest.mark.slow
def test_training_finishes_with_a_read_only_registry_and_an_unwritable_local_store(
    tmp_path, read_only, _private_apr_home
):
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 8, "eval_interval": 4, "save_interval": 4})
    run_dir = tmp_path / "run"
    registry = _private_apr_home / "experiments.db"
    local = run_dir / ".apr" / "experiments.db"
    _earlier_run(registry, "20260101-000000-aaaaaa")
    _earlier_run(local, "20260101-000000-bbbbbb")
    read_only(registry, _private_apr_home)  # the registry file and its folder
    read_only(local.parent)  # the local store's folder: no -wal / -shm can be made next to the store

    env = {**os.environ, "APR_HOME": str(_private_apr_home), "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "apr", "train", "apply", str(cfg)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("apr: warning:")]
    assert len(warnings) == 2, proc.stderr  # one per failing store, not one per step
    assert any("local experiment store" in w and str(local) in w for w in warnings)
    assert any("global experiment store" in w and str(registry) in w for w in warnings)
    assert all("training continues" in w for w in warnings)

    state = json.loads((run_dir / "training_state.json").read_text())
    assert (state["status"], state["step"], state["total_steps"]) == ("finished", 8, 8)
    assert len(state["store_warnings"]) == 2
    assert [w.removeprefix("apr: warning: ") for w in warnings] == state["store_warnings"]
    assert (run_dir / "checkpoint-step-8.safetensors").is_file()  # training really went on

    for db, earlier in ((registry, "20260101-000000-aaaaaa"), (local, "20260101-000000-bbbbbb")):
        assert integrity_check(db) == "ok"
        conn = connect_readonly(db)
        assert [r["id"] for r in store.query_runs(conn)] == [earlier]  # untouched: nothing of this run
        assert len(store.metric_series(conn, earlier, "loss")) == 4
        conn.close()
    assert not (local.parent / "experiments.db-wal").exists()

    # The read-only registry still answers `apr runs ls --global`.
    ls = subprocess.run([sys.executable, "-m", "apr", "runs", "ls", "--global", "--json"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    assert [r["run_id"] for r in json.loads(ls.stdout)] == ["20260101-000000-aaaaaa"]
