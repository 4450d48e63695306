"""No config key is accepted and ignored (issue 24 item 15): every key of apr/config/schema.py is
read by code outside the schema. A key the code never reads fails here, naming it."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from apr.config.schema import AprConfig

ROOT = Path(__file__).resolve().parents[2]
NOT_READERS = {"apr/config/schema.py", "apr/config/docgen.py"}  # they define or document keys, never act on them

# key path -> why no reader is needed (keep short; each entry must say what the key does instead)
ALLOWED: dict[str, str] = {
    "monitoring.tracking.backend": "one value (sqlite), validated by its enum; no choice to act on",
    # read through LoraConfig.scaling / .modules (schema.py), which apr/model/lora.py and spec.py call
    "model.lora.alpha": "read by LoraConfig.scaling and written to adapter_config.json (apr/model/lora.py)",
    "model.lora.rslora": "read by LoraConfig.scaling and written to adapter_config.json (apr/model/lora.py)",
    "model.lora.targets": "read by LoraConfig.modules, which spec.lora_block_specs and add_adapters use",
    "model.stacking.trunk_lora.dropout": "read as adapters.dropout by apply_trunk (apr/model/trunk.py)",
    "model.stacking.trunk_lora.rslora": "read by LoraConfig.scaling, which apply_trunk and merged_weights use",
}


def _section_of(annotation) -> type[BaseModel] | None:
    """The section model a field holds (directly, in a list or optional), or None for a leaf."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_of(arg)
        if found is not None:
            return found
    return None


def schema_keys(model: type[BaseModel] = AprConfig, prefix: tuple[str, ...] = ()):
    """(key path tuple) of every field, sections included, depth first."""
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        yield path
        section = _section_of(field.annotation)
        if section is not None:
            yield from schema_keys(section, path)


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "apr").rglob("*.py")
            if str(p.relative_to(ROOT)) not in NOT_READERS}


def _is_read(path: tuple[str, ...], sources: dict[str, str]) -> bool:
    """Read as an attribute of its parent (``terminal.metrics``, ``tr.grad_clip`` where the parent is
    bound to a name: any ``.metrics`` in a file that names the parent section), as a dict key of a
    parsed config (``terminal["refresh_rate"]``), or through the flattened params (``a.b.c``)."""
    name = path[-1]
    parent = path[-2] if len(path) > 1 else None
    dotted = ".".join(path)
    attr = re.compile(rf"\.{re.escape(name)}\b")
    key = re.compile(rf"""["']{re.escape(name)}["']""")
    parent_read = re.compile(rf"""\.{re.escape(parent)}\b|["']{re.escape(parent)}["']""") if parent else None
    for text in sources.values():
        if dotted in text:
            return True
        if parent_read is None or parent_read.search(text):
            if attr.search(text) or key.search(text):
                return True
    return False


def test_every_schema_key_is_read_by_the_code_that_acts_on_it():
    sources = _sources()
    unread = [".".join(p) for p in schema_keys() if ".".join(p) not in ALLOWED and not _is_read(p, sources)]
    assert not unread, ("config keys accepted by the schema but read nowhere in apr/ (make them work, or "
                        f"refuse them at validate; ALLOWED needs a reason): {unread}")


def test_the_check_finds_an_unread_key():
    sources = _sources()
    assert not _is_read(("monitoring", "terminal", "no_such_key_anywhere"), sources)
    assert _is_read(("monitoring", "terminal", "refresh_rate"), sources)


def test_allowlisted_keys_exist():
    keys = {".".join(p) for p in schema_keys()}
    assert set(ALLOWED) <= keys


def test_values_no_code_acts_on_are_refused_at_their_line(tmp_path):
    from apr.config import load_config
    from apr.errors import AprError

    shipped = (ROOT / "configs/train/pretrain-350m-v2.yaml").read_text()
    bad = (shipped.replace('metrics: ["loss", "learning_rate", "gradient_norm"]', 'metrics: ["loss", "perplexity"]')
           .replace('type: "loss_curve"', 'type: "histogram"').replace('metric: "loss"', 'metric: "lr"')
           .replace('"temperature", "power"]', '"temperature", "fan_speed"]'))
    path = tmp_path / "cfg.yaml"
    path.write_text(bad)
    try:
        load_config(path)
    except AprError as err:
        found = {f.path: f for f in err.findings}
    else:
        raise AssertionError("accepted")
    assert set(found) == {"monitoring.terminal.metrics[1]", "monitoring.terminal.charts[0].type",
                          "monitoring.terminal.charts[0].metric", "monitoring.system.metrics[3]"}
    assert all(f.line and f.file == str(path) for f in found.values())
    assert "'epoch'" in found["monitoring.terminal.metrics[1]"].expected
