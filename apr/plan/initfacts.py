"""``model.init_from`` at plan time: the source's tensors checked against the config's model from
safetensors headers alone (no weights read), its size, and one finding per problem located at the
config key it concerns (apr/checkpoint/hf_import.py does the reading)."""

from __future__ import annotations

from dataclasses import replace

from apr.checkpoint.hf_import import inspect_source
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
    return src.facts(), findings
