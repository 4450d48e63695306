"""``model.init_from`` at plan time: the source's tensors checked against the config's model from
safetensors headers alone (no weights read), its size, the architecture keys taken from a Hugging
Face folder's config.json (an info finding names them), and one finding per problem located at the
config key it concerns (apr/checkpoint/hf_import.py does the reading)."""

from __future__ import annotations

from dataclasses import replace

from apr.checkpoint.hf_import import folder_architecture, inspect_source
from apr.config import LoadedConfig
from apr.errors import Finding


def init_from_check(loaded: LoadedConfig) -> tuple[dict | None, list[Finding]]:
    """(``facts.init_from``, findings), or (None, []) when the config starts from random weights."""
    config = loaded.config
    if config.model.init_from is None:
        return None, []

    src = inspect_source(config.model.init_from, config.model.architecture)
    findings = []
    for f in src.findings:
        key = tuple(f.path.split(".")) if f.path else ("model", "init_from")
        file, line, column = loaded.source.where(key)
        if line is None:
            file, line, column = loaded.source.where(("model", "init_from"))
        # located in the config, at the key to change; the message names the source file it is about
        message = f.message if not f.file or f.file in f.message else f"{f.file}: {f.message}"
        findings.append(replace(f, message=message, file=file, line=line, column=column))
    facts = src.facts()
    taken = _taken_from_folder(loaded)
    if taken is not None:
        facts["architecture_from_folder"] = taken
        shown = ", ".join(f"{k} {_short(v)}" for k, v in taken["keys"].items())
        # at model.architecture when the config has one, else at the key that named the folder
        key = ("model", "architecture") if ("model", "architecture") in loaded.source.positions else (
            "model", "init_from")
        file, line, column = loaded.source.where(key)
        findings.append(Finding("info", "init_from.architecture_from_folder",
                                f"model.architecture from {taken['file']}: {shown}" if shown else
                                f"every model.architecture key is set in the config ({taken['file']} agrees)",
                                path="model.architecture", file=file, line=line, column=column))
    return facts, findings


def _taken_from_folder(loaded: LoadedConfig) -> dict | None:
    """``{"file": config.json, "keys": {key: value}}``: the architecture keys the config left out,
    as its model.init_from folder's config.json gave them (None: not a Hugging Face folder)."""
    found = folder_architecture(loaded.config.model.init_from)
    if found is None or found[1] is None:
        return None
    cfg_path, fields, _ = found
    model = loaded.raw.get("model") if isinstance(loaded.raw, dict) else None
    given = (model or {}).get("architecture") if isinstance(model, dict) else None
    given = given if isinstance(given, dict) else {}
    return {"file": str(cfg_path), "keys": {k: v for k, v in fields.items() if k not in given}}


def _short(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)
