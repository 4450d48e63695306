"""`apr runs blame RUN --step N`: the rows of a logged step ranked by their loss (docs/runs.md, "Blame").

The rows come from the run's local store (``row_losses``, written by apr/train/blame.py at each
logged step); the registry names the run's folder when the run is found there first. Each row is
decoded to text where the run's config (``RUN_DIR/config.yaml``), its data and its tokenizer are at
hand; otherwise ``text`` is null and a note says why. pyarrow and tokenizers are imported only to
decode.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from apr.errors import AprError, Finding
from apr.track import store
from apr.track.runs import show_run

DEFAULT_TOP = 10


def _error(code: str, message: str, **kw) -> AprError:
    return AprError(message, [Finding("error", code, message, **kw)])


def steps_text(steps: list[int]) -> str:
    """'2, 4, 6' or, for many, '10, 20, 30, ..., 4980, 4990, 5000 (500 steps)'."""
    if len(steps) <= 8:
        return ", ".join(str(s) for s in steps)
    return ", ".join(str(s) for s in steps[:3]) + ", ..., " + ", ".join(str(s) for s in steps[-3:]) + \
        f" ({len(steps)} steps)"


def _local_store(detail: dict) -> Path:
    """The run's own store, ``<output_dir>/.apr/experiments.db`` (the only one with row losses), or
    the store it was found in when that folder is gone."""
    out = detail["run"].get("output_dir")
    local = Path(out) / ".apr" / "experiments.db" if out else None
    return local if local is not None and local.is_file() else Path(detail["run"]["store"])


def blame(run_id: str, step: int, *, top: int | None = DEFAULT_TOP, decode: bool = True, global_: bool = False,
          root: Path | None = None, apr_home: Path | None = None, warnings: list[str] | None = None) -> dict:
    """``{"run_id", "step", "rows", "row_count", "mean_loss", "store", "notes"}``: the ``top`` rows of
    ``step`` by loss (all with None), each ``{"rank", "loss", "source", "shard", "row", "data_index",
    "micro_batch", "text"}``; ``row_count`` and ``mean_loss`` over all the step's rows. AprError
    naming the steps that have a record when ``step`` has none."""
    if top is not None and top < 1:
        raise _error("runs.invalid_top", "--top must be at least 1", path="--top", expected=">= 1", got=str(top))
    detail = show_run(run_id, global_=global_, root=root, apr_home=apr_home, warnings=warnings)
    full_id, path = detail["run"]["run_id"], _local_store(detail)
    conn = store.connect_readonly(path)
    try:
        rows = store.row_losses(conn, full_id, step)
        steps = [] if rows else store.row_loss_steps(conn, full_id)
    except sqlite3.Error as e:
        raise _error("track.store_damaged", f"{path}: cannot read the row losses of run {full_id}: {e}",
                     file=str(path), expected="an apr experiment store") from None
    finally:
        conn.close()
    if not rows:
        there = f"steps with a record: {steps_text(steps)}" if steps else \
            "it has none (row losses are recorded at logged steps since apr's store schema 5)"
        raise _error("runs.no_blame", f"run {full_id} has no row losses at step {step}; {there}",
                     path="--step", file=str(path), expected=f"a step among: {steps_text(steps)}" if steps
                     else "a run with row losses", got=str(step))
    train = detail["params"].get("data.train")
    shown = rows if top is None else rows[:top]
    out = [{"rank": i + 1, "loss": r["loss"], "source": r["source"] if r["source"] is not None else train,
            "shard": r["shard"], "row": r["row"], "data_index": r["data_index"], "micro_batch": r["micro_batch"],
            "text": None} for i, r in enumerate(shown)]
    notes: list[str] = []
    if decode:
        notes += decode_rows(detail, out, single_source=all(r["source"] is None for r in shown))
    losses = [r["loss"] for r in rows if r["loss"] is not None]
    return {"run_id": full_id, "step": int(step), "rows": out, "row_count": len(rows),
            "mean_loss": sum(losses) / len(losses) if losses else None, "store": str(path), "notes": notes}


def decode_rows(detail: dict, rows: list[dict], single_source: bool) -> list[str]:
    """Fill each row's ``text`` from its shard and the run's tokenizer; the notes say what could not
    be read (and the rows keep ``text`` None)."""
    run_dir = detail["run"].get("output_dir")
    config_path = Path(run_dir or ".") / "config.yaml"
    if not config_path.is_file():
        return [f"text not shown: the run's config {config_path} is not there"]
    try:
        from apr.config.loader import load_config  # lazy: pydantic, for decoding only

        config = load_config(config_path).config
    except (AprError, OSError) as e:
        return [f"text not shown: {getattr(e, 'message', e)}"]
    if not config.data.tokenizer:
        return ["text not shown: the run's config names no data.tokenizer"]
    tokenizer_path = _found(config.data.tokenizer, run_dir)
    try:
        from tokenizers import Tokenizer  # lazy: tokenizers, for decoding only

        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # the Rust side raises plain Exception (a missing file, a malformed one)
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        return [f"text not shown: cannot load the tokenizer {tokenizer_path}: {first}"]
    folders = {None: config.data.train} if single_source else {s.name: s.path for s in config.data.sources or []}
    tables: dict[Path, object] = {}
    missing: set[str] = set()
    for r in rows:
        base = folders.get(None if single_source else r["source"])
        if base is None:
            continue
        shard = _found(base, run_dir)
        shard = shard / r["shard"] if shard.is_dir() else shard
        try:
            if shard not in tables:
                import pyarrow.parquet as pq  # lazy: pyarrow, for decoding only

                tables[shard] = pq.read_table(shard, columns=[config.data.input_column]).column(0)
            ids = tables[shard][r["row"]].as_py()
        except (OSError, IndexError, KeyError, ValueError) as e:  # a moved or rewritten shard
            missing.add(f"{shard}: {type(e).__name__}")
            continue
        r["text"] = tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)
    return [f"text not shown for rows of {m}" for m in sorted(missing)]


def _found(path: str, run_dir: str | None) -> Path:
    """A data or tokenizer path of the run's config: as written (relative to where apply ran, which
    is often here), else relative to the run folder's parent."""
    p = Path(path).expanduser()
    if p.exists() or p.is_absolute() or not run_dir:
        return p
    beside = Path(run_dir).parent / p
    return beside if beside.exists() else p
