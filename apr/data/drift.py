"""Distribution shift between two token datasets (train and val, two mixture sources, two stages):
PSI, the Kolmogorov-Smirnov statistic and the Wasserstein distance, on a sample (docs/data.md,
"Drift between datasets"). numpy only: scipy's implementations are the tests' reference.

Two features are compared:

* **token rank**: each token replaced by its rank in the reference sample's frequency table
  (0 = the most common token), divided by the vocabulary size. Token ids themselves are arbitrary
  labels; ranks put them in an order that means something (common to rare), so a val set drawn
  from another distribution shows as mass moved toward ranks the reference rarely uses.
* **document length**: the distances between consecutive end-of-text tokens inside each sampled
  row (documents cut by a row boundary are not counted, on both sides alike).

Sampling: Parquet row groups are drawn in a random (seeded) order across the dataset's shards
until they hold four times the rows wanted (at most ``max_groups``), and from them rows at random
until ``sample_tokens`` tokens; only those row groups' token column is read. A 100M-token dataset
is summarised from about a million tokens (docs/performance.md, "Data drift").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from apr.readers import load_json

PSI_BINS = 10
PSI_FLOOR = 1e-4  # an empty bin's share: PSI's log would be infinite at 0


@dataclass(frozen=True)
class DriftStats:
    feature: str  # token_rank | doc_length
    psi: float
    ks: float  # the KS statistic D: the largest gap between the two CDFs, in [0, 1]
    ks_pvalue: float
    wasserstein: float  # in the feature's unit (a fraction of the vocabulary for token_rank; tokens for doc_length)
    n_reference: int
    n_current: int

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def sample_rows(shards: list[Path], column: str, sample_tokens: int, seed: int = 0,
                max_groups: int = 32, spread: int = 4) -> np.ndarray:
    """About ``sample_tokens`` tokens of whole rows ``[rows, row_len]`` (uint32) drawn at random
    from row groups of ``shards`` taken in a random order until they hold ``spread`` times the
    rows wanted (so the sample comes from several places) or ``max_groups`` are read."""
    import pyarrow.parquet as pq

    groups, row_len = [], None  # (file, row group, rows)
    for f in shards:
        md = pq.read_metadata(f)
        groups += [(f, g, md.row_group(g).num_rows) for g in range(md.num_row_groups) if md.row_group(g).num_rows]
        if row_len is None and md.num_rows:
            row_len = md.row_group(0).column(0).num_values // max(md.row_group(0).num_rows, 1)
    if not groups:
        return np.zeros((0, 0), dtype=np.uint32)
    rng = np.random.default_rng(seed)
    enough = spread * math.ceil(sample_tokens / max(row_len or 1, 1))
    chosen, rows_chosen = [], 0
    for i in rng.permutation(len(groups)):
        if len(chosen) >= max_groups or rows_chosen >= enough:
            break
        chosen.append(int(i))
        rows_chosen += groups[i][2]
    parts = []
    for i in sorted(chosen):
        f, g, _ = groups[i]
        table = pq.ParquetFile(f).read_row_group(g, columns=[column])
        parts.append(np.asarray(table.column(0).combine_chunks().flatten(), dtype=np.uint32)
                     .reshape(table.num_rows, -1))
    rows = np.concatenate(parts)
    want = max(1, math.ceil(sample_tokens / rows.shape[1]))
    if want < len(rows):
        rows = rows[np.sort(rng.choice(len(rows), size=want, replace=False))]
    return rows


def psi(reference: np.ndarray, current: np.ndarray, bins: int = PSI_BINS) -> float:
    """Population stability index over the reference's quantile bins: sum (c - r) * ln(c / r)."""
    edges = np.unique(np.quantile(reference, np.linspace(0, 1, bins + 1)))
    if len(edges) < 2:  # a constant reference: its value, and everything else
        ref = np.array([1.0, 0.0])
        same = float(np.mean(current == edges[0]))
        cur = np.array([same, 1.0 - same])
    else:
        inner = edges[1:-1]
        ref = np.bincount(np.searchsorted(inner, reference, side="right"), minlength=len(edges) - 1) / len(reference)
        cur = np.bincount(np.searchsorted(inner, current, side="right"), minlength=len(edges) - 1) / len(current)
    ref, cur = np.maximum(ref, PSI_FLOOR), np.maximum(cur, PSI_FLOOR)
    return float(np.sum((cur - ref) * np.log(cur / ref)))


def ks_2samp(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The two-sample Kolmogorov-Smirnov statistic D (as ``scipy.stats.ks_2samp``) and its p-value
    from the limiting Kolmogorov distribution (``scipy.stats.kstwobign``; tests/data/test_drift.py
    checks both against scipy). Not scipy itself: importing scipy.stats costs 1.5 s, more than the
    rest of a plan."""
    a, b = np.sort(a), np.sort(b)
    both = np.concatenate([a, b])
    gap = np.abs(np.searchsorted(a, both, side="right") / len(a) - np.searchsorted(b, both, side="right") / len(b))
    d = float(gap.max())
    n = len(a) * len(b) / (len(a) + len(b))
    return d, kolmogorov_sf(d * math.sqrt(n))


def kolmogorov_sf(x: float) -> float:
    """P(K > x) for the Kolmogorov distribution: 2 * sum_k (-1)^(k-1) exp(-2 k^2 x^2)."""
    if x < 0.2:  # the series converges slowly there and the probability is 1 to 1e-9
        return 1.0
    total = sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))
    return min(max(2 * total, 0.0), 1.0)


def wasserstein(a: np.ndarray, b: np.ndarray) -> float:
    """The 1-D Wasserstein-1 distance: the area between the two empirical CDFs (as
    ``scipy.stats.wasserstein_distance`` computes it)."""
    a, b = np.sort(a), np.sort(b)
    both = np.sort(np.concatenate([a, b]))
    widths = np.diff(both)
    cdf_a = np.searchsorted(a, both[:-1], side="right") / len(a)
    cdf_b = np.searchsorted(b, both[:-1], side="right") / len(b)
    return float(np.sum(np.abs(cdf_a - cdf_b) * widths))


def compare(feature: str, reference: np.ndarray, current: np.ndarray) -> DriftStats:
    d, p = ks_2samp(reference, current)
    return DriftStats(feature, psi(reference, current), d, p, wasserstein(reference, current),
                      len(reference), len(current))


def compare_counts(feature: str, ref_counts: np.ndarray, cur_counts: np.ndarray, unit: float = 1.0,
                   bins: int = PSI_BINS) -> DriftStats:
    """The statistics of two samples of integers given as counts per value (``bincount``s of one
    length): O(values) instead of sorting the samples. KS and Wasserstein equal ``ks_2samp`` and
    ``wasserstein`` on the samples (the CDFs only step at integers); PSI bins are the reference's
    quantiles on the integer grid. ``unit``: the width of one integer step in the feature's unit."""
    n_ref, n_cur = int(ref_counts.sum()), int(cur_counts.sum())
    cdf_ref, cdf_cur = np.cumsum(ref_counts) / n_ref, np.cumsum(cur_counts) / n_cur
    gap = np.abs(cdf_ref - cdf_cur)
    d = float(gap.max())
    inner = np.unique(np.searchsorted(cdf_ref, np.linspace(0, 1, bins + 1)[1:-1], side="left") + 1)
    bin_of = np.searchsorted(inner, np.arange(len(ref_counts)), side="right")
    ref = np.maximum(np.bincount(bin_of, weights=ref_counts) / n_ref, PSI_FLOOR)
    cur = np.maximum(np.bincount(bin_of, weights=cur_counts) / n_cur, PSI_FLOOR)
    return DriftStats(feature, float(np.sum((cur - ref) * np.log(cur / ref))), d,
                      kolmogorov_sf(d * math.sqrt(n_ref * n_cur / (n_ref + n_cur))),
                      float(gap[:-1].sum() * unit), n_ref, n_cur)


def token_ranks(reference: np.ndarray, current: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Both samples' tokens as their rank (an integer) in the reference's frequency table, and the
    number of ranks; ids past the vocabulary, or never seen in the reference, rank after every seen
    one, in id order."""
    size = max(vocab_size, int(reference.max(initial=0)) + 1, int(current.max(initial=0)) + 1)
    counts = np.bincount(reference, minlength=size)
    order = np.argsort(-counts, kind="stable")  # most common first; ties by id
    rank = np.empty(size, dtype=np.int64)
    rank[order] = np.arange(size)
    return rank[reference], rank[current], size


def manifest_eot_id(folder: Path) -> int | None:
    """The end-of-text id the pretokenize manifest of a dataset folder records (None without one,
    or when it cannot be read: document lengths are then not compared)."""
    # DIR/manifest.json, or DIR/../manifest.json for the train/ and val/ folders pretokenize writes
    manifest = next((m for m in (Path(folder) / "manifest.json", Path(folder).parent / "manifest.json")
                     if m.is_file()), None)
    if manifest is None:
        return None
    try:
        doc = load_json(manifest, "manifest", "pretokenize manifest")
    except Exception:  # an unreadable manifest: C-DATA contracts name it; lengths are skipped
        return None
    eot = (doc.get("tokenizer") or {}).get("eot_id") if isinstance(doc, dict) else None
    return eot if isinstance(eot, int) and not isinstance(eot, bool) else None


def doc_lengths(rows: np.ndarray, eot_id: int) -> np.ndarray:
    """Lengths (in tokens, the end-of-text token included) of the documents that start and end
    inside one row: the gaps between consecutive end-of-text tokens of each row."""
    r, c = np.nonzero(rows == eot_id)
    if len(r) < 2:
        return np.zeros(0, dtype=np.int64)
    same_row = r[1:] == r[:-1]
    return (c[1:] - c[:-1])[same_row].astype(np.int64)


def dataset_drift(reference: np.ndarray, current: np.ndarray, vocab_size: int,
                  eot_id: int | None = None) -> list[DriftStats]:
    """The statistics of every feature both samples have (rows ``[n, row_len]`` each)."""
    if reference.size == 0 or current.size == 0:
        return []
    ref_rank, cur_rank, size = token_ranks(reference.reshape(-1), current.reshape(-1), vocab_size)
    out = [compare_counts("token_rank", np.bincount(ref_rank, minlength=size), np.bincount(cur_rank, minlength=size),
                          unit=1.0 / size)]
    if eot_id is not None:
        ref_len, cur_len = doc_lengths(reference, eot_id), doc_lengths(current, eot_id)
        if len(ref_len) >= 2 and len(cur_len) >= 2:
            longest = int(max(ref_len.max(), cur_len.max())) + 1
            out.append(compare_counts("doc_length", np.bincount(ref_len, minlength=longest),
                                      np.bincount(cur_len, minlength=longest)))
    return out
