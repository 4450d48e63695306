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
    for args, message in [((tmp_path / "nope",), "no such file or folder"),
                          ((untrained_lm.checkpoint, "--tensor", "nothing*"), "no tensor of"),
                          ((untrained_lm.checkpoint, "--prompt", "x " * 300), "the model's context"),
                          ((untrained_lm.checkpoint, "--out", a_file), "is a file; expected a folder"),
                          ((untrained_lm.checkpoint, "--bins", "1"), "--bins must be 2 to 1000")]:
        r = invoke(*args)
        assert r.exit_code == 1 and "Traceback" not in r.output, (args, r.output)
        assert message in r.stderr, (args, r.stderr)


def test_out_never_replaces_a_file_without_overwrite_and_never_a_record(untrained_lm, tmp_path):
    out = tmp_path / "pictures"
    out.mkdir()
    (out / "weights.svg").write_text("my own drawing\n")
    r = invoke(untrained_lm.checkpoint, "--out", out)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "--overwrite" in r.stderr and (out / "weights.svg").read_text() == "my own drawing\n"
    assert sorted(p.name for p in out.iterdir()) == ["weights.svg"]  # refused before anything was written
    r = invoke(untrained_lm.checkpoint, "--out", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert (out / "weights.svg").read_text().startswith("<svg")


def test_out_on_a_read_only_folder_is_an_error_naming_it(untrained_lm, tmp_path):
    import os
    import shutil
    import subprocess

    out = tmp_path / "locked"
    out.mkdir()
    out.chmod(0o555)
    root = os.geteuid() == 0
    if root and (not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(out)],
                                                               capture_output=True).returncode != 0):
        out.chmod(0o755)
        import pytest

        pytest.skip("running as root without chattr: cannot make a folder read-only")
    try:
        results = [invoke(untrained_lm.checkpoint, "--out", target) for target in (out, out / "sub")]
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(out)], check=False)
        out.chmod(0o755)
    for r in results:
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert "cannot write --out" in r.stderr and str(out) in r.stderr
    assert list(out.iterdir()) == []


def test_weights_that_are_not_what_their_json_recorded_are_said(untrained_lm, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(untrained_lm.run_dir, run)
    weights = run / untrained_lm.checkpoint.with_suffix(".safetensors").name
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit of the last weight flipped: same size, another SHA-256
    weights.write_bytes(bytes(data))
    r = invoke(run / untrained_lm.checkpoint.name, "--json")  # named: shown, with a warning
    assert r.exit_code == 0, r.output
    assert "SHA-256 does not match" in r.stderr and "not the weights" in r.stderr
    assert any("SHA-256" in w for w in json.loads(r.stdout)["warnings"])
    r = invoke(run)  # a run folder: its only checkpoint is damaged, so nothing to show
    assert r.exit_code == 1 and "Traceback" not in r.output and "SHA-256" in r.stderr


def test_comparing_with_non_finite_weights_counts_them_and_prints_valid_json(tmp_path):
    import math

    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    a = {"model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=gen), "model.norm.weight": torch.ones(8)}
    b = {k: v.clone() for k, v in a.items()}
    b["model.layers.0.mlp.up_proj.weight"][0, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    b["model.norm.weight"][:] = math.nan
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    for fmt in ("svg", "png"):
        r = invoke(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--out", tmp_path / fmt, "--format", fmt)
        assert r.exit_code == 0 and "Traceback" not in r.output, r.output
        assert "layers.0: 3 positions where a weight is inf or NaN" in r.stdout
    r = invoke(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--json")
    assert r.exit_code == 0, r.output

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    doc = json.loads(r.stdout, parse_constant=refuse)
    (layer0,) = [row for row in doc["updates"]["layers"] if row["layer"] == "layers.0"]
    assert layer0["nonfinite"] == 3 and layer0["relative_update"] == 0.0  # the finite weights did not move


def test_png_pictures_are_labelled_not_bare_strips(untrained_lm, tmp_path):
    from tests.inspect.test_draw import decode_png

    out = tmp_path / "png"
    r = invoke(untrained_lm.checkpoint, untrained_lm.hf_dir, "--out", out, "--format", "png")
    assert r.exit_code == 0, r.output
    sizes = {p.name: decode_png(p.read_bytes())[:2] for p in out.iterdir()}
    assert set(sizes) == {"weights.png", "weights-other.png", "updates.png"}
    assert all(w >= 300 and h >= 60 for w, h in sizes.values()), sizes  # was 16 x 41 and 160 x 164, unlabelled
