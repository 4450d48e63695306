"""monitoring.terminal.enabled and .metrics act on `apr train apply` (issue 24: no key accepted and ignored)."""

from __future__ import annotations

from run_helpers import make_dataset, write_config

from apr.apply import run_apply


def _apply(tmp_path, terminal: dict) -> tuple[list, list]:
    make_dataset(tmp_path)
    cfg = write_config(tmp_path, training={"max_steps": 3, "eval_interval": 0, "save_interval": 1000,
                                           "log_interval": 1},
                       monitoring={"terminal": terminal})
    drawn, lines = [], []
    result = run_apply(cfg, apr_home=tmp_path / "home", echo=lines.append,
                       progress=lambda step, total: drawn.append(step))
    assert result.status == "finished"
    return drawn, lines


def test_terminal_disabled_draws_no_progress_bar_and_metrics_choose_the_step_line(tmp_path):
    drawn, lines = _apply(tmp_path, {"enabled": False, "metrics": ["epoch", "loss"]})
    assert drawn == []
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and all(" epoch " in s and " loss " in s and " lr " not in s for s in steps)
    assert all(s.index(" epoch ") < s.index(" loss ") for s in steps)


def test_terminal_enabled_by_default_draws_the_bar(tmp_path):
    drawn, _ = _apply(tmp_path, {})
    assert drawn == [1, 2, 3]
