"""Generate docs/contracts.md and contracts/compiled.json from the contract files.

Run ``python -m apr.plan.docgen`` after editing anything in ``contracts/``; ``--check`` exits 1
(without writing) when either output is stale. A test fails when they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

from apr.plan.contracts import COMPILED_NAME, Contract, compile_contracts, contracts_folder, load_contracts

HEADER = """# Contracts

Generated from `contracts/*.yaml` by `python -m apr.plan.docgen`; a test fails when this file is
stale. `apr train plan` evaluates every contract below; `apr train validate` evaluates the ones that
need only the config (marked **config only**).

A contract holds when its `rule` is true. Rules are [CEL](https://cel.dev) expressions over two
variables: `config`, the resolved config (every key, defaults filled in, as in `docs/config.md`),
and `facts`, numbers Python derives from the config, the data's Parquet footers and the tokenizer
(`apr/plan/facts.py`; `apr train plan --json` prints them all). Python computes facts, never
verdicts. A contract is skipped when its `when` is false or a fact it `requires` is unknown (no
data folder, no target GPU, ...). When it does not hold it becomes a finding of its severity at the
config key `path` (file:line:column): `error` fails the plan (exit 1), `warning` fails it only with
`--strict`, `info` never does.

Messages are templates: `${expr}` is a CEL expression over the same variables and `${expr | fmt}`
picks a display format (`count`, `bytes`, `pct`, `flops`, `duration`, `float`, `raw`). Every
contract carries examples (overlays on a small base run, materialised as real config, Parquet
shards and tokenizer by `apr/plan/examples.py`) that the tests run: each contract has at least one
that passes and one that fails.
"""


def _needs(c: Contract) -> str:
    return "config only" if c.config_only else ", ".join(n for n in c.needs if n != "config")


def _code(text: str) -> str:
    text = " ".join(text.split())
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _contract_md(c: Contract) -> list[str]:
    passing = sum(e.get("expect") == "pass" for e in c.examples)
    failing = sum(e.get("expect") == "fail" for e in c.examples)
    lines = [f"### {c.id}: {c.title}", "",
             f"- severity: **{c.severity}**; needs: {'**config only**' if c.config_only else _needs(c)}"
             + (f"; key: `{c.path}`" if c.path else "")]
    if c.when:
        lines.append(f"- applies when: {_code(c.when)}")
    if c.requires:
        lines.append(f"- requires: {', '.join(f'`{r}`' for r in c.requires)}")
    lines += [f"- rule: {_code(c.rule)}",
              f"- message: {_code(c.message)}",
              f"- why: {c.rationale}",
              f"- examples: {passing} passing, {failing} failing", ""]
    return lines


def render_markdown(directory: Path | None = None) -> str:
    cs = load_contracts(directory)
    out = [HEADER, "## Summary", "", "| id | severity | needs | title |", "| --- | --- | --- | --- |"]
    out += [f"| [{c.id}](#{c.id.lower()}-{_anchor(c.title)}) | {c.severity} | {_needs(c)} | {c.title} |"
            for c in cs.contracts]
    out.append("")
    for family, meta in cs.families.items():
        out += [f"## {meta['title']} (`contracts/{meta['file']}`)", "", meta["description"], ""]
        for c in cs.contracts:
            if c.family == family:
                out += _contract_md(c)
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return keep.replace(" ", "-")


def outputs(repo: Path) -> dict[Path, str]:
    """Generated file -> its current text."""
    folder = contracts_folder(repo / "contracts")
    return {repo / "docs" / "contracts.md": render_markdown(folder),
            folder / COMPILED_NAME: compile_contracts(folder)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    repo = Path(__file__).resolve().parents[2]
    stale = []
    for path, text in outputs(repo).items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            stale.append(path)
            if "--check" not in argv:
                path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{'stale' if '--check' in argv else 'wrote'}: {path.relative_to(repo)}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main())
