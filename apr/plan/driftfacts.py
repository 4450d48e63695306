"""The plan's drift check: is validation drawn from the distribution it is meant to measure?

For ``data.val`` against the training data (a mixture's sources sampled by their weights) and for
each source's own ``val`` against that source, a sample of each side is compared by
``apr.data.drift`` (PSI, KS, Wasserstein on token ranks and document lengths). At or above
``data.drift.psi_warning`` or ``data.drift.ks_warning`` the plan warns (``data.drift``, at the val
key's line); below, the numbers are facts (``data_drift``) that the plan prints beside the data.
A side sampled to fewer than ``MIN_TOKENS`` tokens is too small to judge: its numbers are shown
and nothing is found. Missing or unreadable data is not this check's to report (the C-DATA
contracts do): such a pair is skipped.
"""

from __future__ import annotations

import time
from pathlib import Path

from apr.config.loader import LoadedConfig
from apr.errors import Finding
from apr.plan.datafacts import dataset_facts, resolve, shard_files

MIN_TOKENS = 10_000  # below this per side the statistics are noise (a rank table of a few hundred tokens)


def _key(path: str) -> tuple:
    """``data.train[1].val`` -> ("data", "train", 1, "val")."""
    out: list = []
    for part in path.split("."):
        name, _, index = part.partition("[")
        out.append(name)
        if index:
            out.append(int(index.rstrip("]")))
    return tuple(out)


def _readable_shards(path_text: str, column: str) -> list[Path] | None:
    """The shards of a dataset the check can sample: readable, the column a list of integers, rows
    of one length (else None: the C-DATA contracts report what is wrong)."""
    facts = dataset_facts(path_text, column)
    if not (facts.get("shards") and not facts.get("unreadable") and facts.get("column_is_int_list")
            and facts.get("row_len_uniform")):
        return None
    return shard_files(resolve(path_text))


def _eot_id(path_text: str) -> int | None:
    """The end-of-text id the pretokenize manifest of the dataset records (None without one)."""
    from apr.data.drift import manifest_eot_id  # numpy

    return manifest_eot_id(resolve(path_text))


def _pairs(config) -> list[tuple[str, list[tuple[str, float]], str]]:
    """(val key path, [(train path, weight)], val path) of every comparison the config asks for."""
    data = config.data
    pairs = []
    if data.val:
        train = [(data.train, 1.0)] if isinstance(data.train, str) else [(s.path, s.weight) for s in data.train]
        pairs.append(("data.val", train, data.val))
    for i, s in enumerate(data.sources or []):
        if s.val:
            pairs.append((f"data.train[{i}].val", [(s.path, 1.0)], s.val))
    return pairs


def _reference(train: list[tuple[str, float]], column: str, tokens: int, seed: int):
    """Rows sampled from the training side: each source its weight's share of ``tokens``."""
    import numpy as np

    from apr.data.drift import sample_rows

    total = sum(w for _, w in train) or 1.0
    parts = []
    for k, (path, weight) in enumerate(train):
        shards = _readable_shards(path, column)
        if shards is None:
            return None
        if weight > 0:
            parts.append(sample_rows(shards, column, max(1, int(tokens * weight / total)), seed=seed + k))
    widths = {p.shape[1] for p in parts if p.size}
    return np.concatenate([p for p in parts if p.size]) if len(widths) == 1 else None


def _finding(loaded: LoadedConfig, key: str, stats: list, d) -> Finding | None:
    """A warning when a statistic reaches its threshold on samples large enough to judge."""
    tokens = stats[0]
    high = [s for s in stats if s.psi >= d.psi_warning or s.ks >= d.ks_warning]
    if not high or min(tokens.n_reference, tokens.n_current) < MIN_TOKENS:
        return None
    file, line, column = loaded.source.where(_key(key))
    shown = "; ".join(f"{s.feature} PSI {s.psi:.3f}, KS {s.ks:.3f}, Wasserstein {s.wasserstein:.3g}" for s in stats)
    return Finding("warning", "data.drift", f"{key} looks drawn from another distribution than its training "
                   f"data: {shown} (sampled {tokens.n_current:,} val tokens); a val loss measured on it says "
                   "little about the training distribution", path=key, file=file, line=line, column=column,
                   expected=f"PSI < {d.psi_warning} and KS < {d.ks_warning} (data.drift)",
                   got=", ".join(f"{s.feature} PSI {s.psi:.3f} KS {s.ks:.3f}" for s in high))


def drift_check(loaded: LoadedConfig) -> tuple[list[dict], list[Finding]]:
    """The facts (one entry per comparison) and findings of the drift check."""
    config = loaded.config
    d = config.data.drift
    pairs = _pairs(config) if d.enabled else []
    if not pairs:
        return [], []
    try:
        from apr.data.drift import dataset_drift, sample_rows
    except ImportError as err:  # a broken numpy install: say so, never fail the plan over it
        return [], [Finding("info", "data.drift_skipped", f"the drift check needs numpy: {err}",
                            path="data.drift.enabled")]
    facts, findings = [], []
    for key, train, val in pairs:
        t0 = time.perf_counter()
        shards = _readable_shards(val, config.data.input_column)
        reference = _reference(train, config.data.input_column, d.sample_tokens, d.seed)
        if shards is None or reference is None:
            continue
        current = sample_rows(shards, config.data.input_column, d.sample_tokens, seed=d.seed + 1000)
        stats = dataset_drift(reference, current, config.model.architecture.vocab_size, _eot_id(val))
        if not stats:
            continue
        finding = _finding(loaded, key, stats, d)
        facts.append({"val": key, "train": [p for p, _ in train], "path": val,
                      "judged": min(stats[0].n_reference, stats[0].n_current) >= MIN_TOKENS,
                      "drifted": finding is not None, "stats": [s.to_dict() for s in stats],
                      "seconds": round(time.perf_counter() - t0, 3)})
        findings += [finding] if finding is not None else []
    return facts, findings
