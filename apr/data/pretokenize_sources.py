"""``apr data pretokenize --source NAME=PATH ...``: several named sources of a mixture in one call
(issue 21 item 5). One tokenizer, one seq_len and one seed for all: each source is pretokenized
into ``OUT/NAME`` (a complete dataset of its own: train/, val/, manifest.json, written atomically
by ``apr.data.pretokenize``), then ``OUT/manifest.json`` records every source's size (rows per
split, tokens, documents) and the shared tokenizer digest and seq_len, so a mixture's sources are
known to be compatible. A source that fails stops the call; sources written before it are kept.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from apr.data.pretokenize import pretokenize
from apr.data.shards import MANIFEST, check_destination
from apr.errors import AprError, Finding

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_sources(values: list[str]) -> dict[str, list[Path]]:
    """``NAME=PATH`` options (a name may repeat to add paths) -> {name: [paths]}, in order given."""
    sources: dict[str, list[Path]] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not path or not NAME.match(name) or name in ("train", "val"):
            raise AprError(f"--source {v!r}: expected NAME=PATH", [Finding(
                "error", "data.source", "a named source of the mixture", path="--source",
                expected="NAME=PATH, NAME of letters, digits, _ . - (not train or val)", got=v)])
        sources.setdefault(name, []).append(Path(path))
    return sources


def pretokenize_sources(sources: dict[str, list[Path]], tokenizer_path: str | Path, seq_len: int,
                        out: str | Path, *, overwrite: bool = False, **options) -> dict:
    """Pretokenize each source into ``out/NAME``; write and return ``out/manifest.json``."""
    out = Path(out)
    if not sources:
        raise AprError("no source given", [Finding("error", "data.source", "give --source NAME=PATH",
                                                   path="--source", expected="at least one source")])
    inputs = [p for paths in sources.values() for p in paths]
    check_destination(out, overwrite, [*inputs, Path(tokenizer_path)])
    out.mkdir(parents=True, exist_ok=True)
    per_source = {}
    for name, paths in sources.items():
        m = pretokenize(paths, tokenizer_path, seq_len, out / name, overwrite=overwrite, **options)
        per_source[name] = {"path": name, "documents": m["documents"], "tokens_total": m["tokens_total"],
                            "rows": {split: info["rows"] for split, info in m["splits"].items()},
                            "row_len": m["row_len"]}
    manifest = {"kind": "mixture_sources", "seq_len": seq_len, "row_len": seq_len + 1,
                "tokenizer": m["tokenizer"], "seed": options.get("seed", 0), "sources": per_source}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
