from pathlib import Path

import pytest

from apr.config import config_hash, load_config
from apr.config.schema import AprConfig
from apr.errors import ConfigError

MINIMAL = """\
model:
  architecture:
    hidden_size: 64
    num_hidden_layers: 2
    num_attention_heads: 4
    intermediate_size: 128
    vocab_size: 512
    max_position_embeddings: 64
data:
  train: data/train
  batch_size: 2
  seq_len: 32
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_every_shipped_config_loads(shipped_configs):
    assert len(shipped_configs) >= 3
    for path in shipped_configs:
        loaded = load_config(path)
        assert isinstance(loaded.config, AprConfig)


def test_reference_350m_values_survive_loading(repo):
    cfg = load_config(repo / "configs/train/pretrain-350m-v2.yaml").config
    arch = cfg.model.architecture
    assert (arch.hidden_size, arch.num_hidden_layers, arch.num_attention_heads, arch.kv_heads) == (1024, 24, 16, 4)
    assert arch.vocab_size == 32768 and arch.intermediate_size == 4096
    assert (cfg.data.batch_size, cfg.data.seq_len) == (4, 1024)
    assert (cfg.training.max_steps, cfg.training.warmup_steps, cfg.training.save_interval) == (5000, 500, 25)
    assert str(cfg.training.mixed_precision) == "fp16"
    assert cfg.optimizer.lr == pytest.approx(3e-4) and cfg.optimizer.beta2 == pytest.approx(0.95)
    assert [a.condition for a in cfg.monitoring.alerts] == ["loss > 10", "grad_norm > 100"]


def test_defaults_fill_omitted_sections(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL)).config
    assert cfg.model.architecture.kv_heads == 4  # MHA when num_key_value_heads is omitted
    assert cfg.optimizer.resolved_min_lr == pytest.approx(cfg.optimizer.lr * 0.1)
    assert cfg.training.gradient_accumulation == 1 and cfg.training.epochs == 1
    assert cfg.monitoring.terminal.refresh_rate == 1000


def test_shorthand_counts_in_a_config(tmp_path):
    text = MINIMAL.replace("vocab_size: 512", "vocab_size: 32K").replace("seq_len: 32", "seq_len: 1_024")
    cfg = load_config(write(tmp_path, text)).config
    assert cfg.model.architecture.vocab_size == 32_000 and cfg.data.seq_len == 1024


def test_errors_carry_path_line_column_expected_and_got(tmp_path):
    text = MINIMAL.replace("batch_size: 2", "batch_size: two")
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    (f,) = info.value.findings
    assert f.path == "data.batch_size" and f.line == 11 and f.column == 3
    assert f.got == "'two'" and "count" in f.expected
    assert f.file.endswith("cfg.yaml")


def test_several_errors_are_reported_together(tmp_path):
    text = MINIMAL.replace("batch_size: 2", "batch_size: -2").replace("hidden_size: 64", "hidden_sise: 64")
    text += "training:\n  lr_scheduler: cosin\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    paths = {f.path for f in info.value.findings}
    assert {"data.batch_size", "model.architecture.hidden_sise", "model.architecture.hidden_size",
            "training.lr_scheduler"} <= paths


def test_unknown_key_suggests_the_close_one(tmp_path):
    text = MINIMAL + "training:\n  warmup_step: 10\n"
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    (f,) = info.value.findings
    assert f.code == "schema.unknown_key" and "did you mean 'warmup_steps'" in f.message
    assert f.line == 14


def test_duplicate_keys_are_a_syntax_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, MINIMAL + "data:\n  train: x\n"))
    assert info.value.findings[0].code == "yaml.syntax" and info.value.findings[0].line is not None


def test_config_hash_ignores_key_order_and_comments(tmp_path):
    a = load_config(write(tmp_path, MINIMAL, "a.yaml"))
    lines = MINIMAL.splitlines()
    reordered = "\n".join(lines[8:] + lines[:8]) + "\n# a comment\n"
    b = load_config(write(tmp_path, reordered, "b.yaml"))
    assert a.config_hash == b.config_hash == config_hash(b.config)
    c = load_config(write(tmp_path, MINIMAL.replace("seq_len: 32", "seq_len: 64"), "c.yaml"))
    assert c.config_hash != a.config_hash


# ------------------------------------------------------------------ bounded YAML (issue 24 items 4, 22)

def _refused(path: Path, code: str) -> ConfigError:
    import time

    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert time.monotonic() - start < 5  # a hang guard, not a benchmark: each case takes ~0.1 s
    assert e.value.findings[0].code == code, e.value.findings
    assert e.value.findings[0].file == str(path)
    return e.value


def test_billion_laughs_is_refused_fast(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    err = _refused(write(tmp_path, "\n".join(lines) + "\n"), "yaml.too_large")
    assert "aliases" in err.findings[0].message and err.findings[0].line is not None


def test_deep_flow_nesting_is_refused_before_parsing(tmp_path):
    err = _refused(write(tmp_path, "model:\n  a: " + "[" * 20_000 + "]" * 20_000 + "\n"), "yaml.too_deep")
    assert err.findings[0].line == 2


def test_deep_block_nesting_is_refused(tmp_path):
    _refused(write(tmp_path, "model:\n  " + "- " * 20_000 + "1\n"), "yaml.too_deep")
    nested = "".join(" " * i + f"k{i}:\n" for i in range(40)) + " " * 40 + "v: 1\n"
    err = _refused(write(tmp_path, nested), "yaml.too_deep")
    assert err.findings[0].path.startswith("k0.k1.k2")


def test_dense_config_is_refused_before_a_slow_parse(tmp_path):
    _refused(write(tmp_path, "a: [" + "1," * 30_000 + "1]\n"), "yaml.too_large")


def test_oversized_config_is_refused_by_size(tmp_path):
    err = _refused(write(tmp_path, MINIMAL + "# " + "x" * 200_000 + "\n"), "file.too_large")
    assert "64 KiB" in err.findings[0].expected


def test_fifo_and_device_configs_are_refused(tmp_path):
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    _refused(fifo, "file.not_regular")
    _refused(Path("/dev/zero"), "file.not_regular")


def test_aliases_within_bounds_still_work(tmp_path):
    text = MINIMAL.replace("  batch_size: 2", "  batch_size: &b 2") + "training:\n  eval_batches: *b\n"
    assert load_config(write(tmp_path, text)).config.training.eval_batches == 2


# ------------------------------------------------------------------ non-finite and unbounded values (24.14)

@pytest.mark.parametrize(("key", "value"), [
    ("optimizer.lr", "1e400"), ("optimizer.eps", ".inf"), ("optimizer.weight_decay", ".nan"),
    ("optimizer.min_lr", ".inf"), ("optimizer.beta1", ".nan"), ("model.architecture.rms_norm_eps", ".inf"),
    ("model.architecture.initializer_range", ".nan"), ("model.architecture.rope_theta", ".inf"),
    ("training.grad_clip", ".inf"), ("training.decay_fraction", ".nan"),
    ("training.seed", "18446744073709551616"), ("training.seed", "-1"),
    ("model.architecture.vocab_size", "1e20"), ("model.architecture.hidden_size", "1e400"),
    ("training.vram", "24"), ("training.vram", "2EiB"),
])
def test_non_finite_and_unbounded_values_fail_at_their_line(tmp_path, key, value):
    from ruamel.yaml import YAML

    doc = YAML(typ="safe").load(MINIMAL)
    *parents, last = key.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = "@@"
    import io

    buf = io.StringIO()
    YAML(typ="safe").dump(doc, buf)
    text = buf.getvalue().replace("'@@'", value)
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    f = e.value.findings[0]
    assert f.path == key and f.line is not None and f.file == str(path)
    assert f.line == text.splitlines().index(next(ln for ln in text.splitlines() if value in ln)) + 1
