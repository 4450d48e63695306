"""Config-only checks (apr/plan/validate.py): one round of findings, train data reused as val, and
the config facts validate computes being the plan's."""

from __future__ import annotations

import inspect
import json

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import load_config
from apr.config.loader import PartialConfig, load_config_partial
from apr.plan import configfacts, facts
from apr.plan.validate import config_findings, data_path_findings

runner = CliRunner()

ARCH = ("model:\n  architecture:\n    hidden_size: {hidden}\n    num_hidden_layers: 2\n    num_attention_heads: 4\n"
        "    num_key_value_heads: 3\n    intermediate_size: 256\n    vocab_size: 512\n"
        "    max_position_embeddings: 64\n")


def _codes(config, *settings) -> list[str]:
    r = runner.invoke(app, ["train", "validate", str(config), *settings, "--json"])
    return [f["code"] for f in json.loads(r.stdout)["findings"]]


def test_schema_errors_and_contract_errors_come_in_one_round(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ARCH.format(hidden=64) + "data:\n  train: t/\n  batch_size: 2\n  seq_len: 128\n  seq_length: 3\n"
                   "training:\n  lr: 3\n  max_steps: 10\n  warmup_steps: 10\n"
                   "monitoring:\n  alerts:\n    - condition: 'los > 3'\n")
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    doc = json.loads(r.stdout)
    codes = {f["code"] for f in doc["findings"]}
    assert r.exit_code == 1 and doc["valid"] is False
    # the typos, and what the valid keys say: GQA (4 heads, 3 kv heads), seq_len > positions, warmup, alert
    assert {"schema.unknown_key", "C-ARCH-002", "C-ARCH-004", "C-TRAINCFG-008", "alert.unknown_metric"} <= codes
    by_code = {f["code"]: f for f in doc["findings"]}
    assert "did you mean 'loss'?" in by_code["alert.unknown_metric"]["message"]
    assert any("did you mean 'optimizer.lr'?" in f["message"] for f in doc["findings"])
    text = runner.invoke(app, ["train", "validate", str(cfg)])
    assert text.exit_code == 1 and "C-ARCH-002" in text.output and "unknown key 'seq_length'" in text.output


def test_a_check_reading_a_bad_value_is_not_run_on_a_stand_in(tmp_path):
    """hidden_size: wide fails the schema; contracts that read it (heads divide it) are skipped, those
    that do not (seq_len against positions) still run."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ARCH.format(hidden="wide") + "data:\n  train: t/\n  batch_size: 2\n  seq_len: 128\n")
    partial = load_config_partial(cfg)
    assert isinstance(partial, PartialConfig) and ("model", "architecture", "hidden_size") in partial.tainted
    codes = _codes(cfg)
    assert "schema.value_error" in codes and "C-ARCH-004" in codes
    assert "C-ARCH-001" not in codes and "C-ARCH-003" not in codes and "C-MEM-001" not in codes


def test_an_unusable_config_still_reports_its_schema_errors(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: 3\ndata: []\n")
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert r.exit_code == 1 and {f["code"] for f in json.loads(r.stdout)["findings"]} <= {
        "schema.model_type", "schema.model_attributes_type", "schema.missing", "schema.dict_type"}


@pytest.mark.parametrize(("val", "train", "how"), [
    ("t", "t", "is"), ("./t/", "t", "is"), ("t/val", "t", "lies inside"), ("d", "d/train", "holds")])
def test_validation_data_that_is_training_data_is_an_error_naming_both_keys(tmp_path, monkeypatch, val, train, how):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ARCH.format(hidden=64).replace("num_key_value_heads: 3", "num_key_value_heads: 2")
                   + f"data:\n  train: {train}\n  val: {val}\n  batch_size: 2\n  seq_len: 32\n")
    (f,) = [f for f in data_path_findings(load_config(cfg)) if f.code == "config.val_is_train"]
    assert f.severity == "error" and f.path == "data.val" and f.line == 12
    assert f"data.val ({val}) {how} data.train ({train})" in f.message and "data.train" in f.expected


def test_a_mixture_source_reused_as_validation_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "web", target_is_directory=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ARCH.format(hidden=64).replace("num_key_value_heads: 3", "num_key_value_heads: 2")
                   + "data:\n  train:\n    - {name: web, path: web}\n    - {name: code, path: code, val: code/held}\n"
                   f"  val: {tmp_path}/link\n  batch_size: 2\n  seq_len: 32\n")
    found = {(f.path, f.message.split(":")[0]) for f in config_findings(load_config(cfg))
             if f.code == "config.val_is_train"}
    assert found == {("data.val", f"data.val ({tmp_path}/link) is data.train[0].path (web)"),
                     ("data.train[1].val", "data.train[1].val (code/held) lies inside data.train[1].path (code)")}


def test_the_plan_refuses_training_data_as_validation_data_too(tmp_path, monkeypatch):
    from apr.plan.examples import materialize

    config, _ = materialize({}, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    train = load_config(config).config.data.train
    r = runner.invoke(app, ["train", "plan", str(config), f"data.val={train}/", "--json"])
    assert r.exit_code == 1
    findings = json.loads(r.stdout)["findings"]
    assert any(f["code"] == "config.val_is_train" and f["path"] == "data.val" and "data.train" in f["message"]
               for f in findings)


def test_every_check_validate_runs_the_plan_runs_too():
    """apply plans before it trains: a check validate makes and the plan skips would let apply run a
    config validate refuses. Each of validate's checks names the plan's fuller version, called in
    apr/plan/build.py, or is run by the plan as it is (``plan_checks``)."""
    from apr.plan import build, validate

    source = inspect.getsource(build)
    assert "plan_checks(loaded)" in source
    for check, _reads, own in validate._CHECKS:
        assert own is None or f"{own}(" in source, (check, own)


def test_the_plan_refuses_a_masked_lm_on_the_walk_as_validate_does(tmp_path, monkeypatch):
    from apr.plan.examples import materialize

    config, _ = materialize({}, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    settings = ["training.mode=mlm", "training.mlm.mask_token_id=3", "training.engine=interleaved"]
    for command in ("validate", "plan"):
        r = runner.invoke(app, ["train", command, str(config), *settings, "--json"])
        found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.mlm"]
        assert r.exit_code == 1 and [f["path"] for f in found] == ["training.engine"], (command, found)


NAMES = ("FactSheet", "lora_facts", "model_facts", "memory_facts", "mfu_facts", "execution_facts", "config_facts",
         "sharding_facts")


@pytest.mark.parametrize("name", NAMES)
def test_validate_computes_the_config_facts_the_plan_computes(name):
    """apr/plan/configfacts.py holds what validate needs without the plan's heavy imports; the plan
    uses the very same functions (one definition each: facts.py never defines them again)."""
    assert getattr(facts, name, getattr(configfacts, name)) is getattr(configfacts, name)
    assert f"def {name}(" not in inspect.getsource(facts) and f"class {name}" not in inspect.getsource(facts)



def test_base_facts_are_the_start_of_the_config_facts(repo):
    """Without a target validate stops at base_facts: they must be exactly what config_facts holds."""
    for name in ("demo-tiny.yaml", "lora-350m.yaml"):
        config = load_config(repo / "configs/train" / name).config
        base = configfacts.base_facts(config, 2)
        full = configfacts.config_facts(config, world_size=2, target=None).facts
        assert base == {k: full[k] for k in base}, name


TRUNK = ("model:\n  architecture:\n    hidden_size: 64\n    num_hidden_layers: 4\n    num_attention_heads: 4\n"
         "    num_key_value_heads: 2\n    intermediate_size: 128\n    vocab_size: 512\n"
         "    max_position_embeddings: 64\n  stacking:\n"
         "    stages: [{{blocks: 2, steps: 3{precision}}}, {{blocks: 4}}]\n"
         "{extra}data:\n  train: t/\n  batch_size: 2\n  seq_len: 32\ntraining:\n  max_steps: 10\n{training}")


@pytest.mark.parametrize("precision, extra, training, path", [
    ("", "    trunk_strategy: qlora\n", "", "model.stacking.trunk_strategy"),  # a qlora trunk that still trains
    ("", "    earlier: freeze\n    trunk_lora: {rank: 40}\n", "", "model.stacking.trunk_lora.rank"),  # > the layer
    (", precision: nvfp4", "    earlier: freeze\n", "", "model.stacking.stages[0].precision"),
    (", precision: bf16", "    earlier: freeze\n    trunk_strategy: qlora\n", "", "model.stacking.stages[0].precision"),
    (", precision: bf16", "    earlier: freeze\n", "  sharding: full\n  world_size: 2\n", "training.sharding"),
    ("", "    earlier: freeze\n    trunk_lora: {rank: 4, trunk_dtype: bf16}\n", "",
     "model.stacking.trunk_lora.trunk_dtype"),
    ("", "    earlier: freeze\n    cache_activations: true\n", "", "model.stacking.cache_activations"),  # embedding
    ("", "    earlier: freeze\n    freeze_embedding: true\n    cache_activations: true\n    building_mode: prepend\n",
     "", "model.stacking.cache_activations"),
    ("", "    freeze_embedding: true\n", "", "model.stacking.freeze_embedding"),  # earlier: train
    ("", "    earlier: freeze\n  lora: {rank: 40}\n", "", "model.lora.rank"),  # the user's key, not trunk_lora
    ("", "  lora: {rank: 4}\n", "", "model.lora"),  # trunk adapters on a trunk that trains
    ("", "    earlier: freeze\n    trunk_lora: {rank: 8}\n  lora: {rank: 4}\n", "", "model.lora"),  # both, differing
    ("", "    earlier: freeze\n  lora: {rank: 4}\n  init_from: w/\n", "", "model.init_from"),
    ("", "    earlier: freeze\n    progressive_lora: {rank: 2}\n", "", "model.stacking.progressive_lora"),  # no base
    ("", "    earlier: freeze\n    trunk_lora: {rank: 4}\n    progressive_lora: {rank: 65}\n", "",
     "model.stacking.progressive_lora.rank"),  # larger than the 64-wide projections
])
def test_a_trunk_that_cannot_be_stored_or_adapted_is_refused_at_its_key(tmp_path, precision, extra, training, path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TRUNK.format(precision=precision, extra=extra, training=training))
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.stacking"]
    assert r.exit_code == 1 and path in [f["path"] for f in found], found
    assert all(f["line"] for f in found)  # every finding points at its line


QLORA = ("model:\n  init_from: base/\n  lora: {{rank: 4, trunk_dtype: nf4}}\n  architecture:\n"
         "    hidden_size: {hidden}\n    num_hidden_layers: 2\n    num_attention_heads: 4\n    num_key_value_heads: 2\n"
         "    intermediate_size: 128\n    vocab_size: 512\n    max_position_embeddings: 64\n"
         "data:\n  train: t/\n  batch_size: 2\n  seq_len: 32\ntraining:\n  max_steps: 10\n{training}")


@pytest.mark.parametrize("hidden, training, path", [
    (64, "", None),  # every projection splits into NF4's 64-weight blocks
    (40, "", "model.lora.trunk_dtype"),  # k_proj's 40 x 20 weights do not
    (64, "  sharding: full\n  world_size: 2\n", "training.sharding"),  # FSDP2 cannot shard NF4 codes
])
def test_a_qlora_base_that_cannot_be_stored_in_nf4_is_refused_at_its_key(tmp_path, hidden, training, path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(QLORA.format(hidden=hidden, training=training))
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    found = [f for f in json.loads(r.stdout)["findings"] if f["code"] == "config.lora"]
    assert [f["path"] for f in found] == ([path] if path else []), found
    assert all(f["line"] for f in found) and (r.exit_code == 1) == bool(path)


def test_a_frozen_qlora_trunk_validates(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TRUNK.format(precision="", extra="    earlier: freeze\n    trunk_strategy: qlora\n"
                                "    building_mode: prepend\n", training=""))
    assert "config.stacking" not in _codes(cfg)


def test_model_lora_on_a_stacked_run_is_the_trunks_adapters(tmp_path):
    """A user's model.lora on a stacked run validates and configures exactly what trunk_lora does
    (the run, its checkpoints and export read the config alone); the same value under both keys too."""
    docs = {name: TRUNK.format(precision="", extra=extra, training="") for name, extra in (
        ("lora", "    earlier: freeze\n  lora: {rank: 4, alpha: 8, targets: mlp, dropout: 0.1}\n"),
        ("trunk", "    earlier: freeze\n    trunk_lora: {rank: 4, alpha: 8, targets: mlp, dropout: 0.1}\n"),
        ("both", "    earlier: freeze\n    trunk_lora: {rank: 4, alpha: 8, targets: mlp, dropout: 0.1}\n"
                 "  lora: {rank: 4, alpha: 8, targets: mlp, dropout: 0.1}\n"))}
    dumps = {}
    for name, text in docs.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        assert "config.stacking" not in _codes(tmp_path / f"{name}.yaml"), name
        config = load_config(tmp_path / f"{name}.yaml").config
        assert config.model.lora is None and config.model.stacking.trunk_lora.modules == ("gate_proj", "up_proj",
                                                                                           "down_proj")
        dumps[name] = config.model_dump(mode="json")
    assert dumps["lora"] == dumps["trunk"] == dumps["both"]


def test_a_progressive_rank_that_is_not_positive_is_refused_at_its_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(TRUNK.format(precision="", extra="    earlier: freeze\n    trunk_lora: {rank: 4}\n"
                                "    progressive_lora: {rank: 0}\n", training=""))
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    found = [f for f in json.loads(r.stdout)["findings"] if f["path"] == "model.stacking.progressive_lora.rank"]
    assert r.exit_code == 1 and found and found[0]["line"] == 14, found


def _unusable_output_dir(tmp_path, apr_home, kind):
    import os

    if kind == "device":
        return "/dev/null", "a device"
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe")
        return str(tmp_path / "pipe"), "a FIFO"
    if kind == "file":
        (tmp_path / "notes.txt").write_text("mine\n")
        return str(tmp_path / "notes.txt"), "a regular file"
    if kind == "under_a_file":
        (tmp_path / "notes.txt").write_text("mine\n")
        return str(tmp_path / "notes.txt" / "run"), "lies under"
    if kind == "apr_home":
        return str(apr_home), "apr's own home"
    return str(apr_home / "runs" / "a"), "inside apr's own home"


@pytest.mark.parametrize("kind", ["device", "fifo", "file", "under_a_file", "apr_home", "inside_apr_home"])
@pytest.mark.parametrize("command", ["validate", "plan"])
def test_an_output_dir_that_cannot_be_a_runs_folder_is_refused_at_its_key(tmp_path, monkeypatch, _private_apr_home,
                                                                          kind, command):
    """Not passed by the plan and then refused by apply with "cannot lock the output folder: File exists"."""
    from apr.plan.examples import materialize

    config, _ = materialize({}, tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    out, needle = _unusable_output_dir(tmp_path, _private_apr_home, kind)
    r = runner.invoke(app, ["train", command, str(config), f"training.output_dir={out}", "--json"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    found = [f for f in json.loads(r.stdout)["findings"] if f["path"] == "training.output_dir"]
    assert [f["code"] for f in found] == ["config.output_dir"] and needle in found[0]["message"], found
    assert not (tmp_path / "pipe").exists() or (tmp_path / "pipe").is_fifo()


@pytest.mark.parametrize("command", ["validate", "plan"])
def test_an_output_dir_with_a_nul_byte_is_a_finding_not_a_traceback(tmp_path, command):
    config = tmp_path / "cfg.yaml"
    config.write_text(ARCH.format(hidden=64) + "data: {train: data/, batch_size: 2, seq_len: 32}\n"
                      'training:\n  output_dir: "runs/a\\0b"\n')
    r = runner.invoke(app, ["train", command, str(config), "--json"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    found = [f for f in json.loads(r.stdout)["findings"] if f["path"] == "training.output_dir"]
    assert found and "NUL byte" in found[0]["message"] and found[0]["line"] == 12
