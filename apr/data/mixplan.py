"""Stages of a data mixture and what a run draws from each source (issue 21, plan accounting).

A stage is a mixture (source -> weight) that starts at an exact optimizer step, given as a
step or as a fraction of the run. ``stage_starts`` resolves the starts and refuses a bad list
with the key path of the offending stage; ``account`` replays the exact draw schedule of
``apr.data.mixture.MixtureCursor`` over the run (rows per step = batch size x accumulation x
ranks) and returns rows, tokens and epochs per source per stage, plus findings: a source read
more than ``warn_epochs`` times (warning) and a source that runs out under a no-repeat policy
(error). At a stage boundary the weights change and the schedule's credit restarts; each
source's ``(epoch, row)`` cursor carries on, so a source is never re-read from its start
because a stage began. The replay is exact (what the run will draw), O(rows x sources): about 0.7 s per million rows
drawn. See docs/design.md, "Data mixtures".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from apr.data.mixture import MixtureCursor, MixtureError, _normalised

EXACT_DRAWS = 4_000_000  # rows per stage the plan replays draw by draw (about 3 s); above, rounded


@dataclass(frozen=True)
class Stage:
    """One stage: ``start`` is a step (int) or a fraction of the run (float in [0, 1))."""

    weights: dict[str, float]
    start: int | float = 0
    name: str = ""


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    key: str  # key path, e.g. "data.stages[1].start"
    message: str


def stage_starts(stages: list[Stage], total_steps: int, key: str = "data.stages") -> list[int]:
    """The exact step each stage starts at. Refuses (MixtureError naming the key path) a first
    stage that does not start at step 0, starts that do not increase, a fraction outside [0, 1)
    and a stage that starts at or after the run's last step."""
    if not stages:
        raise MixtureError(f"{key}: expected at least one stage, found none")
    starts = []
    for i, st in enumerate(stages):
        at = f"{key}[{i}].start"
        if isinstance(st.start, bool) or not isinstance(st.start, (int, float)):
            raise MixtureError(f"{at}: expected a step (integer >= 0) or a fraction in [0, 1), found {st.start!r}")
        if isinstance(st.start, float):
            if not 0.0 <= st.start < 1.0:
                raise MixtureError(f"{at}: expected a fraction in [0, 1), found {st.start!r}")
            step = int(st.start * total_steps)  # floor: the stage starts at or before the fraction
        else:
            if st.start < 0:
                raise MixtureError(f"{at}: expected a step >= 0, found {st.start}")
            step = st.start
        if i == 0 and step != 0:
            raise MixtureError(f"{at}: expected the first stage to start at step 0, found {step}")
        if step >= total_steps and i > 0:
            raise MixtureError(f"{at}: stage starts at step {step}, after the run ends "
                               f"(last step {total_steps - 1} of {total_steps})")
        if starts and step <= starts[-1]:
            raise MixtureError(f"{at}: expected a start after the previous stage's step {starts[-1]}, found {step}")
        starts.append(step)
    return starts


def check_weights(stages: list[Stage], sources: set[str], key: str = "data.stages") -> None:
    """Weights that are negative, all zero or name an unknown source: MixtureError with the key path."""
    for i, st in enumerate(stages):
        for name in st.weights:
            if name not in sources:
                raise MixtureError(f"{key}[{i}].weights.{name}: expected one of the sources "
                                   f"{sorted(sources)}, found unknown source {name!r}")
        try:
            _normalised(st.weights)
        except MixtureError as e:
            raise MixtureError(f"{key}[{i}].weights: {e}") from None


def _stage_cursor(prev: MixtureCursor | None, stage: Stage, rows: dict[str, int], seed: int) -> MixtureCursor:
    """The schedule of ``stage``: fresh credit for its weights; the per-source cursors (and the
    draw count) of the previous stage carry on across the boundary."""
    cursor = MixtureCursor({n: stage.weights.get(n, 0.0) for n in rows}, rows, seed=seed)
    if prev is not None:
        cursor.cursors, cursor.draws = dict(prev.cursors), prev.draws
    return cursor


def account(stages: list[Stage], rows: dict[str, int], tokens_per_row: int, rows_per_step: int,
            total_steps: int, seed: int = 0, repeat: bool = True, warn_epochs: float = 4.0,
            key: str = "data.stages") -> dict:
    """Rows/tokens per source per stage, epochs per source, stage start steps and findings."""
    check_weights(stages, set(rows), key)
    starts = stage_starts(stages, total_steps, key)
    ends = starts[1:] + [total_steps]
    per_stage = []
    cursor, exact = None, True
    for i, (st, s0, s1) in enumerate(zip(stages, starts, ends, strict=True)):
        cursor = _stage_cursor(cursor, st, rows, seed)
        drawn = dict.fromkeys(rows, 0)
        n = (s1 - s0) * rows_per_step
        if n <= EXACT_DRAWS:
            drawn.update(cursor.advance(n))
        else:  # within one row per source of the exact draw (largest remainder of n x weight)
            exact = False
            drawn.update(_rounded(cursor, n))
        per_stage.append({"name": st.name or f"stage{i}", "start_step": s0, "end_step": s1,
                          "rows": drawn, "tokens": {n: c * tokens_per_row for n, c in drawn.items()}})
    total_rows = {n: sum(s["rows"][n] for s in per_stage) for n in rows}
    epochs = {n: total_rows[n] / rows[n] for n in rows}
    findings = []
    for n in sorted(rows):
        if not repeat and total_rows[n] > rows[n]:
            findings.append(Finding("error", f"{key}", f"source {n!r} is exhausted under the no-repeat policy: "
                                    f"the run draws {total_rows[n]} rows, the source holds {rows[n]}"))
        elif epochs[n] > warn_epochs:
            findings.append(Finding("warning", f"{key}", f"source {n!r} is read {epochs[n]:.2f} times "
                                    f"(more than {warn_epochs:g} epochs: repeated data stops helping)"))
    return {"stage_starts": starts, "stages": per_stage, "rows": total_rows, "exact": exact,
            "tokens": {n: c * tokens_per_row for n, c in total_rows.items()}, "epochs": epochs,
            "findings": findings}


def _rounded(cursor: MixtureCursor, n: int) -> dict[str, int]:
    """``n`` draws counted as the largest-remainder rounding of ``n x weight`` (ties in the seeded
    order); the per-source cursors advance by those counts. For runs above ``EXACT_DRAWS`` rows a
    stage, where replaying every draw would take minutes."""
    quota = {k: n * w for k, w in cursor.weights.items()}
    counts = {k: int(q) for k, q in quota.items()}
    by_remainder = sorted(cursor.weights, key=lambda k: (-(quota[k] - counts[k]), cursor._order.index(k)))
    for k in by_remainder[:n - sum(counts.values())]:
        counts[k] += 1
    for name, c in counts.items():
        epoch, pos = cursor.cursors[name]
        more, pos = divmod(pos + c, cursor.rows[name])
        cursor.cursors[name] = (epoch + more, pos)
    cursor.draws += n
    return counts


def replay(stages: list[Stage], rows: dict[str, int], rows_per_step: int, total_steps: int,
           seed: int = 0) -> list[tuple[int, str, int, int]]:
    """Every draw of the run as ``(step, source, epoch, row)``: what a loader following these
    stages reads, for tests and for checking the accounting against a run."""
    starts = stage_starts(stages, total_steps)
    out, cursor = [], None
    for st, s0, s1 in zip(stages, starts, starts[1:] + [total_steps], strict=True):
        cursor = _stage_cursor(cursor, st, rows, seed)
        for step in range(s0, s1):
            out.extend((step, *cursor.next()) for _ in range(rows_per_step))
    return out


def _manifest(path: Path) -> dict | None:
    """The pretokenize manifest of a source folder (``DIR/train`` reads ``DIR/manifest.json``)."""
    for folder in (path, path.parent):
        f = folder / "manifest.json"
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError):
                return None
    return None


def check_compatible(sources: dict[str, str | Path], key: str = "data.train") -> None:
    """Sources written with another tokenizer (sha256) or seq_len than the first one: MixtureError
    naming the key path of the source, both values and both manifests. A source without a readable
    manifest is not compared (the loader still checks its row length)."""
    first: tuple[str, Path, dict] | None = None
    for i, (name, p) in enumerate(sources.items()):
        path = Path(p).expanduser()
        m = _manifest(path)
        if m is None:
            continue
        if first is None:
            first = (name, path, m)
            continue
        fname, fpath, fm = first
        for field, get in (("seq_len", lambda d: d.get("seq_len")),
                           ("tokenizer", lambda d: (d.get("tokenizer") or {}).get("sha256"))):
            a, b = get(fm), get(m)
            if a is not None and b is not None and a != b:
                raise MixtureError(f"{key}[{i}] ({name}, {path}): made with {field} {b!r}, but source "
                                   f"{fname!r} ({fpath}) with {field} {a!r}; every source of a mixture "
                                   f"needs the same tokenizer and seq_len")
