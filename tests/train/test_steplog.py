"""apr/train/steplog.py: the printed step line holds monitoring.terminal.metrics, in their order."""

from __future__ import annotations

import torch

from apr.track.protocol import NullRecorder
from apr.train.engine import StepResult
from apr.train.steplog import StepLog


def _line(**kw) -> str:
    lines: list[str] = []
    log = StepLog(total_steps=100, tokens_per_step=4096, dp=None, echo=lines.append, label=lambda s: f"step {s}",
                  **kw)
    log.start(0)
    metrics = log.log(10, 3e-4, StepResult(torch.tensor(2.5), torch.tensor(0.75)), 0.4, NullRecorder(None))
    assert metrics["loss"] == 2.5 and metrics["grad_norm"] == 0.75  # recorded whatever is shown
    return lines[0]


def test_the_default_line_shows_loss_lr_and_gradient_norm():
    line = _line()
    assert line.startswith("step 10  loss 2.5000  lr 3.00e-04  gnorm 0.750  ") and "tok/s  eta " in line


def test_the_configured_metrics_choose_the_line_and_its_order():
    line = _line(shown=("tokens_seen", "epoch", "loss"))
    assert line.startswith("step 10  tokens 41K  epoch 0.40  loss 2.5000  ")
    assert "lr " not in line and "gnorm" not in line
    assert _line(shown=()).startswith("step 10  ") and "loss" not in _line(shown=())
