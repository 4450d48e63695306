"""The custom objective's checks (apr/plan/customfacts.py): `apr train validate` refuses each
combination that cannot work at its key path, and `apr train plan` reads every shard's footer for
the targets column, refusing a shard without it by file and column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from apr.cli.main import app
from tests.train.run_helpers import make_dataset, write_config

runner = CliRunner()
CUSTOM = {"engine": "standard", "mode": "custom", "custom": {"targets_column": "labels"}}


def _findings(args: list[str]) -> tuple[int, list[dict]]:
    r = runner.invoke(app, [*args, "--json"])
    assert "Traceback" not in r.stdout
    return r.exit_code, json.loads(r.stdout)["findings"]


def _add_targets(root, skip: str | None = None) -> None:
    """A list<int32> ``labels`` column (the ids) beside the ids in every shard without one but ``skip``'s."""
    for shard in sorted((root / "data").rglob("*.parquet")):
        table = pq.read_table(shard)
        if (shard.name != skip or shard.parent.name != "val") and "labels" not in table.column_names:
            labels = table.column("input_ids").cast(pa.list_(pa.int32()))
            pq.write_table(table.append_column("labels", labels), shard)


def test_validate_refuses_the_walk_and_a_mode_without_its_section_not_sharding(tmp_path):
    make_dataset(tmp_path)
    code, found = _findings(["train", "validate", str(write_config(tmp_path, training={
        **CUSTOM, "engine": "interleaved", "sharding": "full", "world_size": 2}))])
    custom = [f for f in found if f["code"] == "config.custom"]
    assert code == 1 and [f["path"] for f in custom] == ["training.engine"]  # FSDP2 runs it
    assert "fuses the causal-LM loss" in custom[0]["message"]
    code, found = _findings(["train", "validate", str(write_config(tmp_path, training={"mode": "custom",
                                                                                       "engine": "standard"}))])
    assert code == 1 and [f["path"] for f in found if f["code"] == "config.custom"] == ["training.mode"]
    code, found = _findings(["train", "validate", str(write_config(tmp_path, training={"custom": {}}))])
    assert code == 1 and [f["got"] for f in found if f["code"] == "config.custom"] == ["causal_lm"]


def test_the_plan_refuses_a_shard_without_the_targets_column_naming_the_file_and_the_column(tmp_path):
    make_dataset(tmp_path)
    _add_targets(tmp_path, skip="shard-00000.parquet")  # every training shard; not the validation one
    code, found = _findings(["train", "plan", str(write_config(tmp_path, training=CUSTOM))])
    missing = [f for f in found if f["code"] == "data.column"]
    assert code == 1 and len(missing) == 1 and missing[0]["path"] == "training.custom.targets_column"
    assert missing[0]["file"] == str(tmp_path / "data" / "val" / "shard-00000.parquet")
    assert "no column 'labels'" in missing[0]["message"] and missing[0]["expected"] == "column 'labels'"
    _add_targets(tmp_path)
    code, found = _findings(["train", "plan", str(write_config(tmp_path, training=CUSTOM))])
    assert code == 0 and [f for f in found if f["severity"] == "error"] == []
