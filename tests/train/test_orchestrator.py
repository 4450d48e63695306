"""Orchestrated training (apr/train/orchestrator.py): exact speculative branches, decisions and
switches recorded in both stores and training_state.json, the safety rollback, a resume that
continues the same decisions. In-process runs of the tiny pattern dataset (tests/train/run_helpers.py)."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
from run_helpers import config_doc, make_dataset, signal_at

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.steps.resolved import resolve as plan_of
from apr.train.run import ApplyOptions, prepare_run

STALL = {"stall": {"lr_factor": 1.0e-4}}  # a strategy that barely moves: it loses every branch


def _run(root, *, resume=None, echo=None, **sections):
    cfg = AprConfig.model_validate(config_doc(root, **sections))
    lines: list[str] = []
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(resume=resume, echo=echo or lines.append))
    return run.execute(), run, getattr(echo, "lines", lines)


def _orchestrated(**orchestrator) -> dict:
    return {"max_steps": 12, "eval_interval": 4, "save_interval": 100, "orchestrator": {
        "enabled": True, "decision_interval": 4, "eval_horizon": 3, "branches": 2, "strategies": STALL,
        "candidates": ["conservative_adamw", "stall"], "max_loss_increase": None, **orchestrator}}


@pytest.fixture
def root(tmp_path):
    make_dataset(tmp_path)
    return tmp_path


def _fresh(tmp_path_factory, name: str, **sections):
    """A run in a folder of its own, its global registry at ``<folder>/home``."""
    folder = tmp_path_factory.mktemp(name)
    make_dataset(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("APR_HOME", str(folder / "home"))
        return (folder, *_run(folder, **sections))


# Runs several tests compare against, made once per module (suite time).
@pytest.fixture(scope="module")
def branched(tmp_path_factory):
    return _fresh(tmp_path_factory, "branched", training=_orchestrated())


@pytest.fixture(scope="module")
def switching(tmp_path_factory):
    return _fresh(tmp_path_factory, "switching",
                  training=_orchestrated(candidates=["stall", "aggressive_adamw"], initial_strategy="stall"))


def test_the_winner_continues_bitwise_as_if_chosen_without_branching(branched, tmp_path_factory):
    """Two decisions (after steps 4 and 8), each training conservative_adamw and a losing strategy
    from the same state for 3 steps: the winner is the first branch, so its state is restored after
    the loser's. The run ends bitwise where a run that never branched (the run's own settings, which
    are conservative_adamw) ends: weights, moments, data cursor."""
    _, result, run, _ = branched
    _, plain, plain_run, _ = _fresh(tmp_path_factory, "plain",
                                    training={"max_steps": 12, "eval_interval": 4, "save_interval": 100})
    assert result.status == plain.status == "finished" and result.final_step == 12
    decisions = run.orchestrator.history
    assert [d["winner"] for d in decisions] == ["conservative_adamw", "conservative_adamw"]
    assert [b["strategy"] for b in decisions[0]["branches"]] == ["conservative_adamw", "stall"]
    a, b = run.engine.train_state_tensors(), plain_run.engine.train_state_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run.loader.state_dict() == plain_run.loader.state_dict()
    assert run.engine.optimizer_steps == 12  # the losers' steps are not the run's


def test_decisions_branches_and_switches_are_recorded_in_both_stores_and_the_state(switching):
    root, result, run, lines = switching
    state = json.loads((root / "run" / "training_state.json").read_text())
    kinds = [e["kind"] for e in state["events"]]
    assert kinds.count("decision") == 2 and kinds.count("branch") == 4 and kinds[0] == "strategy"
    assert "switch" in kinds  # stall -> aggressive_adamw at the first decision
    decision = next(e for e in state["events"] if e["kind"] == "decision")
    assert decision["detail"]["winner"] == "aggressive_adamw" and decision["detail"]["previous"] == "stall"
    assert {b["strategy"] for b in decision["detail"]["branches"]} == {"stall", "aggressive_adamw"}
    db = sqlite3.connect(root / "run" / ".apr" / "experiments.db")
    stored = [k for (k,) in db.execute("SELECT kind FROM events ORDER BY step")]
    assert sorted(stored) == sorted(kinds)
    assert any("orchestrator: aggressive_adamw" in line for line in lines)
    from typer.testing import CliRunner

    from apr.cli.main import app

    shown = CliRunner().invoke(app, ["runs", "show", result.run_id, "--global"], env={"APR_HOME": str(root / "home")})
    assert shown.exit_code == 0 and "decision 1: aggressive_adamw wins" in shown.stdout
    assert "branch stall: 3 steps" in shown.stdout and "strategy stall -> aggressive_adamw" in shown.stdout


def test_a_resume_continues_the_same_decisions(switching, tmp_path_factory):
    """Stopped by a signal at step 8, a decision point (its checkpoint holds the bandit, the strategy
    in force and the next decision's step), the resumed run makes the second decision as the
    uninterrupted one does, and ends bitwise equal to it."""
    settings = _orchestrated(candidates=["stall", "aggressive_adamw"], initial_strategy="stall")
    _, _, straight_run, _ = switching
    other = tmp_path_factory.mktemp("resumed")
    make_dataset(other)
    stopped, _, _ = _run(other, echo=signal_at("step  8/12  loss"), training=settings)
    assert stopped.status == "stopped" and stopped.final_step == 8
    resumed, resumed_run, _ = _run(other, resume="latest", training=settings)
    assert resumed.status == "finished" and resumed_run.orchestrator.decisions == 2
    assert resumed_run.orchestrator.bandit.state_dict() == straight_run.orchestrator.bandit.state_dict()
    a, b = straight_run.engine.train_state_tensors(), resumed_run.engine.train_state_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_loss_spike_rolls_back_to_the_last_decision_and_switches_to_the_safety_strategy(root):
    result, run, lines = _run(root, training={
        "max_steps": 14, "eval_interval": 4, "save_interval": 100, "orchestrator": {
            "enabled": True, "decision_interval": 4, "eval_horizon": 1, "candidates": ["boom"],
            "strategies": {"boom": {"lr_factor": 30.0, "clip_mode": "off"}}, "max_loss_increase": 1.5}})
    assert result.status == "finished"
    rollbacks = [e for e in run.recorder.recorded_events() if e["kind"] == "safety_rollback"]
    assert rollbacks and rollbacks[0]["detail"]["to"] == "spike_resistant"
    assert run.orchestrator.rollbacks >= 1
    assert any("safety rollback" in line for line in lines)


def test_a_resumed_process_rolls_back_to_the_checkpoint_of_the_last_decision(root):
    """Stopped at step 6, after the decision at step 4 (kept until step 5, checkpointed then), the
    resumed process has no decision state in memory: the spike at step 8 restores step 5's checkpoint
    (the state the decision kept, as the uninterrupted run does), keeps the data cursor past the bad
    window and switches to the safety strategy."""
    boom = {"max_steps": 14, "eval_interval": 4, "save_interval": 4, "orchestrator": {
        "enabled": True, "decision_interval": 4, "eval_horizon": 1, "candidates": ["boom"],
        "strategies": {"boom": {"lr_factor": 30.0, "clip_mode": "off"}}, "max_loss_increase": 1.5}}
    stopped, _, _ = _run(root, echo=signal_at("step  6/14  loss"), training=boom)
    assert stopped.status == "stopped" and stopped.final_step == 6
    saved = json.loads((root / "run" / "checkpoint-step-6.json").read_text())["orchestrator"]
    assert saved["good_step"] == 5 and saved["rollbacks"] == 0
    kept = json.loads((root / "run" / "checkpoint-step-5.json").read_text())["orchestrator"]
    assert kept["decisions"] == 1 and kept["good_step"] == 5
    resumed, run, lines = _run(root, resume="latest", training=boom)
    assert resumed.status == "finished" and resumed.final_step == 14
    rollback = next(e for e in run.recorder.recorded_events() if e["kind"] == "safety_rollback")
    assert rollback["step"] == 8 and rollback["detail"]["restored_step"] == 5
    assert rollback["detail"]["to"] == "spike_resistant" and run.orchestrator.rollbacks >= 1
    assert any("the last decision's state is checkpoint-step-5.json" in line for line in lines)
    # the cursor went on past steps 6-8's data: the window skipped is recorded, not replayed
    first, count = rollback["detail"]["micro_batches"]
    assert count == 3 and first + count <= run.loader.absolute


def test_a_nowcast_that_does_not_improve_validation_is_discarded_and_leaves_no_trace(root, branched):
    """A nowcast jumps 10^4 steps along the weights' linear trend (fitted over the two decision
    points): far worse on validation, so it is discarded, recorded, and the run ends bitwise where
    the same run without nowcasting ends."""
    jump = _orchestrated(nowcasting={"enabled": True, "history": 2, "ahead": 10_000})
    result, run, _ = _run(root, training=jump)
    nowcasts = [e for e in run.recorder.recorded_events() if e["kind"] == "nowcast"]
    assert len(nowcasts) == 1 and nowcasts[0]["detail"]["kept"] is False  # the second decision: two points
    assert nowcasts[0]["detail"]["history"] == [4, 8]
    assert nowcasts[0]["detail"]["val_loss"] > nowcasts[0]["detail"]["best_branch_val_loss"]
    _, _, plain_run, _ = branched
    a, b = run.engine.train_state_tensors(), plain_run.engine.train_state_tensors()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_nowcast_that_improves_validation_is_kept_and_the_run_trains_on_from_its_weights(root, branched,
                                                                                        monkeypatch):
    """Early in training the weights move along a steady trend: extrapolated 6 steps past the second
    decision point (a line through the weights at steps 4 and 8), they score better on validation
    than the best branch's 3 trained steps. The nowcast is kept: the engine leaves the decision with
    exactly the extrapolated weights (the winner's moments and cursor), the branches are recorded as
    discarded, and the run trains on from there to its end."""
    from apr.train.orchestrator import Orchestrator, extrapolate

    seen = {}
    nowcast = Orchestrator._nowcast

    def watched(self, run, *args):
        record = nowcast(self, run, *args)
        if record is not None:  # the state the run goes on from, and the line it should lie on
            seen["weights"] = {k: v.clone() for k, v in run.engine.train_state_tensors().items()}
            seen["line"] = extrapolate(self.nowcast_history, args[1] + record["ahead"])
        return record

    monkeypatch.setattr(Orchestrator, "_nowcast", watched)
    result, run, _ = _run(root, training=_orchestrated(nowcasting={"enabled": True, "history": 2, "ahead": 6}))
    assert result.status == "finished" and result.final_step == 12 and run.engine.optimizer_steps == 12
    events = json.loads((root / "run" / "training_state.json").read_text())["events"]
    nowcasts = [e["detail"] for e in events if e["kind"] == "nowcast"]
    assert len(nowcasts) == 1 and nowcasts[0]["kept"] is True and nowcasts[0]["history"] == [4, 8]
    assert nowcasts[0]["val_loss"] < nowcasts[0]["best_branch_val_loss"]
    second = run.orchestrator.history[1]
    assert second["nowcast"]["kept"] and second["kept_until"] == 11
    assert not any(e["detail"]["kept"] for e in events if e["kind"] == "branch" and e["step"] == 8)
    assert seen["line"].keys() and all(torch.equal(seen["weights"][k], w) for k, w in seen["line"].items())
    _, _, plain_run, _ = branched  # the same run without nowcasting ends elsewhere
    a, b = run.engine.train_state_tensors(), plain_run.engine.train_state_tensors()
    assert not all(torch.equal(a[k], b[k]) for k in seen["line"])


def test_a_resumed_nowcasting_run_whose_decision_point_is_gone_says_so_and_starts_its_history_again(root):
    """Stopped at step 8, before the second decision: its checkpoint names the nowcast point of step 4,
    whose weights are in the run folder (a resumed process fits its line through them). With that
    file gone, the resume warns and the second decision has one point: no nowcast."""
    settings = _orchestrated(nowcasting={"enabled": True, "history": 2, "ahead": 6})
    stopped, _, _ = _run(root, echo=signal_at("step  8/12  loss"), training=settings)
    assert stopped.status == "stopped" and stopped.final_step == 8
    saved = json.loads((root / "run" / "checkpoint-step-8.json").read_text())["orchestrator"]
    point = root / "run" / ".apr" / "nowcast" / "step-4.safetensors"
    assert saved["nowcast_steps"] == [4] and point.is_file()
    point.unlink()
    resumed, run, lines = _run(root, resume="latest", training=settings)
    assert resumed.status == "finished" and resumed.final_step == 12
    assert any("the nowcast points step-4.safetensors are gone" in line for line in lines)
    assert [e["kind"] for e in run.recorder.recorded_events()].count("decision") == 2
    assert not [e for e in run.recorder.recorded_events() if e["kind"] == "nowcast"]


def test_nowcasting_extrapolates_each_tensor_along_its_least_squares_line():
    from apr.train.orchestrator import extrapolate

    a, b = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    noise = {4: 0.01, 8: -0.02, 12: 0.01}  # zero mean and zero slope: the fit is the line itself
    history = [(s, {"w": (a + b * s + noise[s]).float()}) for s in (4, 8, 12)]
    torch.testing.assert_close(extrapolate(history, 20)["w"], (a + b * 20).float(), rtol=1e-5, atol=1e-5)
    assert extrapolate(history, 20)["w"].dtype == torch.float32


def test_a_horizon_that_would_reach_the_end_is_clipped_so_the_last_step_is_validated(root):
    result, run, lines = _run(root, training={**_orchestrated(), "max_steps": 10})
    assert [d["horizon"] for d in run.orchestrator.history] == [3, 1]  # after step 8: steps 9, then the loop's 10
    assert any("horizon clipped to 1 steps" in line for line in lines)
    state = json.loads((root / "run" / "training_state.json").read_text())
    assert result.final_step == 10 and state["val_loss_history"][-1][0] == 10


def test_switching_a_strategy_sets_the_updater_its_settings_and_the_clipping_on_either_engine():
    from apr.steps.orchestration import resolve
    from apr.train.build import build_engine
    from apr.train.orchestrator import apply_strategy
    from tests.train.tiny import batches, make_config

    config = make_config(training={"engine": "standard"})
    engine = build_engine(plan_of(config))
    apply_strategy(engine, config, resolve(config, "spike_resistant"))
    groups = engine.updater.optimizer.param_groups  # torch's AdamW, bound: its groups follow
    assert engine.strategy.clip == "global" and engine.grad_clip == config.training.grad_clip / 4
    assert groups[0]["weight_decay"] == config.optimizer.weight_decay and groups[1]["weight_decay"] == 0.0
    config = make_config()
    engine = build_engine(plan_of(config))
    apply_strategy(engine, config, resolve(config, "sgd_escape"))
    assert engine.updater.name == "sgd" and engine.updater.weight_decay == config.optimizer.weight_decay / 30
    losses = [engine.train_step([b], lr=1e-2 * 30).loss.item() for b in batches(config, 3, seed=1)]
    assert all(torch.isfinite(torch.tensor(losses)))
    apply_strategy(engine, config, resolve(config, "aggressive_adamw"))
    assert engine.updater.name == "adamw" and engine.strategy.clip == "per_block" and not engine.strategy.norm_prepass


@pytest.mark.parametrize("engine", ["standard", "interleaved"])
def test_switching_to_sgd_and_back_on_autograd_carries_the_moments_as_the_walk_does(engine):
    """AdamW, then the SGD strategy, then AdamW again: on autograd the new updater takes the old one's
    moments (SGD's momentum is AdamW's first moment) and ends where the walk's shared flat buffers do."""
    from apr.steps.orchestration import resolve
    from apr.train.build import build_engine
    from apr.train.orchestrator import apply_strategy
    from tests.train.tiny import batches, make_config

    def run(engine_name: str) -> dict[str, torch.Tensor]:
        config = make_config(training={"engine": engine_name, "grad_clip": None})
        eng = build_engine(plan_of(config))
        data = batches(config, 6, seed=3)
        for k, name in enumerate(["conservative_adamw", "conservative_adamw", "sgd_escape", "sgd_escape",
                                  "conservative_adamw", "conservative_adamw"]):
            apply_strategy(eng, config, resolve(config, name))
            eng.train_step([data[k]], lr=1e-2)
        return eng.train_state_tensors()

    walk, other = run("interleaved"), run(engine)
    assert set(walk) == set(other)
    for name in walk:
        assert torch.allclose(other[name], walk[name], rtol=1e-4, atol=1e-6), name


def test_when_every_branch_goes_non_finite_the_run_goes_on_from_the_decision_point(root):
    result, run, _ = _run(root, training={**_orchestrated(), "max_steps": 8, "orchestrator": {
        "enabled": True, "decision_interval": 4, "eval_horizon": 3, "candidates": ["blowup"],
        "strategies": {"blowup": {"lr_factor": 1.0e36, "clip_mode": "off"}}, "max_loss_increase": None}})
    assert result.status == "finished" and result.final_step == 8
    decision = run.orchestrator.history[0]
    assert decision["branches"][0]["failed"] and decision["winner"] == "conservative_adamw"
    assert decision["kept_until"] == 4 and run.engine.optimizer_steps == 8  # steps 5-8 trained by the loop


def test_a_switch_of_updater_keeps_each_parameters_own_step_count_where_the_loss_part_keeps_them():
    """Distillation counts each parameter's updates (``per_param_steps``): a switch AdamW -> SGD -> AdamW
    on autograd hands each parameter back its own count (AdamW's bias correction), not the run's."""
    from apr.steps.orchestration import resolve
    from apr.train.build import build_engine
    from apr.train.orchestrator import apply_strategy
    from tests.train.tiny import batches, make_config

    config = make_config(training={"engine": "standard", "grad_clip": None})
    engine = build_engine(plan_of(config))
    engine.loss.per_param_steps = True  # as distillation's loss part says
    for batch in batches(config, 2, seed=4):
        engine.train_step([batch], lr=1e-2)
    named = engine.layout.params.named
    first = next(iter(named.values()))
    engine.updater.set_steps(first, 1)  # a parameter updated once (distillation's other blocks)
    for name in ("sgd_escape", "conservative_adamw"):
        apply_strategy(engine, config, resolve(config, name))
    assert engine.updater.name == "adamw" and engine.updater.steps_of(first) == 1
    assert {engine.updater.steps_of(p) for p in list(named.values())[1:]} == {2}
