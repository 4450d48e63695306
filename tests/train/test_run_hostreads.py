"""The run loop costs nothing between log steps (issue 40): no value reaches the host from the device
at a step that is not a log, validation or checkpoint step, and the records and the progress bar
still arrive (docs/design.md, "The run loop"; the cost is measured by benchmarks/bench_runloop.py)."""

from __future__ import annotations

import json

import torch
from run_helpers import config_doc, make_dataset

from apr.config import config_hash
from apr.config.schema import AprConfig
from apr.plan.build import resolve_config
from apr.train.run import ApplyOptions, prepare_run


class HostReads:
    """Counts the ways a tensor's value reaches Python (as tests/train/test_nonfinite.py)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


class ReadsPerStep:
    """A step hook: the host reads of each whole iteration of the loop (the hook runs after the step's
    logging, so an iteration is from one call to the next)."""

    def __init__(self, reads: HostReads):
        self.reads, self.last, self.per_step = reads, 0, {}

    def after_step(self, run, report):
        self.per_step[report.step] = self.reads.count - self.last
        self.last = self.reads.count


def test_the_loop_reads_the_device_only_at_log_steps_and_the_records_arrive(tmp_path, monkeypatch):
    make_dataset(tmp_path)
    cfg = AprConfig.model_validate(config_doc(tmp_path, training={
        "max_steps": 12, "log_interval": 4, "eval_interval": 0, "save_interval": 100}))
    progress: list[int] = []
    reads = HostReads(monkeypatch)
    hook = ReadsPerStep(reads)
    opts = ApplyOptions(echo=lambda line: None, hooks=[hook], progress=lambda step, total: progress.append(step))
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=tmp_path / "cfg.yaml",
                      options=opts)
    result = run.execute()
    assert result.status == "finished" and result.final_step == 12
    quiet = {step: n for step, n in hook.per_step.items() if step % 4}
    assert len(quiet) == 9 and set(quiet.values()) == {0}, hook.per_step
    assert all(hook.per_step[step] > 0 for step in (4, 8, 12))  # loss, norm, block norms, flags
    assert progress == list(range(1, 13))  # the bar advances every step: host-side only
    state = json.loads((tmp_path / "run" / "training_state.json").read_text())
    assert state["step"] == 12 and state["status"] == "finished"
