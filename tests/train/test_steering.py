"""Steering a live run (apr/train/steering.py, apr/steer.py): requests written between steps are
applied at the next step boundary (on 2 gloo ranks, by both at the same step), recorded, kept in
checkpoints and replayed by a resume, so a steered run killed and resumed ends bitwise where the
uninterrupted steered run does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.errors import AprError
from apr.plan.build import resolve_config
from apr.steer import request_steer
from apr.track import store
from apr.train.run import ApplyOptions, prepare_run
from tests.distributed.ranks import run_ranks
from tests.train.run_helpers import config_doc, make_dataset


class SteerAt:
    """A hook that writes a steer request after step ``at`` (as `apr train steer` would meanwhile)."""

    def __init__(self, at: int, settings: list[str], raw: str | None = None):
        self.at, self.settings, self.raw = at, settings, raw

    def after_step(self, run, report):
        if report.step == self.at:
            if self.raw is not None:
                (run.run_dir / "steer").mkdir(exist_ok=True)
                (run.run_dir / "steer" / "000001-0.json").write_text(self.raw)
            else:
                request_steer(run.run_dir, self.settings)
        return None


class CrashAt:
    def __init__(self, at: int):
        self.at = at

    def after_step(self, run, report):
        if report.step == self.at:
            raise RuntimeError("killed")  # before this step's checkpoint, as a kill -9 would be
        return None


def _run(root, out: str, hooks, resume=None, **training):
    doc = config_doc(root, training={"max_steps": 8, "save_interval": 2, "eval_interval": 0, "log_interval": 1,
                                     "output_dir": out, **training})
    cfg = AprConfig.model_validate(doc)
    lines: list[str] = []
    opts = ApplyOptions(resume=resume, echo=lines.append, hooks=list(hooks), handle_signals=False,
                        apr_home=root / "home")
    result = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                         options=opts).execute()
    return result, lines


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    (tmp_path / "cfg.yaml").write_text("{}\n")
    return tmp_path


def _events(run_dir, kind):
    state = json.loads((run_dir / "training_state.json").read_text())
    return [e for e in state["events"] if e["kind"] == kind]


def test_a_steer_is_applied_at_the_next_step_boundary_and_recorded(root):
    result, lines = _run(root, "steered/", [SteerAt(2, ["lr_factor=0.5", "checkpoint=true"])], save_interval=100)
    assert result.status == "finished"
    (event,) = _events(root / "steered", "steer")
    assert event["step"] == 3 and event["detail"]["changes"] == {"lr_factor": 0.5, "checkpoint": True}
    assert any("steer: lr_factor=0.5, checkpoint=True" in line for line in lines)
    assert (root / "steered" / "checkpoint-step-3.json").is_file()  # checkpoint=true: after the next step
    plain, _ = _run(root, "plain/", [], save_interval=100)
    lr = {int(e["step"]): e["lr"] for e in _lrs(root / "steered")}
    lr_plain = {int(e["step"]): e["lr"] for e in _lrs(root / "plain")}
    assert lr[2] == pytest.approx(lr_plain[2]) and lr[3] == pytest.approx(lr_plain[3] * 0.5)


def _lrs(run_dir):
    state = json.loads((run_dir / "training_state.json").read_text())
    return [{"step": s, "lr": v} for s, v in state["lr_history"]]


def test_steered_killed_and_resumed_ends_bitwise_as_the_uninterrupted_steered_run(root):
    """The request lands after step 4 (a checkpoint), takes effect at step 5, and the process dies after
    step 6 before its checkpoint: the resume from step 4 replays the steer at step 5."""
    _run(root, "straight/", [SteerAt(4, ["lr_factor=0.25"])])
    with pytest.raises(RuntimeError, match="killed"):
        _run(root, "killed/", [SteerAt(4, ["lr_factor=0.25"]), CrashAt(6)])
    assert not (root / "killed" / "checkpoint-step-6.json").exists()
    result, _ = _run(root, "killed/", [], resume="latest")
    assert result.status == "finished" and result.start_step == 4
    a = load_file(str(root / "straight" / "checkpoint-step-8.safetensors"))
    b = load_file(str(root / "killed" / "checkpoint-step-8.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)
    assert [e["step"] for e in _events(root / "killed", "steer")] == [5]


def test_a_malformed_request_is_reported_and_ignored(root):
    result, lines = _run(root, "junk/", [SteerAt(2, [], raw="{not json")])
    assert result.status == "finished" and result.final_step == 8
    assert any("steer request 000001-0.json ignored" in line for line in lines)
    assert len(_events(root / "junk", "steer_rejected")) == 1
    assert (root / "junk" / "steer" / "applied" / "000001-0.rejected").is_file()


def test_stop_at_stops_after_that_step_with_a_checkpoint(root):
    result, _ = _run(root, "stopped/", [SteerAt(2, ["stop_at=5"])], save_interval=100)
    assert (result.status, result.final_step, result.exit_code) == ("stopped", 5, 0)
    assert (root / "stopped" / "checkpoint-step-5.json").is_file()


def test_keys_that_cannot_be_steered_are_refused_with_the_list(root):
    (root / "run").mkdir()
    (root / "run" / "training_state.json").write_text("{}")
    with pytest.raises(AprError, match="optimizer.beta1 cannot be steered in a live run; steerable keys: lr_factor"):
        request_steer(root / "run", ["optimizer.beta1=0.8"])
    with pytest.raises(AprError, match="lr_factor: expected a finite number > 0"):
        request_steer(root / "run", ["lr_factor=-1"])
    assert not (root / "run" / "steer").exists() or not list((root / "run" / "steer").glob("*.json"))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none"])  # DDP (the layout in the id: apr/steps/composition.py)
def test_two_gloo_ranks_apply_a_steer_at_the_same_step_and_a_resume_replays_it(root, sharding):
    """Under DDP rank 0 reads the request and sends it to every rank: both ranks train from step 3 at
    half the schedule's lr and stop after step 5 (not a log step: its rows, both ranks', are recorded
    too), and the run records the steer once. The same run killed after step 2's checkpoint resumes,
    replays the steer at step 3 on both ranks, and ends bitwise where it did."""
    worker = Path(__file__).resolve().parent / "run_worker.py"
    doc = config_doc(root, data={"batch_size": 2}, training={
        "max_steps": 8, "save_interval": 2, "log_interval": 2, "eval_interval": 0, "output_dir": "steered/",
        "sharding": sharding})
    (root / "cfg.json").write_text(json.dumps(doc))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "APR_DIST_TIMEOUT_S": "120", "APR_HOME": str(root / "home"),
           "APR_TEST_STEER": "2:lr_factor=0.5,stop_at=5"}

    def launch(lr_log: str, *resume: str) -> dict[int, dict[int, float]]:
        proc = run_ranks([str(worker), str(root / "cfg.json"), *resume], 2,
                         {**env, "APR_TEST_LR_LOG": str(root / lr_log)}, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lrs: dict[int, dict[int, float]] = {0: {}, 1: {}}
        for line in (root / lr_log).read_text().splitlines():
            rank, step, lr = line.split()
            lrs[int(rank)][int(step)] = float(lr)
        return lrs

    schedule = resolve_config(AprConfig.model_validate(doc)).schedule
    lrs = launch("lr.log")
    for rank in (0, 1):  # every rank: the schedule's lr, halved from the step after the request
        assert lrs[rank] == {s: schedule(s) * (0.5 if s >= 3 else 1.0) for s in range(1, 6)}, rank
    run = root / "steered"
    state = json.loads((run / "training_state.json").read_text())
    assert (state["status"], state["step"]) == ("stopped", 5) and "stop_at 5" in state["status_reason"]
    (event,) = _events(run, "steer")
    assert event["step"] == 3 and event["detail"]["changes"] == {"lr_factor": 0.5, "stop_at": 5}
    conn = store.connect_readonly(run / ".apr" / "experiments.db")
    (run_id,) = [r["id"] for r in store.query_runs(conn)]
    assert [(e["step"], e["detail"]["changes"]) for e in store.events(conn, run_id) if e["kind"] == "steer"] == [
        (3, {"lr_factor": 0.5, "stop_at": 5})]
    assert store.row_loss_steps(conn, run_id) == [2, 4, 5]  # the step it stopped at has its rows, both ranks'
    assert len(store.row_losses(conn, run_id, 5)) == 2 * 2
    conn.close()
    # the same run killed after step 2's checkpoint (the request applied, its later checkpoints gone)
    final = load_file(str(run / "checkpoint-step-5.safetensors"))
    for path in run.glob("checkpoint-step-[45].*"):
        path.unlink()
    env["APR_TEST_STEER"] = ""  # nothing new: the resume replays what steer/applied/ holds
    resumed = launch("lr_resumed.log", "latest")
    for rank in (0, 1):
        assert resumed[rank] == {s: schedule(s) * 0.5 for s in range(3, 6)}, rank
    again = load_file(str(run / "checkpoint-step-5.safetensors"))
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
    assert [e["step"] for e in _events(run, "steer")] == [3]
