"""Contracts are data: load ``contracts/*.yaml`` and evaluate their CEL rules over config and facts.

A contract holds when its ``rule`` is true. When it does not, it becomes a Finding of its severity,
located at the config key named by ``path`` (line and column from the config's SourceMap). A
contract is skipped when its ``when`` precondition is false or a fact it ``requires`` is unknown.
Messages are templates: ``${expr}`` is a CEL expression over the same variables, and ``${expr |
bytes}`` picks a display format (count, bytes, pct, flops, duration, raw). Formatting is
presentation only; every comparison lives in the rule.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from apr.cel import CelError, compile_expr, evaluate
from apr.errors import ConfigError, Finding
from apr.fmt import fmt_estimate, fmt_giga, format_bytes, format_count
from apr.resources import resource_dir

SEVERITIES = ("error", "warning", "info")
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}
NEEDS = ("config", "data", "tokenizer")
_ID_RE = re.compile(r"^C-[A-Z]+-[0-9]{3}$")
_KEYS = {"id", "title", "severity", "needs", "path", "when", "requires", "rule", "message", "expected",
         "got", "rationale", "examples"}


class ContractFileError(ConfigError):
    """A contract file is malformed (a bug in the shipped contracts, or in a user's own)."""


@dataclass(frozen=True)
class Contract:
    id: str
    title: str
    severity: str
    needs: tuple[str, ...]
    rule: str
    message: str
    rationale: str
    path: str = ""
    when: str | None = None
    requires: tuple[str, ...] = ()
    expected: str | None = None
    got: str | None = None
    examples: tuple[dict, ...] = ()
    family: str = ""
    file: str = ""
    line: int | None = None

    @property
    def config_only(self) -> bool:
        return set(self.needs) == {"config"}


@dataclass
class ContractResult:
    contract: Contract
    status: str  # "passed" | "failed" | "skipped"
    finding: Finding | None = None
    reason: str = ""

    def to_dict(self) -> dict:
        c = self.contract
        out = {"id": c.id, "title": c.title, "severity": c.severity, "needs": list(c.needs),
               "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass
class ContractSet:
    contracts: list[Contract]
    families: dict[str, dict] = field(default_factory=dict)  # family -> {file, title, description}

    def by_id(self, cid: str) -> Contract:
        for c in self.contracts:
            if c.id == cid:
                return c
        raise KeyError(cid)


# ------------------------------------------------------------------------------------- loading


def _bad(file: str, line: int | None, message: str, path: str = "") -> ContractFileError:
    return ContractFileError(f"invalid contract file {file}: {message}",
                             [Finding("error", "contract.invalid", message, path=path, file=file, line=line)])


def _parse_contract(item: Any, i: int, family: str, file: str, source) -> Contract:
    loc = ("contracts", i)
    line = source.locate(loc)[0]
    where = f"contracts[{i}]"
    if not isinstance(item, dict):
        raise _bad(file, line, "each contract must be a mapping", where)
    unknown = set(item) - _KEYS
    if unknown:
        raise _bad(file, line, f"unknown key(s) {sorted(unknown)}; allowed: {sorted(_KEYS)}", where)
    for key in ("id", "title", "severity", "needs", "rule", "message", "rationale"):
        if not item.get(key):
            raise _bad(file, line, f"'{key}' is required", f"{where}.{key}")
    cid = str(item["id"])
    if not _ID_RE.match(cid):
        raise _bad(file, line, f"id {cid!r} must look like C-FAMILY-001", f"{where}.id")
    if item["severity"] not in SEVERITIES:
        raise _bad(file, line, f"{cid}: severity must be one of {SEVERITIES}", f"{where}.severity")
    needs = item["needs"] if isinstance(item["needs"], list) else [item["needs"]]
    if not needs or any(n not in NEEDS for n in needs):
        raise _bad(file, line, f"{cid}: needs must be among {NEEDS}", f"{where}.needs")
    requires = item.get("requires") or []
    if not isinstance(requires, list) or any(not str(r).startswith("facts.") for r in requires):
        raise _bad(file, line, f"{cid}: requires must be a list of fact paths (facts.x.y)", f"{where}.requires")
    examples = item.get("examples") or []
    if not isinstance(examples, list) or any(not isinstance(e, dict) for e in examples):
        raise _bad(file, line, f"{cid}: examples must be a list of mappings", f"{where}.examples")
    for ex in examples:
        if ex.get("expect") not in ("pass", "fail"):
            raise _bad(file, line, f"{cid}: every example needs expect: pass or fail", f"{where}.examples")
    for key in ("rule", "when"):
        if item.get(key) is not None:
            try:
                compile_expr(str(item[key]))
            except CelError as e:
                raise _bad(file, source.locate(loc + (key,))[0], f"{cid}: {e.message}", f"{where}.{key}") from None
    for key in ("message", "expected", "got"):
        if item.get(key) is not None:
            for expr, _fmt in _template_parts(str(item[key])):
                try:
                    compile_expr(expr)
                except CelError as e:
                    raise _bad(file, source.locate(loc + (key,))[0], f"{cid}: {e.message}",
                               f"{where}.{key}") from None
    return Contract(
        id=cid, title=str(item["title"]), severity=item["severity"], needs=tuple(needs),
        rule=str(item["rule"]).strip(), message=" ".join(str(item["message"]).split()),
        rationale=" ".join(str(item["rationale"]).split()), path=str(item.get("path") or ""),
        when=str(item["when"]).strip() if item.get("when") else None, requires=tuple(requires),
        expected=item.get("expected"), got=item.get("got"), examples=tuple(examples), family=family,
        file=file, line=line)


def load_contract_file(path: Path) -> tuple[dict, list[Contract]]:
    from apr.config.yamlfile import read_yaml

    file = str(path)
    try:
        data, source, _ = read_yaml(path, what="contract file")
    except ConfigError as e:  # YAML syntax: the same line/column, reported as a contract-file problem
        raise ContractFileError(f"invalid contract file {file}: {e.message}", e.findings) from None
    if not isinstance(data, dict) or not isinstance(data.get("contracts"), list):
        raise _bad(file, 1, "a contract file is a mapping with 'family' and a 'contracts' list")
    family = str(data.get("family") or path.stem)
    meta = {"file": path.name, "title": str(data.get("title") or family),
            "description": " ".join(str(data.get("description") or "").split())}
    return meta, [_parse_contract(item, i, family, file, source) for i, item in enumerate(data["contracts"])]


COMPILED_NAME = "compiled.json"
_COMPILED_FORMAT = 1


def load_contracts(directory: Path | None = None) -> ContractSet:
    """Every contract in ``directory`` (default: the shipped ``contracts/``), in file then list order.

    Parsing YAML with line numbers costs ~0.3 s, too much for `apr train validate`; so when the
    folder holds a ``compiled.json`` written from exactly these files (same names and SHA-256),
    contracts come from it instead. Any edit to a YAML file makes it stale and the YAML is parsed
    (``python -m apr.plan.docgen`` rewrites it, with docs/contracts.md).
    """
    return _load_cached(str(directory) if directory is not None else None)


def contracts_folder(directory: Path | str | None = None) -> Path:

    return Path(directory) if directory else resource_dir("contracts")


def _digest(files: list[Path]) -> str:

    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=8)
def _load_cached(directory: str | None) -> ContractSet:
    folder = contracts_folder(directory)
    files = sorted(folder.glob("*.yaml"))
    digest = _digest(files)
    compiled = _read_compiled(folder, digest)
    if compiled is not None:
        return compiled
    return _parse_folder(folder, files)


def _parse_folder(folder: Path, files: list[Path]) -> ContractSet:
    contracts: list[Contract] = []
    families: dict[str, dict] = {}
    for path in files:
        meta, items = load_contract_file(path)
        families[items[0].family if items else path.stem] = meta
        contracts += items
    seen: dict[str, str] = {}
    for c in contracts:
        if c.id in seen:
            raise _bad(c.file, c.line, f"duplicate contract id {c.id} (also in {seen[c.id]})")
        seen[c.id] = c.file
    return ContractSet(contracts, families)


def _contract_dict(c: Contract) -> dict:
    d = {k: getattr(c, k) for k in Contract.__dataclass_fields__}
    d["file"] = Path(c.file).name
    return json.loads(json.dumps(d))  # tuples become lists; examples must be JSON-able


def _read_compiled(folder: Path, digest: str) -> ContractSet | None:
    try:
        doc = json.loads((folder / COMPILED_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != _COMPILED_FORMAT or doc.get("sha256") != digest:
        return None
    contracts = []
    for d in doc["contracts"]:
        d = dict(d, file=str(folder / d["file"]))
        for key in ("needs", "requires", "examples"):
            d[key] = tuple(d[key])
        contracts.append(Contract(**d))
    return ContractSet(contracts, doc["families"])


def compile_contracts(directory: Path | str | None = None) -> str:
    """The text of ``compiled.json`` for the YAML files in ``directory`` (parsed and checked)."""
    folder = contracts_folder(directory)
    files = sorted(folder.glob("*.yaml"))
    parsed = _parse_folder(folder, files)
    doc = {"format": _COMPILED_FORMAT, "generated_by": "python -m apr.plan.docgen",
           "sha256": _digest(files), "families": parsed.families,
           "contracts": [_contract_dict(c) for c in parsed.contracts]}
    return json.dumps(doc, indent=1, sort_keys=False) + "\n"


# ----------------------------------------------------------------------------------- templates


def _template_parts(template: str) -> list[tuple[str, str]]:
    """The ``${...}`` expressions of a template with their formats, balancing braces inside."""
    parts = []
    i = 0
    while (start := template.find("${", i)) != -1:
        depth, j = 1, start + 2
        while j < len(template) and depth:
            depth += {"{": 1, "}": -1}.get(template[j], 0)
            j += 1
        body = template[start + 2:j - 1]
        expr, fmt = _split_format(body)
        parts.append((expr, fmt))
        i = j
    return parts


_FORMATS = ("count", "bytes", "pct", "flops", "duration", "raw", "float")
_FMT_RE = re.compile(r"^(.*?)\s\|\s*(" + "|".join(_FORMATS) + r")\s*$", re.S)


def _split_format(body: str) -> tuple[str, str]:
    m = _FMT_RE.match(body)
    return (m.group(1).strip(), m.group(2)) if m else (body.strip(), "")


def format_value(value: Any, fmt: str = "") -> str:
    if fmt == "bytes":
        return format_bytes(value)
    if fmt == "pct":
        return f"{value * 100:.1f}%"
    if fmt == "count":
        return format_count(value)
    if fmt == "flops":
        return fmt_giga(value) + "FLOP"
    if fmt == "duration":
        return fmt_estimate(value)
    if fmt == "raw":
        return str(value)
    if fmt == "float":
        return f"{value:.4g}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:.4g}"
    if value is None:
        return "null"
    if isinstance(value, list):
        return ", ".join(format_value(v) for v in value)
    return str(value)


def render_template(template: str, variables: dict) -> str:
    out, i = [], 0
    while (start := template.find("${", i)) != -1:
        depth, j = 1, start + 2
        while j < len(template) and depth:
            depth += {"{": 1, "}": -1}.get(template[j], 0)
            j += 1
        expr, fmt = _split_format(template[start + 2:j - 1])
        out.append(template[i:start])
        try:
            out.append(format_value(evaluate(expr, variables), fmt))
        except (CelError, TypeError, ValueError):
            out.append(f"<{expr}: unavailable>")
        i = j
    out.append(template[i:])
    return "".join(out)


# ---------------------------------------------------------------------------------- evaluation


def _has_fact(facts: dict, dotted: str) -> bool:
    node: Any = facts
    for part in dotted.split(".")[1:]:
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return True


def _key_path(path: str) -> tuple:
    return tuple(path.split(".")) if path else ()


def evaluate_contract(contract: Contract, variables: dict, source=None) -> ContractResult:
    """Evaluate one contract over ``{"config": ..., "facts": ...}``."""
    missing = [r for r in contract.requires if not _has_fact(variables["facts"], r)]
    if missing:
        return ContractResult(contract, "skipped", reason=f"needs {', '.join(missing)} (unknown)")
    try:
        if contract.when is not None and evaluate(contract.when, variables) is not True:
            return ContractResult(contract, "skipped", reason=f"does not apply ({contract.when})")
        verdict = evaluate(contract.rule, variables)
    except CelError as e:
        finding = Finding("error", contract.id, f"contract could not be evaluated: {e.message}",
                          path=contract.path, file=contract.file, line=contract.line)
        return ContractResult(contract, "failed", finding, reason="evaluation error")
    if not isinstance(verdict, bool):
        finding = Finding("error", contract.id, f"rule returned {verdict!r}, not a boolean",
                          path=contract.path, file=contract.file, line=contract.line)
        return ContractResult(contract, "failed", finding, reason="evaluation error")
    if verdict:
        return ContractResult(contract, "passed")
    line = column = None
    file = None
    if source is not None:
        file, line, column = source.where(_key_path(contract.path))
    finding = Finding(
        contract.severity, contract.id, render_template(contract.message, variables), path=contract.path,
        file=file, line=line, column=column,
        expected=render_template(contract.expected, variables) if contract.expected else None,
        got=render_template(contract.got, variables) if contract.got else None)
    return ContractResult(contract, "failed", finding)


def evaluate_contracts(contracts: list[Contract], config: dict, facts: dict, source=None) -> list[ContractResult]:
    variables = {"config": config, "facts": facts}
    return [evaluate_contract(c, variables, source) for c in contracts]
