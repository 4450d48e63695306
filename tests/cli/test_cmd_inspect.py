"""`apr inspect` through the CLI: tables, JSON, two checkpoints, attention, pictures under --out only,
and bad input (exit 1, no traceback)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["inspect", *map(str, args)])


def test_text_table_per_layer_with_histograms(untrained_lm):
    r = invoke(untrained_lm.run_dir, "--bins", "12")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "(run step 2)" in lines[0] and "histogram" in lines[1]
    assert [ln.split()[0] for ln in lines[2:]] == ["embed_tokens", "layers.0", "layers.1", "norm", "lm_head"]


def test_two_checkpoints_attention_and_pictures(untrained_lm, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pictures"
    r = invoke(untrained_lm.checkpoint, untrained_lm.hf_dir, "--tensor", "*layers.1.*", "--prompt", "def f(x):",
               "--layer", "0", "--head", "1", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [w["kind"] for w in doc["weights"]] == ["checkpoint", "hf"]
    assert [row["layer"] for row in doc["weights"][0]["layers"]] == ["layers.1"]
    assert [row["relative_update"] for row in doc["updates"]["layers"]] == [0.0]  # the export is the checkpoint
    (att,) = doc["attention"]
    assert (att["layer"], att["head"]) == (0, 1) and len(att["weights"]) == len(att["tokens"])
    names = sorted(p.name for p in out.iterdir())
    assert names == ["attention-L0-H1.svg", "updates.svg", "weights-other.svg", "weights.svg"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pictures"]  # nothing beside --out


def test_bad_input_exits_1_with_the_reason(untrained_lm, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for args, message in [((tmp_path / "nope",), "not a checkpoint (no such file or folder)"),
                          ((untrained_lm.checkpoint, "--tensor", "nothing*"), "no tensor of"),
                          ((untrained_lm.checkpoint, "--prompt", "x " * 300), "the model's context"),
                          ((untrained_lm.checkpoint, "--out", a_file), "is a file; expected a folder"),
                          ((untrained_lm.checkpoint, "--bins", "1"), "--bins must be 2 to 1000")]:
        r = invoke(*args)
        assert r.exit_code == 1 and "Traceback" not in r.output, (args, r.output)
        assert message in r.stderr, (args, r.stderr)
