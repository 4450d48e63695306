"""Data drift during training (monitoring.data_drift): the rows read so far against the rows ahead of
the cursor, as metrics in both stores, the state file and alert conditions."""

from __future__ import annotations

import json
import sqlite3

import numpy as np

from apr.apply import run_apply
from apr.data.loader import ShardLoader
from apr.data.shards import write_dataset
from apr.track.alerts import ALERT_VARIABLES
from apr.track.state import DATA_DRIFT_KEYS
from apr.train.datadrift import DataDriftCheck, metric_names
from tests.train.run_helpers import make_dataset, write_config

SEQ = 31


def _loader(tmp_path, shuffle: bool) -> ShardLoader:
    """200 rows: the first 100 draw tokens from ids 0-49, the last 100 from ids 50-99."""
    rng = np.random.default_rng(1)
    rows = np.concatenate([rng.integers(0, 50, size=(100, SEQ + 1)), rng.integers(50, 100, size=(100, SEQ + 1))])
    write_dataset(tmp_path / "d", {"train": rows.astype(np.uint32)}, {"seq_len": SEQ}, 50)
    return ShardLoader(tmp_path / "d" / "train", seq_len=SEQ, batch_size=4, shuffle=shuffle, cache_dir=False)


def test_rows_ahead_from_another_distribution_show_as_drift_and_shuffled_rows_do_not(tmp_path):
    check = DataDriftCheck(interval=1, sample_tokens=10_000, seed=0, vocab_size=100, eot_id=None)
    ordered = _loader(tmp_path, shuffle=False)
    assert check.measure(ordered, 1) is None  # nothing read yet
    for _ in range(25):  # 100 rows read: exactly the first distribution
        ordered.next_batch()
    shifted = check.measure(ordered, 25)
    assert shifted["rows_read"] == shifted["rows_ahead"] == 100
    assert shifted["data_drift_psi"] > 1.0 and shifted["data_drift_ks"] > 0.9
    shuffled = ShardLoader(tmp_path / "d" / "train", seq_len=SEQ, batch_size=4, seed=4, cache_dir=False)
    for _ in range(25):
        shuffled.next_batch()
    same = check.measure(shuffled, 25)
    assert same["data_drift_psi"] < 0.25 and same["data_drift_ks"] < 0.3 < shifted["data_drift_ks"]


def test_every_recorded_figure_is_an_alert_variable():
    names = {n for feature in ("token_rank", "doc_length") for n in metric_names(feature).values()}
    assert names == set(DATA_DRIFT_KEYS) and names <= set(ALERT_VARIABLES)


def test_a_run_records_data_drift_in_both_stores_and_alerts_on_it(tmp_path, monkeypatch):
    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 8, "eval_interval": 0},
                       monitoring={"data_drift": {"interval": 4, "sample_tokens": 256},
                                   "alerts": [{"condition": "data_drift_psi >= 0.0", "severity": "warning",
                                               "message": "drift"}]})
    lines: list[str] = []
    assert run_apply(cfg, echo=lines.append).status == "finished"
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert state["data_drift"]["step"] == 8 and state["data_drift"]["rows_read"] == 16  # 256 tokens: 16 rows of 17
    assert [a["condition"] for a in state["alerts"]] == ["data_drift_psi >= 0.0"]  # warn fires once
    for db in (tmp_path / "run" / ".apr" / "experiments.db", tmp_path / "home" / "experiments.db"):
        rows = sqlite3.connect(db).execute("SELECT step, value FROM metrics WHERE key = 'data_drift_psi'").fetchall()
        assert [s for s, _ in rows] == [4, 8] and all(v >= 0 for _, v in rows)
