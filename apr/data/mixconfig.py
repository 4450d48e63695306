"""A config's data mixture as the plan and the run both read it: stages in token weights.

``data.train`` as a list of sources, ``data.stages`` and ``data.weight_unit`` (apr/config/schema.py)
become a list of ``apr.data.mixplan.Stage`` whose weights are token shares: the unit the loader
draws in (every row holds seq_len + 1 tokens, so a share of rows is a share of tokens). Weights in
documents are converted with each source's tokens per document from its pretokenize manifest
(``tokens_total / documents``), so plan and run turn the same config into the same schedule.
Torch-free: ``apr train validate`` and ``plan`` import it. See docs/design.md, "Data mixtures".
"""

from __future__ import annotations

from pathlib import Path

from apr.config.schema import DataConfig
from apr.data.mixplan import Stage, _manifest, stage_starts
from apr.data.mixture import MixtureError


def raw_stages(data: DataConfig) -> list[Stage]:
    """The stages as written (weights in ``data.weight_unit``); one stage of the sources' weights
    when ``data.stages`` is not given."""
    if data.stages:
        return [Stage(weights=dict(st.weights), start=st.start, name=st.name or f"stage{i}")
                for i, st in enumerate(data.stages)]
    return [Stage(weights={s.name: s.weight for s in data.sources or []}, start=0, name="stage0")]


def tokens_per_document(path: str | Path) -> float | None:
    """Tokens per document of a source, from the manifest ``apr data pretokenize`` wrote beside its
    shards (``DIR/manifest.json`` or ``DIR/../manifest.json``); None without one."""
    m = _manifest(Path(path).expanduser())
    if not m or not m.get("documents") or not m.get("tokens_total"):
        return None
    return float(m["tokens_total"]) / float(m["documents"])


def token_stages(data: DataConfig) -> list[Stage]:
    """The stages with weights in tokens (what the loader draws): documents are converted with each
    source's tokens per document; MixtureError names a source without a manifest to convert with."""
    stages = raw_stages(data)
    if data.weight_unit != "documents":
        return stages
    per_doc = {}
    for i, s in enumerate(data.sources or []):
        value = tokens_per_document(s.path)
        if value is None:
            raise MixtureError(f"data.train[{i}].path: data.weight_unit documents needs the source's document "
                               f"count (the manifest.json `apr data pretokenize` writes), found none for "
                               f"{s.name!r} at {s.path}")
        per_doc[s.name] = value
    return [Stage(weights={n: w * per_doc.get(n, 0.0) for n, w in st.weights.items()}, start=st.start, name=st.name)
            for st in stages]


def stage_names(data: DataConfig) -> list[str]:
    return [st.name for st in raw_stages(data)]


def decay_start_step(config, total_steps: int) -> int | None:
    """``training.decay_stage``: the step the named data stage starts at (where a wsd schedule
    begins its decay); None when it is not set."""
    name = getattr(config.training, "decay_stage", None)
    if not name:
        return None
    names = stage_names(config.data)
    if name not in names:
        raise MixtureError(f"training.decay_stage: expected one of the data stages {names}, found {name!r}")
    return stage_starts(raw_stages(config.data), total_steps)[names.index(name)]
