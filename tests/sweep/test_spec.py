"""The sweep file (apr/sweep/spec.py): W&B's format, apr key paths, every mistake with its line."""

from __future__ import annotations

import math

import pytest

from apr.sweep.spec import SweepError, grid_values, load_sweep


def _load(tmp_path, text):
    path = tmp_path / "sweep.yaml"
    path.write_text(text.lstrip("\n"))
    return load_sweep(path)


def _errors(tmp_path, text):
    with pytest.raises(SweepError) as info:
        _load(tmp_path, text)
    return info.value.findings


DANTINOX = """
method: bayes
metric:
  name: val_loss
  goal: minimize
parameters:
  lr:
    distribution: log_uniform_values
    min: 0.0001
    max: 0.005
  batch_size:
    values: [16, 32, 64]
  grad_accum:
    values: [2, 4, 8]
  warmup_steps:
    values: [50, 100, 200]
  dim:
    values: [256, 512]
  num_blocks:
    values: [4, 8, 12]
  optimizer:
    values: ["adamw"]
run_cap: 50
"""


def test_the_dantinox_sweep_reads_with_its_flat_names_mapped_and_named(tmp_path):
    spec = _load(tmp_path, DANTINOX)
    keys = {p.name: p.key for p in spec.params}
    assert keys == {"lr": "optimizer.lr", "batch_size": "data.batch_size",
                    "grad_accum": "training.gradient_accumulation", "warmup_steps": "training.warmup_steps",
                    "dim": "model.architecture.hidden_size", "num_blocks": "model.architecture.num_hidden_layers",
                    "optimizer": "optimizer.name"}
    lr = spec.params[0]
    assert (lr.kind, lr.low, lr.high, lr.log) == ("log_uniform_values", 0.0001, 0.005, True)
    assert spec.method == "bayes" and spec.run_cap == 50 and spec.name == "sweep"
    # one warning per renamed parameter, naming the apr key, at the parameter's line
    renamed = {w.path: w for w in spec.warnings if w.code == "sweep.renamed"}
    assert "optimizer.lr" in renamed["parameters.lr"].message and renamed["parameters.lr"].line == 6
    assert "model.architecture.hidden_size" in renamed["parameters.dim"].message


def test_unknown_keys_get_did_you_mean_and_their_lines(tmp_path):
    found = _errors(tmp_path, """
method: random
metirc: {name: val_loss}
parameters:
  optimizer.lrr: {values: [0.1]}
  tokenizer_type: {values: [char, bpe]}
  optimizer.lr: {min: 0.001, max: 0.01, distribtion: uniform}
""")
    by_path = {f.path: f for f in found}
    assert "did you mean 'metric'" in by_path["metirc"].message and by_path["metirc"].line == 2
    assert "did you mean 'optimizer.lr'" in by_path["parameters.optimizer.lrr"].message
    assert by_path["parameters.optimizer.lrr"].line == 4 and by_path["parameters.optimizer.lrr"].file.endswith(
        "sweep.yaml")
    assert "not an apr config key" in by_path["parameters.tokenizer_type"].message
    assert "did you mean 'distribution'" in by_path["parameters.optimizer.lr.distribtion"].message


@pytest.mark.parametrize("body, path, words", [
    ("{min: 0.01, max: 0.001}", "parameters.optimizer.lr.min", "above max"),
    ("{distribution: log_uniform_values, min: 0, max: 0.01}", "parameters.optimizer.lr.min", "log"),
    ("{distribution: q_uniform, min: 0.001, max: 0.01}", "parameters.optimizer.lr.q", "step q"),
    ("{distribution: normal, min: 0, max: 1}", "parameters.optimizer.lr.distribution", "no Optuna sampler"),
    ("{values: []}", "parameters.optimizer.lr.values", "non-empty"),
    ("{values: [[1, 2]]}", "parameters.optimizer.lr.values[0]", "a number, a string"),
])
def test_impossible_ranges_are_refused_at_their_key(tmp_path, body, path, words):
    found = _errors(tmp_path, f"method: random\nrun_cap: 2\nparameters:\n  optimizer.lr: {body}\n")
    assert [f.path for f in found] == [path]
    assert words in found[0].message and found[0].line == 4


def test_an_unknown_metric_is_refused_and_a_dantinox_alias_is_mapped(tmp_path):
    found = _errors(tmp_path, "method: grid\nmetric: {name: val_los}\nparameters:\n  optimizer.lr: {value: 0.1}\n")
    assert found[0].code == "sweep.unknown_metric" and "did you mean 'val_loss'" in found[0].message
    assert found[0].line == 2
    spec = _load(tmp_path, "method: grid\nmetric: {name: train_loss, goal: maximize}\n"
                           "parameters:\n  optimizer.lr: {value: 0.1}\n")
    assert (spec.metric, spec.goal) == ("loss", "maximize")


def test_sections_reserved_keys_and_a_continuous_grid_are_refused(tmp_path):
    found = _errors(tmp_path, """
method: grid
parameters:
  training.adagc: {values: [1]}
  training.output_dir: {values: [a, b]}
  optimizer.lr: {min: 0.001, max: 0.01}
""")
    codes = {f.path: f.code for f in found}
    assert codes == {"parameters.training.adagc": "sweep.section", "parameters.training.output_dir": "sweep.reserved",
                     "parameters.optimizer.lr": "sweep.grid_continuous"}


def test_wandb_defaults_and_distributions(tmp_path):
    spec = _load(tmp_path, """
method: grid
parameters:
  training.warmup_steps: {min: 1, max: 4}
  optimizer.weight_decay: {distribution: q_uniform, min: 0.0, max: 0.3, q: 0.1}
  optimizer.lr: {distribution: log_uniform, min: -9.2, max: -4.6}
  training.seed: {value: 7}
""".replace("method: grid", "method: random\nrun_cap: 3"))
    warmup, wd, lr, seed = spec.params
    assert warmup.kind == "int_uniform" and grid_values(warmup) == [1, 2, 3, 4]
    assert grid_values(wd) == [0.0, 0.1, 0.2, 0.3]
    assert lr.kind == "log_uniform" and lr.low == pytest.approx(math.exp(-9.2)) and lr.log
    assert seed.kind == "constant" and seed.values == (7,)


def test_the_fingerprint_changes_with_the_space_not_with_the_name(tmp_path):
    a = _load(tmp_path, "name: a\nmethod: random\nrun_cap: 2\nparameters:\n  optimizer.lr: {min: 0.001, max: 0.01}\n")
    b = _load(tmp_path, "name: b\nmethod: random\nrun_cap: 9\nparameters:\n  optimizer.lr: {min: 0.001, max: 0.01}\n")
    c = _load(tmp_path, "name: a\nmethod: random\nrun_cap: 2\nparameters:\n  optimizer.lr: {min: 0.001, max: 0.02}\n")
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


@pytest.mark.parametrize("body", [
    "{distribution: q_uniform, min: 0, max: 1, q: 1.0e-9}",  # a billion points: counted, never listed
    "{distribution: q_uniform, min: -1.0e+15, max: 1.0e+15, q: 1}",  # 2e15 points, each a float apart
    "{min: -1000000000000000000, max: 1000000000000000000}",  # int_uniform of 2e18 integers
])
def test_a_grid_too_large_is_refused_at_its_key_before_it_is_listed(tmp_path, body):
    import time

    start = time.monotonic()
    found = _errors(tmp_path, f"method: grid\nparameters:\n  optimizer.lr: {body}\n")
    assert time.monotonic() - start < 5  # today's q_uniform grid with q 1e-9 plans for minutes
    assert [(f.code, f.path, f.line) for f in found] == [("sweep.grid_too_large", "parameters.optimizer.lr", 3)]
    assert "at most 100,000" in found[0].expected


def test_a_grid_of_many_small_ranges_is_refused_by_its_product(tmp_path):
    batch_sizes = ", ".join(str(i) for i in range(1, 101))  # 100 points, and 2,000 steps: 200,000 in all
    found = _errors(tmp_path, f"method: grid\nparameters:\n  data.batch_size: {{values: [{batch_sizes}]}}\n"
                              "  training.max_steps: {min: 1, max: 2000}\n")
    assert [(f.code, f.path) for f in found] == [("sweep.grid_too_large", "method")]
    assert "200,000 points" in found[0].message


@pytest.mark.parametrize("cap", ["100000000000000000000", "1000001", "0", "1.0e20", "true"])
def test_run_cap_is_a_bounded_number_of_trials(tmp_path, cap):
    found = _errors(tmp_path, f"method: random\nrun_cap: {cap}\nparameters:\n  optimizer.lr: {{values: [0.001]}}\n")
    assert [(f.code, f.path, f.line) for f in found] == [("sweep.bad_value", "run_cap", 2)]
    assert "1,000,000" in found[0].expected
    assert _load(tmp_path, "method: random\nrun_cap: 1000000\nparameters:\n  optimizer.lr: {values: [1]}\n").run_cap \
        == 1_000_000


@pytest.mark.parametrize("text", [
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",  # bracket bomb
    "a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n"
    "d: &d [*c, *c, *c, *c, *c, *c, *c, *c]\ne: [*d, *d, *d, *d, *d, *d, *d, *d]\n",  # alias bomb
    "method: grid\nparameters:\n  optimizer.lr: {values: [" + ", ".join("0.1" for _ in range(3000)) + "]}\n",
    "method: grid\nrun_cap: " + "9" * 5000 + "\nparameters: {}\n",  # an integer past Python's text limit
    "method: grid\nparameters:\n  " + "x" * 100_000 + ": {values: [1]}\n",  # a key past the size cap
    "method: grid\nparameters:\n  optimizer.lr: {min: 0, max: 1, q: .nan, distribution: q_uniform}\n",
    "method: grid\nseed: -1\nparameters:\n  optimizer.lr: {values: [.inf]}\n",
    "method: random\nrun_cap: 2\nparameters:\n  optimizer.lr: {distribution: q_uniform, min: 0.0001, max: 1.0e+300, "
    "q: 1.0e-300}\n",  # round(x / q) overflowed in the sampler
    "method: bayes\nrun_cap: 2\nparameters:\n  optimizer.lr: {distribution: q_log_uniform, min: -700, max: 700, "
    "q: 1.0e-300}\n",
    "\x00\x01\x02",
    "",
])
def test_no_hostile_sweep_file_hangs_or_tracebacks(tmp_path, text):
    """Every such file is a clean exit 1 within seconds, from the sweep commands that read it."""
    import time

    from typer.testing import CliRunner

    from apr.cli.main import app

    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    for args in (["sweep", "plan", str(path)], ["sweep", "run", str(path), "--dir", str(tmp_path / "d")],
                 ["sweep", "status", str(path), "--dir", str(tmp_path / "d")]):
        start = time.monotonic()
        result = CliRunner().invoke(app, args)
        assert time.monotonic() - start < 10, args
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (args, result.output)
        assert "Traceback" not in result.output and "sweep.yaml" in result.output
    assert not (tmp_path / "d").exists()


def test_a_q_step_finer_than_a_float_can_tell_apart_is_refused_at_q(tmp_path):
    found = _errors(tmp_path, "method: random\nrun_cap: 2\nparameters:\n  optimizer.lr:\n    distribution: q_uniform\n"
                              "    min: 0.0001\n    max: 1.0e+300\n    q: 1.0e-300\n")
    assert [(f.code, f.path, f.line) for f in found] == [("sweep.bad_range", "parameters.optimizer.lr.q", 8)]
    spec = _load(tmp_path, "method: random\nrun_cap: 2\nparameters:\n  optimizer.lr: {distribution: q_uniform, "
                           "min: 0, max: 1, q: 1.0e-9}\n")  # a fine step over a small range is fine
    assert spec.params[0].q == 1e-9
