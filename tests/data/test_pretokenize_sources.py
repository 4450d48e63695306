"""apr data pretokenize --source NAME=PATH: several named sources in one call, one manifest."""

from __future__ import annotations

import json

from apr.data.mixplan import check_compatible
from apr.plan.datafacts import dataset_facts

from .conftest import assert_clean_failure, make_docs, write_txt


def test_named_sources_in_one_call_with_their_sizes(tmp_path, cli, tokenizer_path):
    web = write_txt(tmp_path / "web", make_docs(12, seed=1))
    code = write_txt(tmp_path / "code", make_docs(4, seed=2))
    out = tmp_path / "mix"
    res = cli("data", "pretokenize", "--source", f"web={web}", "--source", f"code={code}",
              "--tokenizer", tokenizer_path, "--seq-len", "16", "--val-fraction", "0.2", "--out", out)
    assert res.exit_code == 0, res.output
    assert "2 sources" in res.output and "web" in res.output and "code" in res.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["seq_len"] == 16 and m["row_len"] == 17 and set(m["sources"]) == {"web", "code"}
    for name in ("web", "code"):
        own = json.loads((out / name / "manifest.json").read_text())
        assert own["tokenizer"]["sha256"] == m["tokenizer"]["sha256"]
        assert m["sources"][name]["rows"] == {s: info["rows"] for s, info in own["splits"].items()}
        assert m["sources"][name]["rows"]["train"] == dataset_facts(str(out / name / "train"), "input_ids")["sequences"]
    assert m["sources"]["web"]["tokens_total"] > 2 * m["sources"]["code"]["tokens_total"]
    check_compatible({"web": out / "web" / "train", "code": out / "code" / "train"})  # one tokenizer, seq_len


def test_bad_source_options_are_refused(tmp_path, cli, tokenizer_path, corpus):
    res = cli("data", "pretokenize", "--source", "nameonly", "--tokenizer", tokenizer_path,
              "--seq-len", "16", "--out", tmp_path / "o")
    assert_clean_failure(res, "NAME=PATH")
    res = cli("data", "pretokenize", corpus, "--source", f"web={corpus}", "--tokenizer", tokenizer_path,
              "--seq-len", "16", "--out", tmp_path / "o")
    assert_clean_failure(res, "--source")
    assert not (tmp_path / "o").exists()
