"""Each row's loss at the logged steps (apr/train/blame.py): recorded in the local store's
``row_losses`` for every logged step, one entry per row of the step (every micro-batch), located in
the data; the rows' mean is the step's logged loss, on the plain walk, the clipped one (a norm
pre-pass walks the head twice) and with gradient accumulation; the step a run stops at (an early
stop, a signal) has its rows too."""

from __future__ import annotations

import os
import signal
import time

import pytest

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.track import store
from apr.train.run import ApplyOptions, prepare_run
from apr.train.stop import Stop
from tests.train.run_helpers import config_doc, make_dataset


def _train(root, hooks=(), handle_signals=False, status="finished", **training):
    doc = config_doc(root, training={"max_steps": 6, "save_interval": 6, "eval_interval": 0, "log_interval": 2,
                                     **training})
    cfg = AprConfig.model_validate(doc)
    opts = ApplyOptions(echo=lambda line: None, handle_signals=handle_signals, apr_home=root / "home",
                        hooks=list(hooks))
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=opts)
    result = run.execute()
    assert result.status == status, result.reason
    conn = store.connect_readonly(run.run_dir / ".apr" / "experiments.db")
    return conn, result.run_id


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    return tmp_path


@pytest.mark.parametrize("training", [{}, {"grad_clip": 0.5}, {"gradient_accumulation": 2}],
                         ids=["plain", "clipped", "accumulated"])
def test_each_logged_step_records_every_row_and_their_mean_is_the_steps_loss(root, training):
    conn, run_id = _train(root, **training)
    accum = training.get("gradient_accumulation", 1)
    assert store.row_loss_steps(conn, run_id) == [2, 4, 6]  # the log steps only
    losses = dict(store.metric_series(conn, run_id, "loss"))
    for step in (2, 4, 6):
        rows = store.row_losses(conn, run_id, step)
        assert len(rows) == 4 * accum  # batch_size 4, every micro-batch of the step
        assert [r["loss"] for r in rows] == sorted((r["loss"] for r in rows), reverse=True)
        assert sum(r["loss"] for r in rows) / len(rows) == pytest.approx(losses[step], rel=1e-5)
        assert {r["micro_batch"] for r in rows} == set(range((step - 1) * accum, step * accum))
        assert all(r["shard"].startswith("shard-0000") and r["shard"].endswith(".parquet") for r in rows)
        assert all(r["source"] is None for r in rows)  # one source: data.train (a mixture names its source)
        assert len({r["data_index"] for r in rows}) == len(rows)
    from apr.plan.storage import row_loss_facts  # what the plan counts is what the run recorded

    planned = row_loss_facts(AprConfig.model_validate(config_doc(root, training={
        "max_steps": 6, "log_interval": 2, **training})), 6)
    assert (planned["rows_per_logged_step"], planned["logged_steps"]) == (4 * accum, 3)
    # a row's shard and row locate its data index: two shards of 48 rows each
    for r in store.row_losses(conn, run_id, 2):
        assert r["data_index"] == r["row"] + (48 if r["shard"] == "shard-00001.parquet" else 0)
    conn.close()


class StopAfter:
    """A step hook that ends the run after step ``at``: a stop as early stopping returns one, or a
    SIGTERM to this process (a preemption)."""

    def __init__(self, at: int, how: str):
        self.at, self.how = at, how

    def after_step(self, run, report):
        if report.step != self.at:
            return None
        if self.how == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs at the next bytecode boundary
            return None
        return Stop("stopped", "stopped by a test hook", 0)


@pytest.mark.parametrize("how", ["early_stop", "signal"])
def test_the_step_a_run_stops_at_between_log_steps_has_its_rows(root, how):
    conn, run_id = _train(root, hooks=[StopAfter(3, how)], handle_signals=how == "signal", status="stopped")
    assert store.row_loss_steps(conn, run_id) == [2, 3]  # step 3 is no log step: logged as the last one
    losses = dict(store.metric_series(conn, run_id, "loss"))
    rows = store.row_losses(conn, run_id, 3)
    assert len(rows) == 4 and {r["micro_batch"] for r in rows} == {2}
    assert sum(r["loss"] for r in rows) / 4 == pytest.approx(losses[3], rel=1e-5)
    conn.close()


def test_the_global_registry_gets_no_row_losses(root):
    conn, run_id = _train(root)
    conn.close()
    registry = store.connect_readonly(root / "home" / "experiments.db")
    assert store.row_loss_steps(registry, run_id) == []
    assert store.metric_series(registry, run_id, "loss")  # the run itself is there
    registry.close()


def test_a_mixtures_rows_name_their_source(tmp_path):
    from tests.train.run_helpers import BASE, merge
    from tests.train.test_mixture_run import corpus

    corpus(tmp_path)
    sources = [{"name": n, "path": str(tmp_path / f"data/{n}/train"), "weight": w}
               for n, w in (("web", 0.5), ("code", 0.3), ("books", 0.2))]
    doc = merge(BASE, {"data": {"train": sources, "val": None},
                       "training": {"max_steps": 4, "eval_interval": 0, "save_interval": 4, "log_interval": 2,
                                    "output_dir": str(tmp_path / "run"), "epochs": 1}})
    cfg = AprConfig.model_validate(doc)
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                      options=ApplyOptions(echo=lambda line: None, handle_signals=False, apr_home=tmp_path / "h"))
    assert run.execute().status == "finished"
    conn = store.connect_readonly(run.run_dir / ".apr" / "experiments.db")
    rows = store.row_losses(conn, run.run_id, 4)
    conn.close()
    assert len(rows) == 4 and {r["source"] for r in rows} <= {"web", "code", "books"}
    assert all(r["shard"].endswith(".parquet") and "/" not in r["shard"] for r in rows)


def test_two_gloo_ranks_record_every_ranks_rows(root):
    """Under DDP every rank's rows of a logged step are in the record (one all-reduce), each row once."""
    import os
    import subprocess
    import sys

    from tests.train.run_helpers import write_config

    cfg = write_config(root, training={"max_steps": 4, "save_interval": 4, "eval_interval": 0, "log_interval": 2})
    env = {**os.environ, "APR_HOME": str(root / "home"), "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "60"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "apr", "train", "apply", str(cfg)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    conn = store.connect_readonly(root / "run" / ".apr" / "experiments.db")
    (run_id,) = [r["id"] for r in store.query_runs(conn)]
    assert store.row_loss_steps(conn, run_id) == [2, 4]
    losses = dict(store.metric_series(conn, run_id, "loss"))
    for step in (2, 4):
        rows = store.row_losses(conn, run_id, step)
        assert len(rows) == 2 * 4 and len({r["data_index"] for r in rows}) == 8  # batch 4 on each of 2 ranks
        assert {r["micro_batch"] for r in rows} == {step - 1}
        assert sum(r["loss"] for r in rows) / 8 == pytest.approx(losses[step], rel=1e-5)  # the ranks' mean
    conn.close()
