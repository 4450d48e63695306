"""apr eval's loss: equal to the run's recorded val loss; per source; bits per byte from the manifest."""

from __future__ import annotations

import json
import math

import pytest

from apr.errors import AprError
from apr.evaluate.loss import data_sources, eval_loss
from apr.generate.load import load_for_inference
from apr.plan.build import resolve_config
from tests.train.run_helpers import config_doc, make_dataset


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 12-step apr run whose validation covers its whole val folder (16 rows, 4 batches of 4)."""
    from apr.config import config_hash
    from apr.config.schema import AprConfig
    from apr.train.run import ApplyOptions, prepare_run

    root = tmp_path_factory.mktemp("evalrun")
    make_dataset(root, train_rows=96, val_rows=16)
    cfg = AprConfig.model_validate(config_doc(root, training={"eval_batches": 4}))
    run = prepare_run(resolve_config(cfg), config_hash=config_hash(cfg), config_path=root / "cfg.yaml",
                      options=ApplyOptions(echo=lambda line: None))
    result = run.execute()
    assert result.status == "finished"
    return root, result


def test_eval_loss_on_the_val_folder_equals_the_runs_recorded_val_loss(trained_run):
    root, result = trained_run
    state = json.loads((root / "run" / "training_state.json").read_text())
    recorded = state["val_loss_history"][-1]
    assert recorded[0] == result.final_step == 12
    loaded = load_for_inference(root / "run", need_tokenizer=False)
    assert loaded.step == 12 and loaded.tokenizer is None
    (src,) = eval_loss(loaded, root / "data" / "val")
    assert src.rows == 16 and src.tokens == 16 * 16
    assert abs(src.loss - recorded[1]) < 1e-6
    assert abs(src.loss - result.val_loss) < 1e-6
    assert src.perplexity == pytest.approx(math.exp(src.loss))
    # a different batch size covers the same rows: the same loss up to float32 rounding
    (other,) = eval_loss(loaded, root / "data" / "val", batch_size=16)
    assert other.loss == pytest.approx(src.loss, abs=1e-5)
    (half,) = eval_loss(loaded, root / "data" / "val", max_batches=2)
    assert half.rows == 8
    (tail,) = eval_loss(loaded, root / "data" / "val", batch_size=6)  # 6 + 6 + a last batch of 4
    assert tail.rows == 16 and tail.loss == pytest.approx(src.loss, abs=1e-5)
    (capped,) = eval_loss(loaded, root / "data" / "val", batch_size=6, max_batches=2)
    assert capped.rows == 12


def test_a_folder_with_several_sources_is_reported_per_source(trained_run):
    root, _ = trained_run
    assert [name for name, _ in data_sources(root / "data")] == ["train", "val"]
    loaded = load_for_inference(root / "run", need_tokenizer=False)
    train, val = eval_loss(loaded, root / "data")
    assert (train.name, val.name) == ("train", "val") and train.rows == 96
    (alone,) = eval_loss(loaded, root / "data" / "val")
    assert val.loss == alone.loss


def test_bits_per_byte_come_from_the_manifest_of_a_pretokenized_text_corpus(tiny_lm, loaded, tmp_path):
    from apr.data.pretokenize import pretokenize

    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(tiny_lm.lines * 3) + "\n")
    manifest = pretokenize([text], tiny_lm.tokenizer, seq_len=32, out=tmp_path / "ds", val_fraction=0.25)
    train, val = eval_loss(loaded, tmp_path / "ds", batch_size=2)
    bytes_per_token = text.stat().st_size / manifest["tokens_total"]
    for src in (train, val):
        assert src.bits_per_byte == pytest.approx(src.loss / math.log(2) / bytes_per_token)
    assert train.loss < 0.5 * math.log(384)  # well below a uniform guess: it has seen these lines


def test_bad_data_is_refused_with_the_folder_named(trained_run, tmp_path, monkeypatch):
    root, _ = trained_run
    loaded = load_for_inference(root / "run", need_tokenizer=False)
    with pytest.raises(AprError, match="no such data folder"):
        eval_loss(loaded, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AprError, match="no Parquet shards"):
        eval_loss(loaded, tmp_path / "empty")
    import tests.train.run_helpers as rh

    monkeypatch.setattr(rh, "SEQ", 40)  # rows longer than the model's context of 16
    wide = rh.write_pattern_shards(tmp_path / "wide", 8, seed=0, shards=1)
    with pytest.raises(AprError, match="context is 16"):
        eval_loss(loaded, wide)
