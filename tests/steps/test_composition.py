"""The feature x layout matrix (apr/steps/composition.py) is what docs/design.md shows, has a cell on
every layout, and names only node ids pytest collects, on their layout."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

from apr.steps.composition import FEATURES, LAYOUT_PARAMS, LAYOUTS, node_ids, table_markdown

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- composition table:[^\n]*-->\n(.*?)\n<!-- end composition table -->", re.S)


def test_the_design_doc_table_is_generated_from_the_matrix():
    found = BLOCK.search((ROOT / "docs/design.md").read_text())
    assert found is not None, "docs/design.md lost its generated composition table"
    assert found.group(1) == table_markdown(), "regenerate it: python -m apr.steps.composition"


def test_every_feature_has_one_cell_per_layout_tested_refused_or_not_tested():
    for feature in FEATURES:
        assert set(feature.cells) == set(LAYOUTS), feature.name
        for layout, cell in feature.cells.items():
            kinds = [bool(cell.tests), cell.refused is not None, cell.not_tested is not None]
            assert sum(kinds) == 1, (feature.name, layout)


@functools.cache
def _collected_all() -> tuple[str, ...]:
    """Every node id of the files the matrix names, collected once per process (one pytest run)."""
    return tuple(_collected(sorted({node.split("::")[0] for _, _, node in node_ids()})))


def _collected(files: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", *files], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line]


def test_every_named_node_id_is_collected_on_its_layout():
    named = node_ids()
    collected = _collected_all()
    missing, off_layout = [], []
    for feature, layout, node in named:
        runs = [c for c in collected if c == node or c.startswith(node + "[")]
        if not runs:
            missing.append(f"{feature} / {layout}: {node}")
            continue
        words = LAYOUT_PARAMS.get(layout)
        if words is None:
            continue
        for run in runs:  # every parametrisation the cell names shows its layout
            params = re.split(r"[-\[\]]", run.split("::", 1)[1])
            if not any(w in params for w in words):
                off_layout.append(f"{feature} / {layout}: {run}")
    assert missing == [] and off_layout == []


def test_a_cell_naming_a_missing_test_or_another_layout_is_caught():
    """The checker itself: a node id that is not collected, and one whose params name another layout."""
    collected = _collected_all()
    assert not [c for c in collected if c.startswith("tests/scenarios/test_composition.py::test_no_such_test")]
    full = "tests/scenarios/test_composition.py::test_compiled_blocks_on_shards_equal_one_process[full]"
    assert full in collected
    params = re.split(r"[-\[\]]", full.split("::", 1)[1])
    assert not any(w in params for w in LAYOUT_PARAMS["hybrid"])
