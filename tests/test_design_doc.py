"""docs/design.md: every pointer to it from code, docs and contracts names a section that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# docs/design.md, "The buffer plan"   (docs/design.md, "The engines" and "Execution policy")
POINTER = re.compile(r'docs/design\.md[,\s(]+"([^"]+)"(?:\s+and\s+"([^"]+)")?')
HEADING = re.compile(r"^## (?:\d+\. )?(.+?)\s*$", re.M)


def sections(text: str) -> set[str]:
    return set(HEADING.findall(text))


def pointers(root: Path) -> list[tuple[Path, str]]:
    found = []
    files = [*root.glob("apr/**/*.py"), *root.glob("benchmarks/*.py"), *root.glob("tests/**/*.py"),
             *root.glob("docs/*.md"), *root.glob("contracts/*.yaml"), root / "README.md"]
    for path in files:
        if path.is_file():
            for match in POINTER.finditer(path.read_text()):
                # a name wrapped across lines (of a docstring or a # comment) is read as one line
                found += [(path, re.sub(r"\s*\n\s*#?\s*", " ", name)) for name in match.groups() if name]
    return found


def test_every_pointer_names_a_section():
    names = sections((ROOT / "docs/design.md").read_text())
    refs = pointers(ROOT)
    assert len(refs) >= 10  # the code does point here
    missing = [f"{p.relative_to(ROOT)}: {name!r}" for p, name in refs if name not in names]
    assert missing == [], f"sections of docs/design.md: {sorted(names)}"


def test_no_pointer_to_the_old_numbered_decisions():
    stale = [str(p.relative_to(ROOT)) for p in [*ROOT.glob("apr/**/*.py"), *ROOT.glob("docs/*.md")]
             if "DESIGN.md decision" in p.read_text()]
    assert stale == []


def test_a_pointer_to_a_missing_section_is_caught(tmp_path):
    (tmp_path / "apr").mkdir()
    (tmp_path / "apr/x.py").write_text('"""See (docs/design.md,\n"The engines" and "Warp drive")."""\n')
    refs = pointers(tmp_path)
    assert [name for _, name in refs] == ["The engines", "Warp drive"]
    assert "Warp drive" not in sections("## 7. The engines\n## 8. Kernels\n")
