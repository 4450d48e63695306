"""Per-block telemetry through the run loop: recorded at log steps, seen by alert conditions."""

from __future__ import annotations

import json
import sqlite3

import pytest
from run_helpers import config_doc, make_dataset

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.train.run import ApplyOptions, prepare_run


def _run(root, **sections):
    cfg = AprConfig.model_validate(config_doc(root, **sections))
    lines: list[str] = []
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(echo=lines.append))
    return run.execute(), lines


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path, train_rows=48, val_rows=8)
    return tmp_path


def _rows(root) -> dict[str, list[tuple[int, float]]]:
    conn = sqlite3.connect(root / "run" / ".apr" / "experiments.db")
    out: dict[str, list] = {}
    for step, key, value in conn.execute("SELECT step, key, value FROM metrics ORDER BY step"):
        out.setdefault(key, []).append((step, value))
    conn.close()
    return out


def test_log_steps_record_per_block_norms_and_a_block_alert_stops_the_run(root):
    result, lines = _run(root, training={"max_steps": 8, "eval_interval": 0, "save_interval": 100},
                         monitoring={"alerts": [{"condition": "block_grad_norm.exists(x, x > 0.0) && step >= 4",
                                                 "action": "stop", "message": "block spike"}]})
    assert result.status == "stopped" and result.final_step == 4 and "block spike" in result.reason
    state = json.loads((root / "run" / "training_state.json").read_text())
    norms = state["block_norms"]
    assert norms["step"] == 4
    assert len(norms["block_grad_norm"]) == len(norms["block_update_norm"]) == 2  # two decoder blocks
    assert all(x > 0 for x in norms["block_grad_norm"] + norms["block_update_norm"])
    assert norms["max_block_grad_norm"] == max(norms["block_grad_norm"])
    assert norms["embed_update_norm"] > 0 and norms["head_grad_norm"] > 0
    rows = _rows(root)
    for key in ("block_grad_norm.0", "block_grad_norm.1", "block_update_norm.1", "embed_grad_norm",
                "head_update_norm", "max_block_update_norm"):
        assert [s for s, _ in rows[key]] == [2, 4], key  # log_interval 2: the log steps only
    assert rows["block_update_norm.0"][-1][1] == pytest.approx(norms["block_update_norm"][0])


def test_block_norms_off_records_none(root):
    result, _ = _run(root, training={"max_steps": 4, "eval_interval": 0}, monitoring={"block_norms": False})
    assert result.status == "finished"
    assert json.loads((root / "run" / "training_state.json").read_text())["block_norms"] is None
    assert not any("block" in key for key in _rows(root))
