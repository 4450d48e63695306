"""Typed errors and findings shared by every stage. Library code raises; only apr/cli prints."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """One problem (or observation) about an input, located as precisely as we can."""

    severity: str  # "error" | "warning" | "info"
    code: str  # e.g. "schema.unknown_key" or a contract id such as "C-TRAINCFG-001"
    message: str
    path: str = ""  # dotted key path, e.g. "training.warmup_steps"
    file: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    expected: str | None = None
    got: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class AprError(Exception):
    """An error a user can fix. Carries findings; the CLI renders them and exits 1."""

    exit_code = 1

    def __init__(self, message: str, findings: list[Finding] | tuple[Finding, ...] = ()):
        super().__init__(message)
        self.message = message
        self.findings = list(findings)


class ConfigError(AprError):
    """The config file is missing, unreadable, not YAML, or does not match the schema."""
