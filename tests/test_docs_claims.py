"""Claims the user docs make about what apr does, checked against the code, the schema and the test
collection, so a doc cannot drift into contradicting them again (issue 54 item 9)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import yaml
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config.schema import OptimizerConfig
from tests.train.run_helpers import make_dataset, write_config

DOCS = Path(__file__).resolve().parents[1] / "docs"
TESTS = Path(__file__).resolve().parent
TRUNK = "The trunk: precision per stack, LoRA and QLoRA (StackWise)"  # docs/training.md's section
runner = CliRunner()


def _section(text: str, heading: str) -> str:
    """The body under a markdown heading, up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"no heading {heading!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def _test_names(path: Path) -> list[str]:
    return [n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")]


def _validate(cfg: Path) -> list[dict]:
    r = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    return json.loads(r.stdout)["findings"]


def test_distributed_md_lists_no_feature_of_its_shards_table_as_unsupported():
    text = (DOCS / "distributed.md").read_text()
    table = _section(text, "Features on shards")
    unsupported = _section(text, "Not supported yet")
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| feature")]
    assert rows
    for row in rows:
        for key in re.findall(r"`([^`]+)`", row.split("|")[1]):
            assert key not in unsupported, (key, "is measured on shards in the table")
    # the bf16 LoRA trunk on shards: in the table, tested, accepted by the config checks
    assert any("trunk_dtype: bf16" in row for row in rows)
    assert "test_a_bf16_lora_trunk_on_shards_trains_as_data_parallel" in _test_names(
        TESTS / "scenarios" / "test_composition.py")
    assert "bf16" not in unsupported


def test_the_sharding_refusals_are_the_ones_the_docs_name(tmp_path):
    """distributed.md may not say every feature runs on shards while validate refuses one."""
    make_dataset(tmp_path)
    stacking = {"stages": [{"blocks": 1, "steps": 4}, {"blocks": 2}], "earlier": "freeze",
                "trunk_strategy": "qlora"}
    cfg = write_config(tmp_path, model={"architecture": {"num_hidden_layers": 2}, "stacking": stacking},
                       training={"sharding": "full", "world_size": 2})
    refused = [f for f in _validate(cfg) if f["severity"] == "error" and f["path"] == "training.sharding"]
    assert refused, "the stacking trunk is no longer refused on shards: update docs/distributed.md"
    text = (DOCS / "distributed.md").read_text()
    features = _section(text, "Features on shards")
    assert "Every training feature runs on shards." not in features
    assert "`trunk_strategy`" in features and "refuse" in features
    assert "The only sharding layout refused" not in features
    training = _section((DOCS / "training.md").read_text(), TRUNK)
    assert "not under `training.sharding`" in training


def test_training_md_does_not_call_a_tested_trunk_under_ddp_untested():
    ddp = [n for n in _test_names(TESTS / "distributed" / "test_data_parallel.py") if "trunk" in n]
    assert ddp  # the test the doc names
    trunk = _section((DOCS / "training.md").read_text(), TRUNK)
    flat = " ".join(trunk.split())
    assert "not tested with a trunk" not in flat
    assert "tests/distributed/test_data_parallel.py" in flat


def test_sweeps_md_offers_the_optimizers_the_schema_has():
    names = sorted(o.value for o in type(OptimizerConfig.model_fields["name"].default))
    assert {"adamw", "sgd", "swats"} <= set(names)
    text = (DOCS / "sweeps.md").read_text()
    assert "AdamW only" not in text and "adamw only" not in text.lower()
    block = _section(text, "A DantinoX sweep, converted")
    sweep = yaml.safe_load(re.search(r"```yaml\n(.*?)```", block, re.S).group(1))
    offered = sweep["parameters"]["optimizer.name"]["values"]
    assert sorted(offered) == names


def test_config_md_starts_with_the_top_level_keys_extends_included():
    text = (DOCS / "config.md").read_text()
    assert "`top level`" not in text
    headings = re.findall(r"^## (.+)$", text, re.M)
    tables = [h for h in headings if not h.startswith("Reusing configs")]
    assert tables[0] == "Top-level keys"
    top = _section(text, "Top-level keys")
    assert re.search(r"^\| `extends` \|", top, re.M)


def test_an_unknown_top_level_key_lists_extends_among_the_keys(tmp_path):
    make_dataset(tmp_path)
    write_config(tmp_path, "base.yaml")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("extends: base.yaml\nbogus: 1\n")
    [unknown] = [f for f in _validate(cfg) if f["code"] == "schema.unknown_key"]
    assert "extends" in unknown["expected"].split("one of: ")[1].split(", ")
    cfg.write_text("extends: base.yaml\nextneds: base.yaml\n")
    [typo] = [f for f in _validate(cfg) if f["code"] == "schema.unknown_key"]
    assert "did you mean 'extends'?" in typo["message"]
