"""The run loop's plug-in point: a StepHook sees every step and may stop the run."""

from __future__ import annotations

import json

from run_helpers import config_doc, make_dataset

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.train.run import ApplyOptions, prepare_run
from apr.train.stop import Stop


class StopWhenValidated:
    """Stops at the first step whose validation loss was measured; remembers what it saw."""

    def __init__(self):
        self.seen: list[tuple[int, bool, bool]] = []

    def after_step(self, run, report):
        self.seen.append((report.step, report.metrics is not None, report.val_loss is not None))
        if report.val_loss is not None:
            return Stop("stopped", f"hook: val loss {report.val_loss:.3f}", 3)
        return None


def test_a_hook_sees_each_step_and_its_stop_ends_the_run_with_a_checkpoint(tmp_path):
    make_dataset(tmp_path)
    cfg = AprConfig.model_validate(config_doc(tmp_path, training={
        "max_steps": 12, "log_interval": 2, "eval_interval": 6, "save_interval": 100}))
    hook = StopWhenValidated()
    opts = ApplyOptions(echo=lambda line: None, hooks=[hook])
    result = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                         options=opts).execute()
    assert hook.seen == [(1, False, False), (2, True, False), (3, False, False), (4, True, False),
                         (5, False, False), (6, True, True)]
    assert (result.status, result.exit_code, result.final_step) == ("stopped", 3, 6)
    assert result.reason.startswith("hook: val loss ")
    assert result.last_checkpoint == tmp_path / "run" / "checkpoint-step-6.json"
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert (state["status"], state["status_reason"], state["step"]) == ("stopped", result.reason, 6)


class StopAt:
    def __init__(self, step):
        self.step = step

    def after_step(self, run, report):
        return Stop("stopped", f"hook at {report.step}", 1) if report.step == self.step else None


def test_every_hook_sees_the_step_an_earlier_one_stopped_and_the_earlier_stop_stands(tmp_path):
    make_dataset(tmp_path)
    cfg = AprConfig.model_validate(config_doc(tmp_path, training={"max_steps": 12, "eval_interval": 0}))
    later = StopWhenValidated()
    also_at_2 = StopAt(2)
    also_at_2.after_step = lambda run, report: Stop("failed", "other", 9) if report.step == 2 else None
    opts = ApplyOptions(echo=lambda line: None, hooks=[StopAt(2), also_at_2,
                                                       later])
    result = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                         options=opts).execute()
    assert (result.status, result.reason, result.exit_code, result.final_step) == ("stopped", "hook at 2", 1, 2)
    assert [s for s, _, _ in later.seen] == [1, 2]
