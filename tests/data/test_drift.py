"""Drift statistics between two token samples: the same numbers as scipy, PSI near zero for one
distribution and large for another, ranks and document lengths, and row sampling from shards."""

from __future__ import annotations

import numpy as np
import pytest

from apr.data.drift import (
    compare,
    compare_counts,
    dataset_drift,
    doc_lengths,
    ks_2samp,
    psi,
    sample_rows,
    token_ranks,
    wasserstein,
)
from apr.plan.examples import write_shards


@pytest.mark.parametrize("shift", [0.0, 0.05, 0.5])
def test_ks_and_wasserstein_agree_with_scipy(shift):
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=3000), rng.normal(loc=shift, size=2000).round(2)  # ties included
    d, p = ks_2samp(a, b)
    ref = stats.ks_2samp(a, b, method="asymp")
    limit = stats.kstwobign.sf(ref.statistic * np.sqrt(len(a) * len(b) / (len(a) + len(b))))
    assert d == pytest.approx(ref.statistic, abs=1e-12) and p == pytest.approx(limit, rel=1e-6, abs=1e-12)
    assert wasserstein(a, b) == pytest.approx(stats.wasserstein_distance(a, b), rel=1e-9)


def test_psi_is_zero_for_one_distribution_and_large_for_another():
    rng = np.random.default_rng(2)
    ref = rng.normal(size=20000)
    assert psi(ref, rng.normal(size=20000)) < 0.01
    assert psi(ref, rng.normal(loc=1.0, size=20000)) > 0.25
    assert psi(np.zeros(100), np.ones(100)) > 1  # a constant reference still gives a number


def test_token_ranks_order_by_the_references_frequency():
    ref = np.array([7, 7, 7, 3, 3, 1], dtype=np.uint32)
    r_ref, r_cur, size = token_ranks(ref, np.array([3, 9, 7], dtype=np.uint32), vocab_size=10)
    assert size == 10 and r_ref.tolist() == [0, 0, 0, 1, 1, 2] and r_cur.tolist()[0::2] == [1, 0]
    assert r_cur[1] > 2  # a token the reference never used ranks after every one it did


def test_counts_give_the_same_ks_and_wasserstein_as_the_samples():
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 50, size=4000), np.minimum(rng.geometric(0.05, size=3000), 49)
    fast = compare_counts("x", np.bincount(a, minlength=50), np.bincount(b, minlength=50), unit=0.5)
    d, p = ks_2samp(a.astype(float), b.astype(float))
    assert fast.ks == pytest.approx(d) and fast.ks_pvalue == pytest.approx(p)
    assert fast.wasserstein == pytest.approx(wasserstein(a * 0.5, b * 0.5))
    assert fast.psi > 0.25 and compare_counts("x", np.bincount(a), np.bincount(a)).psi == 0


def test_doc_lengths_count_documents_inside_a_row():
    rows = np.array([[0, 5, 6, 0, 7, 0], [5, 0, 6, 6, 6, 6]], dtype=np.uint32)
    assert doc_lengths(rows, eot_id=0).tolist() == [3.0, 2.0]  # the second row holds no whole document


def test_a_val_set_from_another_distribution_drifts_and_a_resample_does_not():
    rng = np.random.default_rng(3)
    zipf = np.minimum(rng.zipf(1.3, size=(400, 65)), 999).astype(np.uint32)
    same = np.minimum(rng.zipf(1.3, size=(400, 65)), 999).astype(np.uint32)
    other = rng.integers(0, 1000, size=(400, 65)).astype(np.uint32)  # uniform: rare tokens everywhere
    (ok,) = dataset_drift(zipf, same, vocab_size=1000)
    (bad,) = dataset_drift(zipf, other, vocab_size=1000)
    assert ok.feature == "token_rank" and ok.psi < 0.05 and ok.ks < 0.05
    assert bad.psi > 1 and bad.ks > 0.5 and bad.wasserstein > ok.wasserstein
    assert compare("x", np.arange(5.0), np.arange(5.0)).to_dict()["ks"] == 0.0


def test_sample_rows_reads_whole_rows_from_a_few_row_groups(tmp_path):
    shards = write_shards(tmp_path / "d", rows=300, row_len=17, max_token=50, shards=3)
    rows = sample_rows(shards, "input_ids", sample_tokens=17 * 40, seed=4)
    assert rows.shape == (40, 17) and rows.dtype == np.uint32 and rows.max() <= 50
    assert np.array_equal(rows, sample_rows(shards, "input_ids", sample_tokens=17 * 40, seed=4))  # seeded
    every = sample_rows(shards, "input_ids", sample_tokens=10**9, seed=0)
    assert every.shape == (300, 17)  # asked for more than there is: everything


def test_the_end_of_text_id_comes_from_the_pretokenize_manifest_beside_the_split(tmp_path):
    """`data.train: DIR/train/` has its manifest at DIR/manifest.json; the reader asked the bounded
    reader for an unknown kind and always found no id, so document lengths were never compared."""
    import json

    from apr.data.drift import manifest_eot_id

    (tmp_path / "train").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": {"eot_id": 7, "sha256": "ab"}}))
    assert manifest_eot_id(tmp_path / "train") == 7
    assert manifest_eot_id(tmp_path) == 7
    assert manifest_eot_id(tmp_path / "elsewhere" / "x") is None
