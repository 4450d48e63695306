"""docs/plan.md documents what the code does: every GPU name, every JSON key, the exit codes."""

from __future__ import annotations

from apr.plan.build import PLAN_KEYS
from apr.plan.gpus import CATALOGUE


def test_plan_doc_lists_the_gpu_catalogue(repo):
    text = (repo / "docs/plan.md").read_text()
    for name, gpu in CATALOGUE.items():
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
        assert row is not None, f"--gpu {name} missing from docs/plan.md"
        assert f"{gpu.vram_bytes / 2**30:.2f} GiB" in row and f"{gpu.mfu:.0%}" in row


def test_plan_doc_lists_every_json_key_and_exit_code(repo):
    text = (repo / "docs/plan.md").read_text()
    for key in PLAN_KEYS:
        assert f"`{key}`" in text, f"JSON key {key} undocumented"
    for code in ("| 0 |", "| 1 |", "| 2 |"):
        assert code in text
    assert "Plan: N passed, W warnings, E errors." in text


def test_plan_doc_shows_the_alb060_case(repo):
    text = (repo / "docs/plan.md").read_text()
    assert "steps_per_epoch = 43" in text and "stops at 6.45e-06" in text
