"""Config reuse: `extends: base.yaml` and KEY=VALUE settings on the command line (apr/config/layers.py).

Precedence base < file < command line; maps merge, anything else replaces; every value remembers the
file (and line) it came from, so findings and `plan --explain` name it."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from apr.cli.main import app
from apr.config import load_config
from apr.config.layers import parse_settings
from apr.errors import ConfigError
from apr.plan.examples import materialize

runner = CliRunner()


@pytest.fixture
def layered(tmp_path, monkeypatch):
    """base.yaml (a complete, passing run) < mid.yaml (extends it) < top.yaml (extends mid)."""
    base, _ = materialize({}, tmp_path)
    base = base.rename(tmp_path / "base.yaml")
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mid.yaml").write_text(
        "extends: ../base.yaml\n"
        "optimizer:\n  lr: 1.0e-3\n  weight_decay: 0.05\n"
        "training:\n  max_steps: 16\n  seed: 5\n"
        "monitoring:\n  alerts:\n    - {condition: 'loss > 100', action: warn}\n")
    (tmp_path / "conf" / "top.yaml").write_text(
        "extends: mid.yaml\n"
        "optimizer:\n  lr: 2.0e-3\n"
        "monitoring:\n  alerts: []\n")
    monkeypatch.chdir(tmp_path)  # the example's data paths are relative to the current folder
    return tmp_path


def test_base_file_and_command_line_apply_in_that_order(layered):
    loaded = load_config(layered / "conf/top.yaml", ["optimizer.weight_decay=0.2", "training.seed=9"])
    c = loaded.config
    assert c.optimizer.lr == 2e-3  # top beats mid
    assert c.optimizer.weight_decay == 0.2 and c.training.seed == 9  # command line beats mid
    assert c.training.max_steps == 16  # from mid, kept
    assert c.model.architecture.hidden_size == 64  # from base, through mid
    assert c.monitoring.alerts == []  # a list replaces the base's whole
    assert loaded.layers.files == [str(layered / "conf/../base.yaml"), str(layered / "conf/mid.yaml"),
                                   str(layered / "conf/top.yaml")]


def _explain(*args) -> dict[str, tuple[str, str]]:
    r = runner.invoke(app, ["train", "plan", *map(str, args)])
    assert r.exit_code == 0, r.output
    out = {}
    for line in r.stdout.splitlines():
        assignment, origin = re.split(r"\s{2,}", line.strip())
        key, value = assignment.split(" = ", 1)
        out[key] = (json.loads(value), origin)
    return out


def test_explain_names_where_each_value_came_from(layered):
    rows = _explain(layered / "conf/top.yaml", "training.seed=9", "--explain", "training")
    assert rows["training.seed"] == (9, "command line")
    assert rows["training.max_steps"] == (16, f"{layered / 'conf/mid.yaml'}:6")
    assert rows["training.epochs"][1] == f"{layered / 'conf/../base.yaml'}:" + str(
        _line_of(layered / "base.yaml", "epochs"))
    assert rows["training.mode"] == ("causal_lm", "default")
    assert _explain(layered / "conf/top.yaml", "--explain", "optimizer.lr") == {
        "optimizer.lr": (0.002, f"{layered / 'conf/top.yaml'}:3")}


def _line_of(path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(key + ":"))


def test_the_plan_shows_what_the_file_and_the_command_line_change_from_the_base(layered):
    r = runner.invoke(app, ["train", "plan", str(layered / "conf/top.yaml"), "training.seed=9", "--json"])
    doc = json.loads(r.stdout)
    assert doc["overrides"] == {"training.seed": 9}
    changed = doc["layers"]["changed_from_base"]
    assert changed["optimizer.lr"] == {"base": 0.001, "value": 0.002, "from": f"{layered / 'conf/top.yaml'}:3"}
    assert changed["training.seed"]["base"] == 5 and changed["training.seed"]["from"] == "command line"
    assert doc["config"]["training"]["seed"] == 9
    text = runner.invoke(app, ["train", "plan", str(layered / "conf/top.yaml"), "training.seed=9"]).stdout
    assert "Config layers" in text and "optimizer.lr: 0.001 -> 0.002" in text and "training.seed: 5 -> 9" in text


def test_a_finding_about_a_value_from_a_base_names_the_base_file_and_line(layered):
    base = layered / "base.yaml"
    base.write_text(base.read_text().replace("hidden_size: 64", "hidden_size: wide"))
    r = runner.invoke(app, ["train", "validate", str(layered / "conf/top.yaml"), "--json"])
    assert r.exit_code == 1
    # mid's max_steps 16 makes the base's warmup 12.5% of the run: a warning beside the error
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"]
    assert f["path"] == "model.architecture.hidden_size" and f["file"] == str(layered / "conf/../base.yaml")
    assert f["line"] == _line_of(base, "hidden_size")


def test_settings_are_typed_as_yaml_values():
    assert parse_settings(["a.b=1e-3", "a.c=true", "a.d=null", "a.e=[1, 2]", "a.f=cosine", "a.g={x: 1}",
                           "a.h="]) == {"a.b": 1e-3, "a.c": True, "a.d": None, "a.e": [1, 2], "a.f": "cosine",
                                        "a.g": {"x": 1}, "a.h": ""}


@pytest.mark.parametrize("setting, message", [
    ("trainin.seed=3", "did you mean 'training'"),
    ("training.max_step=3", "did you mean 'max_steps'"),
    ("training.seed=abc", "valid integer"),
    ("training.seed.x=1", "training.seed"),
])
def test_a_bad_setting_is_a_finding_from_the_command_line(layered, setting, message):
    r = runner.invoke(app, ["train", "validate", str(layered / "conf/top.yaml"), setting, "--json"])
    assert r.exit_code == 1, r.output
    (f,) = [f for f in json.loads(r.stdout)["findings"] if f["severity"] == "error"]
    assert f["file"] == "command line" and f["line"] is None and message in f["message"] + str(f["got"])


def test_malformed_settings_are_refused():
    for bad in (["=3"], ["training.=3"], ["x"]):
        with pytest.raises(ConfigError):
            parse_settings(bad)


def test_an_extends_cycle_and_a_missing_base_are_errors_at_the_extends_line(tmp_path):
    (tmp_path / "a.yaml").write_text("# a\nextends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: [a.yaml]\n")
    r = runner.invoke(app, ["train", "validate", str(tmp_path / "a.yaml"), "--json"])
    (f,) = json.loads(r.stdout)["findings"]
    assert r.exit_code == 1 and f["code"] == "config.extends_cycle"
    assert "a.yaml -> " in f["message"] and f["file"] == str(tmp_path / "b.yaml") and f["line"] == 1
    (tmp_path / "c.yaml").write_text("model: {}\nextends: nowhere.yaml\n")
    r = runner.invoke(app, ["train", "validate", str(tmp_path / "c.yaml"), "--json"])
    (f,) = json.loads(r.stdout)["findings"]
    assert r.exit_code == 1 and f["code"] == "config.extends_missing" and f["line"] == 2
    (tmp_path / "d.yaml").write_text("extends: 3\n")
    r = runner.invoke(app, ["train", "validate", str(tmp_path / "d.yaml"), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["findings"][0]["code"] == "config.extends"


def test_a_plan_made_with_settings_stays_fresh_and_apply_refuses_new_settings_with_it(layered):
    from apr.apply import run_apply
    from apr.errors import AprError

    out = layered / "plan.json"
    r = runner.invoke(app, ["train", "plan", str(layered / "conf/top.yaml"), "training.seed=9", "-out", str(out)])
    assert r.exit_code == 0, r.output
    from apr.plan.planfile import check_plan_fresh, load_plan_file

    doc = load_plan_file(out)
    assert doc["overrides"] == {"training.seed": 9} and doc["config"]["training"]["seed"] == 9
    check_plan_fresh(doc)  # the same settings are applied again: not stale
    with pytest.raises(AprError, match="saved plan"):
        run_apply(out, settings=["training.seed=3"], apr_home=layered / "home", echo=lambda line: None)


def _validate_json(config):
    r = runner.invoke(app, ["train", "validate", str(config), "--json"])
    return r.exit_code, json.loads(r.stdout)["findings"]


@pytest.fixture
def repo_tree(tmp_path, monkeypatch):
    """A repository (a .git folder) holding configs/, with a secret file beside the repository."""
    monkeypatch.delenv("APR_EXTENDS_ANYWHERE", raising=False)
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "configs" / "train").mkdir(parents=True)
    base, _ = materialize({}, repo / "example")
    base.rename(repo / "configs" / "base.yaml")
    (tmp_path / "secrets.yaml").write_text("model: {architecture: {hidden_size: hunter2}}\n")
    return repo


def test_extends_may_name_a_base_anywhere_in_the_repository(repo_tree):
    top = repo_tree / "configs" / "train" / "run.yaml"
    top.write_text("extends: ../base.yaml\ntraining: {max_steps: 7}\n")
    loaded = load_config(top)
    assert loaded.config.training.max_steps == 7 and loaded.layers.files[0].endswith("base.yaml")


@pytest.mark.parametrize("name", ["../../../secrets.yaml", "{abs}", "../base-link.yaml"])
def test_extends_outside_the_repository_is_refused_unless_allowed(repo_tree, monkeypatch, name):
    secret = repo_tree.parent / "secrets.yaml"
    (repo_tree / "configs" / "base-link.yaml").symlink_to(secret)  # inside by name, outside once resolved
    top = repo_tree / "configs" / "train" / "run.yaml"
    top.write_text(f"extends: {name.format(abs=secret)}\n")
    code, findings = _validate_json(top)
    assert code == 1 and [f["code"] for f in findings] == ["config.extends_outside"]
    assert findings[0]["path"] == "extends" and findings[0]["line"] == 1 and "APR_EXTENDS_ANYWHERE" in \
        findings[0]["message"]
    monkeypatch.setenv("APR_EXTENDS_ANYWHERE", "1")
    code, findings = _validate_json(top)
    assert "config.extends_outside" not in {f["code"] for f in findings}
    assert "hunter2" not in json.dumps(findings)  # allowed, and still never echoed


def test_extends_names_only_yaml_files(repo_tree, monkeypatch):
    monkeypatch.setenv("APR_EXTENDS_ANYWHERE", "1")
    top = repo_tree / "configs" / "run.yaml"
    for name in ("/etc/passwd", "../.env", "base.json"):
        top.write_text(f"extends: {name}\n")
        code, findings = _validate_json(top)
        assert code == 1 and findings[0]["code"] == "config.extends_kind", name


def test_errors_in_a_base_name_the_key_file_and_line_but_never_its_values(repo_tree):
    (repo_tree / "configs" / "leaky.yaml").write_text(
        "password: hunter2\nmodel:\n  architecture: {hidden_size: s3cr3t-token}\n  api_key: sk-live-123\n")
    top = repo_tree / "configs" / "run.yaml"
    top.write_text("extends: [base.yaml, leaky.yaml]\n")
    for fmt in ("--json", "--format=github", None):
        r = runner.invoke(app, ["train", "validate", str(top), *([fmt] if fmt else [])])
        out = r.stdout + (r.stderr if r.stderr_bytes is not None else "")
        assert r.exit_code == 1
        for secret in ("hunter2", "s3cr3t", "sk-live"):
            assert secret not in out, (fmt, out)
    code, findings = _validate_json(top)
    by_path = {f["path"]: f for f in findings}
    assert {"password", "model.api_key", "model.architecture.hidden_size"} <= set(by_path)
    assert all(f["file"].endswith("leaky.yaml") and f["line"] for f in by_path.values())


def test_a_fan_out_of_bases_is_bounded_in_total(repo_tree):
    folder = repo_tree / "configs"
    for depth in range(1, 14):  # a binary tree of bases: 2**13 reads without a bound
        nxt = f"[l{depth + 1}a.yaml, l{depth + 1}b.yaml]" if depth < 13 else "base.yaml"
        for side in "ab":
            (folder / f"l{depth}{side}.yaml").write_text(f"extends: {nxt}\n")
    top = folder / "run.yaml"
    top.write_text("extends: [l1a.yaml, l1b.yaml]\n")
    code, findings = _validate_json(top)
    assert code == 1 and findings[0]["code"] == "config.extends_too_many"
    # bytes: a few bases near the per-file limit together exceed the total
    filler = "".join(f"# {'x' * 70}\n" for _ in range(800))  # ~58 KiB of comments each
    names = [f"big{i}.yaml" for i in range(3)]
    for name in names:
        (folder / name).write_text(filler + "training: {max_steps: 5}\n")
    top.write_text(f"extends: [base.yaml, {', '.join(names)}]\n")
    code, findings = _validate_json(top)
    assert code == 1 and findings[0]["code"] == "config.extends_too_large" and findings[0]["path"] == "extends"


def test_a_diamond_of_bases_is_read_once_per_file_and_merges_as_before(repo_tree):
    folder = repo_tree / "configs"
    (folder / "left.yaml").write_text("extends: base.yaml\nmonitoring: {block_norms: false}\n")
    (folder / "right.yaml").write_text("extends: base.yaml\ntraining: {max_steps: 9}\n")
    top = folder / "run.yaml"
    top.write_text("extends: [left.yaml, right.yaml]\n")
    config = load_config(top).config
    assert config.monitoring.block_norms is False and config.training.max_steps == 9
