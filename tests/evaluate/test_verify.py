"""`apr verify` (apr/evaluate/compare.py) on data too small to compare anything: refused, never a
comparison of 0 batches reported as "within every threshold"."""

from __future__ import annotations

from typer.testing import CliRunner

from apr.cli.main import app

runner = CliRunner()


def test_a_val_set_smaller_than_one_batch_is_refused_not_reported_within_thresholds(untrained_lm, tmp_path):
    from apr.data.pretokenize import pretokenize

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(untrained_lm.lines) + "\n")
    pretokenize([text], untrained_lm.tokenizer, seq_len=96, out=tmp_path / "ds")
    ckpt = str(untrained_lm.checkpoint)
    args = ["verify", ckpt, ckpt, "--data", str(tmp_path / "ds" / "train"), "--batches", "2"]
    r = runner.invoke(app, [*args, "--batch-size", "10000"])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "fewer than one batch of 10,000: nothing would be compared" in r.stderr
    assert "within every threshold" not in r.output
    ok = runner.invoke(app, [*args, "--batch-size", "1"])
    assert ok.exit_code == 0 and "within every threshold" in ok.output, ok.output
