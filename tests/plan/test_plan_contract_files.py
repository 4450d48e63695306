"""Contract files: malformed ones are clear errors; compiled.json is used only when it is current;
docs/contracts.md and compiled.json are regenerated from the YAML (stale -> this test fails)."""

from __future__ import annotations

import shutil

import pytest

from apr.plan.contracts import (
    COMPILED_NAME,
    ContractFileError,
    _load_cached,
    _parse_folder,
    compile_contracts,
    evaluate_contracts,
    load_contracts,
)
from apr.plan.docgen import outputs

GOOD = """family: demo-v1
title: Demo
contracts:
  - id: C-DEMO-001
    title: lr is small
    severity: warning
    needs: [config]
    path: optimizer.lr
    rule: config.optimizer.lr < 0.01
    message: lr ${config.optimizer.lr} is large
    rationale: a demo
    examples:
      - expect: pass
      - expect: fail
        config: {optimizer: {lr: 0.1}}
"""


def test_generated_files_are_current(repo):
    for path, text in outputs(repo).items():
        assert path.read_text() == text, f"{path.name} is stale: run python -m apr.plan.docgen"


def test_docs_list_every_contract(repo):
    text = (repo / "docs/contracts.md").read_text()
    for c in load_contracts().contracts:
        assert f"### {c.id}: {c.title}" in text


def test_compiled_cache_matches_the_yaml_exactly(repo):
    folder = repo / "contracts"
    assert load_contracts(folder).contracts == _parse_folder(folder, sorted(folder.glob("*.yaml"))).contracts


def test_stale_compiled_cache_is_ignored(tmp_path, repo):
    folder = tmp_path / "contracts"
    shutil.copytree(repo / "contracts", folder)
    yaml = folder / "architecture-v1.yaml"
    yaml.write_text(yaml.read_text().replace("title: hidden_size is divisible by num_attention_heads",
                                             "title: EDITED title"))
    assert load_contracts(folder).by_id("C-ARCH-001").title == "EDITED title"
    # regenerated: the cache is current again and gives the same contracts as the YAML
    (folder / COMPILED_NAME).write_text(compile_contracts(folder))
    _load_cached.cache_clear()
    assert load_contracts(folder).by_id("C-ARCH-001").title == "EDITED title"


def _write(tmp_path, text: str):
    folder = tmp_path / "c"
    folder.mkdir(exist_ok=True)
    (folder / "demo-v1.yaml").write_text(text)
    return folder


def test_a_user_contract_folder_works(tmp_path):
    from apr.config.loader import SourceMap

    folder = _write(tmp_path, GOOD)
    cs = load_contracts(folder)
    [c] = cs.contracts
    assert c.config_only and c.line == 4 and cs.families["demo-v1"]["title"] == "Demo"
    source = SourceMap("cfg.yaml", {("optimizer",): (7, 1)})
    [r] = evaluate_contracts(cs.contracts, {"optimizer": {"lr": 0.1}}, {}, source)
    assert r.status == "failed" and r.finding.message == "lr 0.1 is large" and r.finding.line == 7


@pytest.mark.parametrize(("edit", "needle"), [
    (("severity: warning", "severity: fatal"), "severity must be one of"),
    (("id: C-DEMO-001", "id: demo"), "must look like C-FAMILY-001"),
    (("rule: config.optimizer.lr < 0.01", "rule: config.optimizer.lr <"), "invalid CEL expression"),
    (("message: lr ${config.optimizer.lr} is large", "message: lr ${config.optimizer.lr +} is large"),
     "invalid CEL expression"),
    (("    rationale: a demo\n", ""), "'rationale' is required"),
    (("    path: optimizer.lr\n", "    path: optimizer.lr\n    colour: red\n"), "unknown key(s) ['colour']"),
    (("needs: [config]", "needs: [gpu]"), "needs must be among"),
    (("      - expect: pass\n", "      - expect: maybe\n"), "expect: pass or fail"),
    (("contracts:\n", "contracts:\n  - {}\n"), "'id' is required"),
    (("title: lr is small", "title: [unclosed"), "YAML"),
])
def test_malformed_contract_files_name_the_file_and_line(tmp_path, edit, needle):
    folder = _write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ContractFileError) as info:
        load_contracts(folder)
    assert needle in info.value.message or needle in info.value.findings[0].message
    f = info.value.findings[0]
    assert f.file.endswith("demo-v1.yaml") and f.line is not None


def test_duplicate_ids_across_files_are_refused(tmp_path):
    folder = _write(tmp_path, GOOD)
    (folder / "demo2-v1.yaml").write_text(GOOD.replace("demo-v1", "demo2-v1"))
    with pytest.raises(ContractFileError, match="duplicate contract id C-DEMO-001"):
        load_contracts(folder)
