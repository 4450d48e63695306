"""Config-only checks used by `apr train validate`. Must stay free of torch, pyarrow and tokenizers."""

from __future__ import annotations

from apr.config import LoadedConfig
from apr.errors import Finding


def config_findings(loaded: LoadedConfig) -> list[Finding]:
    """Findings of every contract that needs only the config (filled in by the plan issue)."""
    return []
