"""docs/plan.md documents what the code does: every GPU name, every JSON key, the exit codes, the
summary line and the ALB-060 example are checked against what `apr train plan` produces."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.plan.build import PLAN_KEYS, build_plan
from apr.plan.examples import materialize
from apr.plan.gpus import CATALOGUE

runner = CliRunner()

# The reference's ALB-060 run, as docs/plan.md describes it: 22,079 sequences, batch 4 x accumulation
# 128, 5,000 steps, 2,000 warmup steps at lr 3e-4 (the model's size does not enter these findings).
ALB060 = {"config": {"data": {"batch_size": 4}, "optimizer": {"lr": 3.0e-4},
                     "training": {"epochs": 1, "max_steps": 5000, "warmup_steps": 2000,
                                  "gradient_accumulation": 128}},
          "train": {"rows": 22_079}}


@pytest.fixture
def text(repo) -> str:
    return (repo / "docs/plan.md").read_text()


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_plan_doc_lists_the_gpu_catalogue(text):
    for name, gpu in CATALOGUE.items():
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
        assert row is not None, f"--gpu {name} missing from docs/plan.md"
        assert f"{gpu.vram_bytes / 2**30:.2f} GiB" in row and f"{gpu.mfu:.0%}" in row


def test_plan_doc_lists_every_json_key(text):
    for key in PLAN_KEYS:
        assert f"`{key}`" in text, f"JSON key {key} undocumented"


def test_the_documented_exit_codes_are_the_ones_plan_exits_with(text, example_dir, tmp_path):
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", _section(text, "Exit codes"), re.M)}
    failing, _ = materialize(ALB060, tmp_path / "alb060")
    warning, _ = materialize({"config": {"training": {"save_interval": 100}}}, tmp_path / "warn")
    cases = [  # (words of the documented row, arguments, exit code)
        ("no error finding", [example_dir], 0),
        ("no error finding", [warning], 0),  # a warning alone does not fail...
        ("a warning with `--strict`", [warning, "--strict"], 1),  # ...unless --strict
        ("an error finding", [failing], 1),
        ("unknown `--gpu`", [example_dir, "--gpu", "no-such-gpu"], 2),
        ("unknown option", [example_dir, "--no-such-option"], 2),
        ("missing CONFIG", [], 2),
    ]
    seen = set()
    for words, args, expected in cases:
        code = runner.invoke(app, ["train", "plan", *map(str, args)]).exit_code
        assert code == expected, (words, code)
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| {code} |")), "")
        assert words in row, f"exit {code} ({words}) is not what docs/plan.md says: {row}"
        seen.add(code)
    assert seen == documented


def test_the_summary_line_is_the_documented_template(text, tmp_path):
    template = re.search(r"the last line `(Plan: [^`]+)`", text).group(1)
    pattern = re.escape(template).replace("N", r"(\d+)").replace("W", r"(\d+)").replace("E", r"(\d+)")
    failing, _ = materialize(ALB060, tmp_path / "alb060")
    out = runner.invoke(app, ["train", "plan", str(failing)]).stdout
    summary = json.loads(runner.invoke(app, ["train", "plan", str(failing), "--json"]).stdout)["summary"]
    match = re.fullmatch(pattern, out.strip().splitlines()[-1])
    assert match, (template, out.strip().splitlines()[-1])
    assert tuple(map(int, match.groups())) == (summary["passed"], summary["warnings"], summary["errors"])
    assert re.search(rf"^{pattern}$", text, re.M), "the example output's last line does not follow the template"


def _documented_findings(block: str) -> dict[str, dict]:
    """The findings of a text-output example: code -> key, message (unwrapped), expected, got."""
    found: dict[str, dict] = {}
    for head in re.finditer(r"^  \w+\[([A-Z0-9-]+)\] \S+ (\S+)\n((?:      .*\n)+)", block, re.M):
        body = head.group(3)
        message = " ".join(ln.strip() for ln in body.splitlines() if not re.match(r"\s+(expected|got):", ln))
        fields = dict(re.findall(r"^\s+(expected|got):\s+(.*)$", body, re.M))
        found[head.group(1)] = {"path": head.group(2), "message": message, **fields}
    return found


def test_the_alb060_example_is_what_plan_reports(text, tmp_path):
    start = text.index("ALB-060 run")
    block = text[text.index("```\n", start) + 4:text.index("\n```", text.index("```\n", start) + 4) + 1]
    documented = _documented_findings(block)
    assert set(documented) == {"C-TRAINCFG-001", "C-TRAINCFG-003"}
    config, kwargs = materialize(ALB060, tmp_path / "alb060")
    plan = build_plan(config, **kwargs)
    actual = {f.code: {"path": f.path, "message": " ".join(f.message.split()), "expected": str(f.expected),
                       "got": str(f.got)} for f in plan.findings}
    for code, doc in documented.items():
        assert actual[code] == doc, code
