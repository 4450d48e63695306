"""What the plan says about a data mixture (``data.train`` as a list of sources, ``data.stages``).

Config-only findings (``mixture_config_findings``, run by validate too): duplicate source names,
stages without sources, weights that are negative, all zero or name an unknown source, stage starts
that are not increasing, ``training.decay_stage`` naming no stage. Plan findings and facts
(``mixture_facts``): sources made with another tokenizer or seq_len, a stage that starts after the
run ends, and the accounting of ``apr.data.mixplan.account``: rows, tokens and epochs per source
per stage, the step each stage starts at, a warning above 4 epochs of a source, an error when a
source runs out under ``data.repeat: false``. The data contracts are evaluated once per source
(``source_contract_results``), their findings at ``data.train[i].path`` / ``.val``.
See docs/design.md, "Data mixtures".
"""

from __future__ import annotations

import copy
import re
from dataclasses import replace

from apr.config import LoadedConfig
from apr.config.layers import key_loc
from apr.config.schema import AprConfig
from apr.data.mixconfig import raw_stages, stage_names, token_stages
from apr.data.mixplan import account, check_compatible, stage_starts
from apr.data.mixture import MixtureError
from apr.errors import Finding

WARN_EPOCHS = 4.0  # repeated data stops helping after ~4 epochs (Muennighoff et al., 2023)
_KEY_RE = re.compile(r"^(data\.[A-Za-z_]+(?:\[\d+\])?(?:\.[A-Za-z_]+)*(?:\.[A-Za-z0-9_]+)?)")


def _finding(loaded: LoadedConfig, severity: str, key: str, message: str, expected: str | None = None,
             got: str | None = None, code: str = "config.mixture") -> Finding:
    loc = key_loc(key)
    while loc:  # the deepest key the file has (a weight of an unknown source has its own line)
        file, line, column = loaded.source.where(loc)
        if line is not None:
            break
        loc = loc[:-1]
    else:
        file, line, column = str(loaded.path), None, None
    return Finding(severity, code, message, path=key, file=file, line=line, column=column,
                   expected=expected, got=got)


def _from_error(loaded: LoadedConfig, err: MixtureError, default_key: str, code: str = "config.mixture") -> Finding:
    """A MixtureError whose message starts with its key path, as a located finding."""
    text = str(err)
    m = _KEY_RE.match(text)
    key = m.group(1) if m else default_key
    return _finding(loaded, "error", key, text, code=code)


def mixture_config_findings(loaded: LoadedConfig) -> list[Finding]:
    """Problems of the mixture keys that need no data (validate and plan)."""
    data, tr = loaded.config.data, loaded.config.training
    out: list[Finding] = []
    sources = data.sources
    if sources is None:
        if data.stages:
            out.append(_finding(loaded, "error", "data.stages", "data.stages needs data.train to list named sources "
                                "(name, path, weight)", "data.train as a list of sources", "one data.train path"))
        if tr.decay_stage:
            out.append(_finding(loaded, "error", "training.decay_stage", "training.decay_stage names a data stage, "
                                "but data.train is one path without stages", "data.stages", "none"))
        return out
    if not sources:
        return [_finding(loaded, "error", "data.train", "data.train lists no sources", "at least one source",
                         "an empty list")]
    seen: dict[str, int] = {}
    for i, s in enumerate(sources):
        if s.name in seen:
            out.append(_finding(loaded, "error", f"data.train[{i}].name", f"source name {s.name!r} is used twice "
                                f"(data.train[{seen[s.name]}] too)", "a different name per source", s.name))
        seen.setdefault(s.name, i)
    names = set(seen)
    if not data.stages:
        if sum(s.weight for s in sources) <= 0:
            out.append(_finding(loaded, "error", "data.train", "every source's weight is 0: the mixture draws "
                                "nothing", "at least one weight > 0", "all zero"))
    else:
        previous: tuple[str, int | float] | None = None
        named: dict[str, int] = {}
        for i, st in enumerate(data.stages):
            if st.name is not None and st.name in named:
                out.append(_finding(loaded, "error", f"data.stages[{i}].name", f"stage name {st.name!r} is used "
                                    f"twice (data.stages[{named[st.name]}] too)", "a different name per stage",
                                    st.name))
            named.setdefault(st.name, i)
            for name, w in st.weights.items():
                key = f"data.stages[{i}].weights.{name}"
                if name not in names:
                    out.append(_finding(loaded, "error", key, f"stage {i} weighs unknown source {name!r}",
                                        f"one of the sources {sorted(names)}", repr(name)))
                elif w < 0:
                    out.append(_finding(loaded, "error", key, f"weight of {name!r} in stage {i} is negative",
                                        "a weight >= 0", repr(w)))
            if st.weights and all(w == 0 for w in st.weights.values()):
                out.append(_finding(loaded, "error", f"data.stages[{i}].weights", f"stage {i}'s weights are all "
                                    "zero: it draws nothing", "at least one weight > 0", "all zero"))
            elif not st.weights:
                out.append(_finding(loaded, "error", f"data.stages[{i}].weights", f"stage {i} names no source",
                                    "source name -> weight", "{}"))
            start = st.start
            key = f"data.stages[{i}].start"
            if isinstance(start, float) and not 0.0 <= start < 1.0:
                out.append(_finding(loaded, "error", key, "a fractional start must lie in [0, 1)",
                                    "a fraction in [0, 1) or a step", repr(start)))
            elif isinstance(start, int) and start < 0:
                out.append(_finding(loaded, "error", key, "a start step must be >= 0", "a step >= 0", str(start)))
            elif i == 0 and start != 0:
                out.append(_finding(loaded, "error", key, "the first stage must start at step 0", "0", repr(start)))
            elif previous is not None and type(start) is type(previous[1]) and start <= previous[1]:
                out.append(_finding(loaded, "error", key, f"stage {i} starts at {start!r}, not after stage {i - 1} "
                                    f"({previous[1]!r})", f"a start after {previous[1]!r}", repr(start)))
            previous = (key, start)
    if tr.decay_stage:
        known = stage_names(data)
        if tr.decay_stage not in known:
            out.append(_finding(loaded, "error", "training.decay_stage", f"training.decay_stage names no data stage "
                                f"({', '.join(known)})", "one of " + ", ".join(known), repr(tr.decay_stage)))
        elif str(tr.lr_scheduler) != "wsd":
            out.append(_finding(loaded, "error", "training.decay_stage", "training.decay_stage sets where a wsd decay "
                                f"starts, but lr_scheduler is {tr.lr_scheduler}", "lr_scheduler: wsd",
                                str(tr.lr_scheduler)))
    return out


def mixture_facts(loaded: LoadedConfig, facts: dict, world_size: int) -> tuple[dict | None, list[Finding]]:
    """The mixture's accounting over the planned run, and its findings (None without a mixture, or
    when the sources cannot be counted: the data contracts say why)."""
    config = loaded.config
    data, tr = config.data, config.training
    if data.sources is None or mixture_config_findings(loaded):
        return None, []
    per_source = (facts.get("data") or {}).get("sources") or {}
    rows = {s.name: (per_source.get(s.name) or {}).get("sequences") for s in data.sources}
    total = (facts.get("steps") or {}).get("total_steps")
    if any(not r for r in rows.values()) or total is None:
        return None, []
    try:
        check_compatible({s.name: s.path for s in data.sources})
    except MixtureError as e:
        return None, [_from_error(loaded, e, "data.train", "data.mixture")]
    try:
        stages = token_stages(data)
        starts = stage_starts(stages, total)
    except MixtureError as e:
        return None, [_from_error(loaded, e, "data.stages", "data.mixture")]
    per_step = data.batch_size * tr.gradient_accumulation * world_size
    result = account(stages, rows, data.seq_len, per_step, total, seed=tr.seed, repeat=data.repeat,
                     warn_epochs=WARN_EPOCHS)
    index = {s.name: i for i, s in enumerate(data.sources)}
    findings = []
    for f in result["findings"]:
        name = re.search(r"source '([^']+)'", f.message).group(1)
        findings.append(_finding(loaded, f.level, "data.repeat" if f.level == "error" else f"data.train[{index[name]}]",
                                 f.message, code="data.mixture",
                                 expected=(f"at most {rows[name]} rows" if f.level == "error"
                                           else f"at most {WARN_EPOCHS:g} epochs"),
                                 got=f"{result['rows'][name]} rows ({result['epochs'][name]:.2f} epochs)"))
    raw = raw_stages(data)
    out = {
        "unit": str(data.weight_unit), "repeat": data.repeat, "exact": result["exact"],
        "sources": {s.name: {"rows": rows[s.name], "path": s.path, "val": s.val,
                             "tokens": result["tokens"][s.name], "rows_drawn": result["rows"][s.name],
                             "epochs": result["epochs"][s.name]} for s in data.sources},
        "stages": [{**st, "first_step": st["start_step"] + 1, "steps": st["end_step"] - st["start_step"],
                    "weights": dict(raw[i].weights),
                    "token_shares": _shares(stages[i].weights)} for i, st in enumerate(result["stages"])],
        "stage_starts": starts,
    }
    return out, findings


def _shares(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values()) or 1.0
    return {n: w / total for n, w in weights.items()}


def source_dataset_facts(config: AprConfig, dataset_facts) -> dict:
    """``dataset_facts`` of every source's training folder, by name."""
    return {s.name: dataset_facts(s.path, config.data.input_column) for s in config.data.sources or []}


def merged_train_facts(per_source: dict) -> dict:
    """The facts of the sources together, for the contracts that read ``facts.data.train`` as a
    whole (step algebra, vocab against the largest token id): rows summed, the largest id."""
    values = list(per_source.values())
    out: dict = {"path": "mixture", "exists": all(v.get("exists") for v in values), "sources": len(values)}
    if all("sequences" in v for v in values):
        out["sequences"] = sum(v["sequences"] for v in values)
    if values and all(v.get("has_statistics") for v in values):
        out["has_statistics"] = True
        out["max_token_id"] = max(v["max_token_id"] for v in values)
        out["min_token_id"] = min(v["min_token_id"] for v in values)
    return out


def reads(contract, what: str) -> bool:
    """Whether a contract reads ``facts.data.<what>`` (train or val)."""
    text = " ".join([contract.rule or "", contract.when or "", " ".join(contract.requires), contract.message or ""])
    return f"facts.data.{what}" in text


def source_contract_results(contracts, loaded: LoadedConfig, facts: dict, dataset_facts, shared_shards,
                            evaluate_contracts) -> list[Finding]:
    """The data contracts over each source (its train folder, and its val folder when it has one),
    findings moved to ``data.train[i].path`` / ``data.train[i].val`` and named by the source."""
    config = loaded.config
    doc = config.model_dump(mode="json")
    out: list[Finding] = []
    per_source = (facts.get("data") or {}).get("sources") or {}
    for i, s in enumerate(config.data.sources or []):
        for role, path_key, folder in (("train", f"data.train[{i}].path", s.path),
                                       ("val", f"data.train[{i}].val", s.val)):
            if folder is None:
                continue
            sub = copy.deepcopy(facts)
            sub_doc = copy.deepcopy(doc)
            sub_doc["data"]["train"] = s.path
            sub["data"]["train"] = per_source.get(s.name) or dataset_facts(s.path, config.data.input_column)
            chosen = [c for c in contracts if reads(c, role)]
            if role == "val":
                sub_doc["data"]["val"] = s.val
                sub["data"]["val"] = dataset_facts(s.val, config.data.input_column)
                sub["data"]["val_shared_shards"] = shared_shards(s.path, s.val)
                chosen = [c for c in chosen if not reads(c, "train")]
            for r in evaluate_contracts(chosen, sub_doc, sub, loaded.source):
                f = r.finding
                if f is None:
                    continue
                if f.path in ("data.train", "data.val"):
                    file, line, column = loaded.source.where(key_loc(path_key))
                    f = replace(f, path=path_key, file=file, line=line, column=column)
                out.append(replace(f, message=f"source {s.name!r}: {f.message}"))
    return out
