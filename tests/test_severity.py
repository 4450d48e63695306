"""apr/severity.py: a record's severity from its own field or its older action, and counts."""

from __future__ import annotations

from apr.severity import action_of, count_by_severity, severity_of


def test_severity_of_records_old_and_new():
    assert severity_of("critical", "stop") == "critical"
    assert severity_of(None, "stop") == "error" and severity_of(None, "warn") == "warning"
    assert severity_of(None, None) == "warning" and severity_of("bogus", None) == "warning"
    assert [action_of(s) for s in ("critical", "error", "warning", "info")] == ["stop", "stop", "warn", "warn"]


def test_counts_cover_every_severity_in_order():
    counts = count_by_severity([{"severity": "info"}, {"action": "stop"}, {"severity": "error"}, {}])
    assert list(counts) == ["critical", "error", "warning", "info"]
    assert counts == {"critical": 0, "error": 2, "warning": 1, "info": 1}
