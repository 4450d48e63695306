import pytest

from apr.checkpoint.compat import classify, compare_configs
from apr.errors import AprError
from tests.checkpoint.conftest import make_config


def stored(config):
    return config.model_dump(mode="json")


def test_identical_configs_have_no_diff(tiny_config):
    diff = compare_configs(stored(tiny_config), make_config())
    assert not diff and diff.ok and diff.breaking == [] and diff.harmless == []
    diff.check()  # does not raise


def test_defaults_spelled_out_or_left_implicit_compare_equal(tiny_config):
    sparse = {"model": tiny_config.model.model_dump(mode="json"), "data": {"train": "data/train/",
              "batch_size": 2, "seq_len": 8}, "training": {"keep_last": 1, "mixed_precision": "fp32",
                                                           "device": "cpu"}}
    assert not compare_configs(sparse, tiny_config)


@pytest.mark.parametrize("path, value", [
    ("model.architecture.hidden_size", 32),
    ("model.architecture.rope_theta", 500000.0),
    ("data.train", "other/"),
    ("data.seq_len", 16),
    ("data.input_column", "ids"),
    ("data.batch_size", 4),
    ("training.seed", 7),
    ("training.gradient_accumulation", 2),
    ("training.mixed_precision", "bf16"),
    ("training.world_size", 2),
    ("optimizer.beta2", 0.99),
    ("optimizer.lr", 1e-3),
    ("training.warmup_steps", 3),
])
def test_breaking_changes_are_refused_with_a_diff(tiny_config, path, value):
    diff = compare_configs(stored(tiny_config), make_config(**{path: value}))
    assert not diff.ok
    assert len(diff.breaking) == 1 and diff.breaking[0].startswith(f"{path}: ")
    text = diff.render()
    assert path in text and "breaking" in text and str(value) in text
    with pytest.raises(AprError) as err:
        diff.check()
    assert "--force" in err.value.message
    assert [f.path for f in err.value.findings] == [path]
    diff.check(force=True)


@pytest.mark.parametrize("path, value", [
    ("training.max_steps", 100),
    ("training.save_interval", 5),
    ("training.keep_last", 3),
    ("training.log_interval", 1),
    ("training.eval_interval", 7),
    ("training.output_dir", "elsewhere"),
    ("monitoring.tracking.experiment", "renamed"),
    ("training.vram", "24GiB"),  # model.path: only "." is accepted now (issue 24 item 15)
])
def test_harmless_changes_are_allowed_and_listed(tiny_config, path, value):
    diff = compare_configs(stored(tiny_config), make_config(**{path: value}))
    assert diff.ok and diff
    assert len(diff.harmless) == 1 and diff.harmless[0].startswith(f"{path}: ")
    assert "harmless" in diff.render()
    diff.check()


def test_mixed_diff_lists_both_and_unknown_keys_are_breaking(tiny_config):
    old = stored(tiny_config)
    diff = compare_configs(old, make_config(**{"training.seed": 1, "training.max_steps": 9}))
    assert [c.path for c in diff.changes] == ["training.max_steps", "training.seed"]
    assert diff.breaking == ["training.seed: 42 -> 1"]
    assert diff.harmless == ["training.max_steps: null -> 9"]
    assert classify("training.some_future_key")[0] is True
    old["training"]["some_future_key"] = 1  # a newer schema's checkpoint: compared as stored
    diff = compare_configs(old, tiny_config)
    assert diff.breaking == ["training.some_future_key: 1 -> (absent)"]
