"""Generate docs/config.md and docs/config.schema.json from the schema (run: python -m apr.config.docgen)."""

from __future__ import annotations

import json
import sys
import typing
from enum import Enum
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from apr.config.schema import AprConfig

HEADER = """# Config reference

Generated from `apr/config/schema.py` by `python -m apr.config.docgen`; a test fails when this file
is stale. Counts accept `32768`, `32_768`, `512K`, `1.5M`, `10B`; memory sizes accept `24GiB`,
`80GB`, `16G`. Unknown keys are errors (with a did-you-mean suggestion). Editors can validate
configs with the JSON Schema in `docs/config.schema.json` (or `apr schema`): put
`# yaml-language-server: $schema=<path>/config.schema.json` at the top of a config.

The canonical example is `configs/train/pretrain-350m-v2.yaml`.

## Reusing configs: `extends` and command-line settings

A config may start from another: `extends: base.yaml` (or a list, `extends: [a.yaml, b.yaml]`,
later files winning) names base configs relative to the file that extends them; a base may extend
another (a cycle or a chain deeper than 16 is an error). The file's own keys then apply over the
bases, and `KEY.PATH=VALUE` settings on the command line (`apr train validate|plan|apply CONFIG
training.max_steps=100 optimizer.lr=1e-3`) over both. Precedence, lowest first: the defaults below <
the bases < the file < the command line.

- **Mappings merge** key by key, recursively: a file that sets `optimizer.lr` keeps the base's
  `optimizer.weight_decay`.
- **Anything else replaces** the base's value whole: a list (`monitoring.alerts: []` drops every
  base alert), a scalar, and `null` (which sets the key to null, e.g. `data.val: null`).
- **Settings** are read as YAML values (`1e-3` a number, `true` a boolean, `null`, `[1, 2]` a
  list, anything else a string) and checked like a file's values: an unknown key gets a did-you-mean
  and the finding says `command line`. Paths inside any file stay relative to the current folder,
  as in a single file.
- Every finding names the file and line where the value was set (a base's own line when it came
  from the base). `apr train plan CONFIG --explain KEY` prints the effective value of a key or a
  whole section and where each value came from (`default`, `FILE:LINE` or `command line`); the
  plan's "Config layers" section (and `layers` in `--json`) lists what the file and the command
  line changed from the base.
- `apr train apply` records the settings with the run (in the plan and every checkpoint). A resume
  recomputes the config from the file and the settings given then: leaving out a setting that
  changes the run in a way a resume cannot take (e.g. `training.seed`) is refused like any config
  change, with the settings the run was started with. A saved plan (`-out`) fixes its settings;
  `apply PLAN.json` takes none.

### Where `extends` may point

A config is often checked by CI on a pull request, so `extends` cannot be a way to read the
machine's files:

- A base is a YAML file (`.yaml` or `.yml`), named relative to the file that extends it.
- It must lie inside the repository holding the top config (the nearest folder above it with a
  `.git`), or, outside a repository, inside the current folder (when the config is there) or the
  config's own folder. An absolute path, a `../` path above that root, or a symlink that resolves
  outside it is refused (`config.extends_outside`). Set `APR_EXTENDS_ANYWHERE=1` in the environment
  to allow any path (the environment, never a config, can opt in).
- Errors about a base's keys name the key path, the base file and the line, never the value found
  there: a file that is not an apr config is never echoed, in text, JSON or GitHub annotations.
- All the layers together are bounded: at most 32 files read (a base reached twice, as in a
  diamond, counts twice), 128 KiB and 4,000 values in all, besides each file's own limits (64 KiB,
  2,000 values). Past a bound the error is at the `extends` line that crossed it
  (`config.extends_too_many`, `config.extends_too_large`).
"""


def _type_name(ann) -> str:
    origin = typing.get_origin(ann)
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if origin is typing.Annotated:
        return _type_name(args[0]) if args else "?"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        names = " or ".join(_type_name(a) for a in args)
        return names + (" or null" if type(None) in typing.get_args(ann) else "")
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"mapping {_type_name(args[0])} -> {_type_name(args[1])}"
    if isinstance(ann, type) and issubclass(ann, Enum):
        return " \\| ".join(f"`{m.value}`" for m in ann)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return f"`{json.dumps(value)}`"


def _sections_in(ann, listed: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The sections a key's type holds, each with whether it is a list item (``str | list[DataSource]``
    -> DataSource, listed; ``LoraConfig | None`` -> LoraConfig, a single optional section)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [(ann, listed)]
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is typing.Annotated:
        return _sections_in(args[0], listed)
    return [found for a in args for found in _sections_in(a, listed or origin is list)]


def _rows(model: type[BaseModel], prefix: str, out: list[str], sections: list):
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = field.annotation
        inner = _sections_in(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            sections.append((path, ann))
            out.append(f"| `{path}` | section | {_default(field)} | see below |")
            continue
        desc = (field.description or "").replace("|", "\\|")
        if inner:
            model_cls, listed = inner[0]
            keyed = typing.get_origin(ann) is dict  # a mapping of named sections (orchestrator.strategies)
            sections.append((path + "[]" if listed else f"{path}.<name>" if keyed else path, model_cls))
            desc = (desc + " " if desc else "") + "See below."
        out.append(f"| `{path}` | {_type_name(ann)} | {_default(field)} | {desc} |")


def _summary(doc: str) -> str:
    """A class docstring's first paragraph, whole (its lines joined)."""
    return " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())


# ``extends`` is read by the loader (apr/config/layers.py) before the schema sees the file, so it is no
# schema field; it is still a top-level key a user writes, listed with the others
EXTENDS_ROW = ("| `extends` | string \\| list of strings | (none) | Base config file(s), relative to this file; this "
               "file's keys apply over them (see \"Reusing configs\" above). |")


def render_markdown() -> str:
    parts = [HEADER]
    queue: list = [("", AprConfig)]
    while queue:
        path, model = queue.pop(0)
        parts.append(f"\n## `{path}`\n" if path else "\n## Top-level keys\n")
        if model.__doc__ and model is not AprConfig:
            parts.append(_summary(model.__doc__) + "\n")
        parts.append("| key | type | default | meaning |\n| --- | --- | --- | --- |")
        rows: list[str] = [] if path else [EXTENDS_ROW]
        found: list = []
        _rows(model, f"{path}." if path else "", rows, found)
        parts.append("\n".join(rows))
        queue.extend(found)
    return "\n".join(parts) + "\n"


def render_schema() -> str:
    doc = AprConfig.model_json_schema()
    doc["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    doc["title"] = "apr training config"
    doc["properties"] = {"extends": {  # read by the loader (apr/config/layers.py), not a schema field
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}],
        "description": "Base config file(s), relative to this file; this file's keys apply over them."},
        **doc["properties"]}
    return json.dumps(doc, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    docs = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "docs"
    (docs / "config.md").write_text(render_markdown())
    (docs / "config.schema.json").write_text(render_schema())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
