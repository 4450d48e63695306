"""apr/config/schema.py: values derived from the architecture, defined once."""

from __future__ import annotations

from apr.config.schema import Architecture


def arch(**over) -> Architecture:
    doc = {"hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6, "intermediate_size": 256,
           "vocab_size": 100, "max_position_embeddings": 32}
    return Architecture.model_validate({**doc, **over})


def test_head_dim_is_an_int():
    hd = arch().head_dim
    assert hd == 16 and isinstance(hd, int)


def test_kv_heads_default_to_the_attention_heads():
    assert arch().kv_heads == 6 and arch(num_key_value_heads=2).kv_heads == 2


def test_derived_values_are_not_part_of_the_dumped_config():
    # the config hash and the saved config.yaml hold only what the user wrote
    assert "head_dim" not in arch().model_dump() and "kv_heads" not in arch().model_dump()


def _numeric_key_paths():
    """Every key (outside lists) whose type is a number: float, int, or a count."""
    import typing

    from apr.config.loader import _model_at, schema_key_paths

    def numeric(ann) -> bool:
        if ann in (int, float):
            return True
        if typing.get_origin(ann) in (list, dict):
            return False
        return any(numeric(a) for a in typing.get_args(ann) if a is not bool)

    def listed(ann) -> bool:
        return typing.get_origin(ann) is list or any(listed(a) for a in typing.get_args(ann))

    out = []
    for path in schema_key_paths():
        owner = _model_at(path[:-1])
        field = owner.model_fields[path[-1]]
        through_list = any(listed(_model_at(path[:i - 1]).model_fields[path[i - 1]].annotation)
                           for i in range(1, len(path)))
        if numeric(field.annotation) and not through_list and typing.get_origin(field.annotation) is not dict:
            out.append(".".join(path))
    return out


NUMERIC = _numeric_key_paths()


def test_the_walk_finds_the_numbers():
    assert {"optimizer.lr", "training.seed", "data.batch_size", "model.lora.alpha", "training.grad_clip"} <= set(
        NUMERIC)
    assert not [k for k in NUMERIC if k.startswith(("data.stages", "monitoring.alerts"))]  # inside lists


def test_a_boolean_is_never_read_as_a_number(repo):
    """`lr: true` was 1.0: every numeric key refuses true/false at its key path (settings and files alike)."""
    import pytest

    from apr.config import load_config
    from apr.errors import ConfigError

    base = repo / "configs/train/demo-tiny.yaml"
    for key in NUMERIC:
        with pytest.raises(ConfigError) as e:
            load_config(base, [f"{key}=true"])
        found = [f for f in e.value.findings if f.path == key]
        assert found and "boolean" in (found[0].message + str(found[0].expected)).lower(), (key, e.value.findings)


def test_a_seed_beyond_int64_is_refused_with_its_range(repo, tmp_path):
    import pytest

    from apr.config import load_config
    from apr.errors import ConfigError

    base = repo / "configs/train/demo-tiny.yaml"
    assert load_config(base, [f"training.seed={2**63 - 1}"]).config.training.seed == 2**63 - 1
    for bad in (2**63, 2**64 - 1, -1):
        with pytest.raises(ConfigError) as e:
            load_config(base, [f"training.seed={bad}"])
        (f,) = e.value.findings
        assert f.path == "training.seed" and f.file == "command line" and "2**63 - 1" in f.message
    cfg = tmp_path / "c.yaml"
    cfg.write_text(base.read_text().replace("  epochs: 1\n", f"  epochs: 1\n  seed: {2**63}\n"))
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert e.value.findings[0].line is not None and "9,223,372,036,854,775,807" in e.value.findings[0].message


def test_numbers_beyond_what_the_trainer_holds_are_refused(repo):
    import pytest

    from apr.config import load_config
    from apr.errors import ConfigError

    base = repo / "configs/train/demo-tiny.yaml"
    for setting, path in (("optimizer.lr=1e39", "optimizer.lr"), ("optimizer.lr=5000", "optimizer.lr"),
                          ("training.cpu_threads=5000", "training.cpu_threads"),
                          ("training.world_size=4294967296", "training.world_size"),
                          ("data.shuffle=1", "data.shuffle")):
        with pytest.raises(ConfigError) as e:
            load_config(base, [setting])
        assert [f.path for f in e.value.findings] == [path], setting


def test_execution_compile_takes_true_false_or_auto_and_defaults_to_auto():
    import pytest
    from pydantic import ValidationError

    from apr.config.schema import ExecutionConfig

    assert ExecutionConfig().compile == "auto"
    assert [ExecutionConfig(compile=v).compile for v in (True, False, "auto")] == [True, False, "auto"]
    for bad in ("sometimes", "yes", 1):
        with pytest.raises(ValidationError, match="expected true, false or auto"):
            ExecutionConfig(compile=bad)
