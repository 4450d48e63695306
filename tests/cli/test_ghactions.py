"""`--format github`: GitHub Actions workflow commands, one per finding, and a Markdown step summary."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from apr.cli.ghactions import annotation, escape_data, escape_property
from apr.cli.main import app
from apr.errors import Finding
from apr.plan.examples import materialize

runner = CliRunner()

# The workflow-command grammar: ::name key=value,key=value::data, with %, CR, LF escaped in data and
# additionally ':' and ',' in property values, so neither can end a value or the property list early.
LINE = re.compile(r"^::(?P<cmd>error|warning|notice)(?: (?P<props>[A-Za-z]+=[^,:\r\n]*(?:,[A-Za-z]+=[^,:\r\n]*)*))?"
                  r"::(?P<data>[^\r\n]*)$")


def unescape(text: str) -> str:
    return (text.replace("%0D", "\r").replace("%0A", "\n").replace("%3A", ":").replace("%2C", ",")
            .replace("%25", "%"))


def parse(line: str) -> dict:
    m = LINE.match(line)
    assert m, f"not a workflow command: {line!r}"
    props = dict(p.split("=", 1) for p in m["props"].split(",")) if m["props"] else {}
    return {"cmd": m["cmd"], **{k: unescape(v) for k, v in props.items()}, "message": unescape(m["data"])}


def annotations(stdout: str) -> list[dict]:
    return [parse(line) for line in stdout.splitlines() if line.startswith("::")]


def test_messages_and_properties_are_escaped_and_read_back_unchanged():
    hostile = "100% sure: a,b\nsecond line\r::error::injected"
    f = Finding("warning", "C-X-001", hostile, path="a.b", file="dir,x/odd:name.yaml", line=3, column=7)
    line = annotation(f)
    assert "\n" not in line and "\r" not in line
    got = parse(line)
    assert got["cmd"] == "warning" and got["file"] == "dir,x/odd:name.yaml"
    assert got["line"] == "3" and got["col"] == "7" and got["title"] == "C-X-001 a.b"
    assert got["message"].startswith("a.b: " + hostile)
    assert escape_data("%\n") == "%25%0A" and escape_property("a:b,c") == "a%3Ab%2Cc"


def test_info_findings_are_notices_and_a_finding_without_a_line_has_no_line():
    got = parse(annotation(Finding("info", "C-Y-002", "note"), default_file="cfg.yaml"))
    assert got["cmd"] == "notice" and got["file"] == "cfg.yaml" and "line" not in got


BAD = """\
model:
  architecture:
    hidden_size: 64
    num_hidden_layers: lots
data:
  batch_size: 2
training:
  lr: 1e-3
"""


def test_validate_annotates_each_finding_at_its_line_and_writes_the_step_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BAD)
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    gh = runner.invoke(app, ["train", "validate", str(cfg), "--format", "github"])
    js = runner.invoke(app, ["train", "validate", str(cfg), "--json"])
    assert gh.exit_code == js.exit_code == 1
    findings = json.loads(js.stdout)["findings"]
    got = annotations(gh.stdout)
    assert len(got) == len(findings) >= 3
    for a, f in zip(got, findings, strict=True):
        assert a["cmd"] == "error" and a["file"] == "cfg.yaml"  # relative to the workspace (here: cwd)
        assert a["line"] == str(f["line"]) and a["title"].startswith(f["code"])
    lines = {a["title"].split()[-1]: int(a["line"]) for a in got}
    assert lines["model.architecture.num_hidden_layers"] == 4 and lines["training.lr"] == 8
    assert gh.stdout.count("\n") == len(got)  # the summary went to the file, not the log
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "invalid" in text and "| error | schema.unknown_key |" in text


def test_github_output_is_a_usage_error_beside_json_and_unknown_formats_are_refused(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(BAD)
    for args in (["--json", "--format", "github"], ["--format", "xml"]):
        for cmd in ("validate", "plan"):
            r = runner.invoke(app, ["train", cmd, str(cfg), *args])
            assert r.exit_code == 2, (cmd, args, r.output)


def test_validate_takes_several_files_as_pre_commit_passes_them(repo, tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    good = repo / "configs/train/demo-tiny.yaml"
    assert runner.invoke(app, ["train", "validate", str(good), str(good)]).exit_code == 0
    r = runner.invoke(app, ["train", "validate", str(good), str(bad), "--json"])
    assert r.exit_code == 1
    docs = json.loads(r.stdout)
    assert [d["valid"] for d in docs] == [True, False] and docs[1]["file"] == str(bad)
    r = runner.invoke(app, ["train", "validate", str(good), str(bad), "--format", "github"])
    assert r.exit_code == 1 and r.stdout.count("### ") == 2  # one summary section per file


def test_pre_commit_hook_runs_validate_on_yaml_configs(repo):
    hooks = yaml.safe_load((repo / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "apr-validate"]
    assert hook["entry"].split() == ["apr", "train", "validate"] and hook["language"] == "system"
    assert re.search(hook["files"], "configs/train/pretrain-50m.yaml")


@pytest.fixture
def plan_dirs(tmp_path):
    good, _ = materialize({}, tmp_path / "good")
    bad, _ = materialize({"tokenizer": {"vocab_size": 1024}}, tmp_path / "bad")  # larger than the model
    return good, bad


def test_plan_annotations_match_its_findings_and_exit_codes(plan_dirs, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    for cfg in plan_dirs:
        monkeypatch.chdir(cfg.parent)
        gh = runner.invoke(app, ["train", "plan", str(cfg), "--format", "github"])
        js = runner.invoke(app, ["train", "plan", str(cfg), "--json"])
        assert gh.exit_code == js.exit_code, gh.output
        findings = json.loads(js.stdout)["findings"]
        got = annotations(gh.stdout)
        assert [(a["cmd"], a["title"].split()[0]) for a in got] == [
            ({"info": "notice"}.get(f["severity"], f["severity"]), f["code"]) for f in findings]
        assert [a.get("line") for a in got] == [None if f["line"] is None else str(f["line"]) for f in findings]
        assert "| steps |" in gh.stdout and "| memory |" in gh.stdout
    assert gh.exit_code == 1 and any(a["cmd"] == "error" for a in got)
