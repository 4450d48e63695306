"""The import rule of docs/design.md ("Layers"): a package imports only packages in lower layers;
packages in one layer (plan and train above all) never import each other; `apr train validate`
never loads torch or apr.train."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

# Lowest first. "apr" is the package root (apr/__init__.py: the version). A new package or
# top-level module goes in the lowest layer above everything it imports.
LAYERS: list[set[str]] = [
    {"apr", "errors"},
    {"fmt", "fsutil", "rate", "resources", "cel", "readers", "hardware", "threads", "launch", "severity",
     "quoting"},  # quoting: what an error may quote of a file (stdlib only)
    {"config"},
    {"steps", "steer"},  # torch-free step algebra, step strategy, LR schedules; steer requests (apr train steer)
    {"data", "kernels", "track"},
    {"model"},
    {"memory"},  # the memory model (torch-free): declared buffers, modelled activations, the plan's table
    {"checkpoint"},
    {"generate"},  # loading a model for inference, KV-cache decoding, sampling
    {"evaluate", "inspect"},  # loss over shards, multiple-choice scoring; weight/update/attention views
    {"plan", "train", "monitor"},
    # plan-then-apply, the plan's probe (the real engine), sweeps (plan, then apply processes), apr
    # profile, the plan's trace (its engine on fake tensors): above both plan and train
    {"apply", "probe", "sweep", "profile", "trace"},
    # the LR range test: runs apply on a throwaway copy; fork: apply from a checkpoint; api: Trainer / load_model
    {"lrfind", "fork", "api"},
    {"cli"},
    {"__main__"},
]

ROOT = Path(__file__).resolve().parents[1]

# A moved module whose old path re-exports the new one until its last importers switch: (old module,
# what it may import). None now (apr/model/buffers.py -> apr/memory/buffers.py is done).
REEXPORTS: set[tuple[str, str]] = set()


def unit_of(module: str) -> str:
    """``apr.plan.facts`` -> ``plan``; ``apr`` -> ``apr``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def module_name(path: Path, package_root: Path) -> str:
    parts = list(path.relative_to(package_root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package_root: Path) -> list[tuple[str, int]]:
    """Every ``apr`` module ``path`` imports (function-local and TYPE_CHECKING ones too), with its line."""
    name = module_name(path, package_root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            if target == "apr":  # from apr import plan
                found += [(f"apr.{a.name}", node.lineno) for a in node.names
                          if (package_root / a.name).is_dir() or (package_root / f"{a.name}.py").is_file()]
    return [(t, line) for t, line in found if t == "apr" or t.startswith("apr.")]


def layer_violations(package_root: Path, layers: list[set[str]], reexports: set = frozenset()) -> list[str]:
    """One line per import that breaks the rule (but a ``reexports`` pair); an unlisted package is a
    violation too."""
    rank = {unit: i for i, layer in enumerate(layers) for unit in layer}
    problems, unplaced = [], set()
    for path in sorted(package_root.rglob("*.py")):
        src = unit_of(module_name(path, package_root))
        if src not in rank:
            if src not in unplaced:
                unplaced.add(src)
                problems.append(f"{path}: package {src!r} has no layer: add it to LAYERS in tests/test_layers.py "
                                "and to docs/design.md")
            continue
        for target, line in imports_of(path, package_root):
            dst = unit_of(target)
            if dst == src or dst not in rank or (module_name(path, package_root), target) in reexports:
                continue
            if rank[dst] > rank[src]:
                problems.append(f"{path}:{line}: {src} imports {target}, a higher layer")
            elif rank[dst] == rank[src] and src != "apr" and dst != "apr":
                problems.append(f"{path}:{line}: {src} imports {target}, a sibling in the same layer")
    return problems


def test_apr_follows_the_layers():
    assert layer_violations(ROOT / "apr", LAYERS, REEXPORTS) == []


def test_every_layer_is_a_real_package():
    for unit in set().union(*LAYERS) - {"apr"}:
        assert (ROOT / "apr" / unit).is_dir() or (ROOT / "apr" / f"{unit}.py").is_file(), unit


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / "apr" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path / "apr"


@pytest.mark.parametrize("source", [
    "from apr.train.engine import Engine\n",
    "import apr.train.run\n",
    "from apr import train\n",
    "def f():\n    from ..train import engine\n",
])
def test_the_check_catches_plan_importing_train_in_any_spelling(tmp_path, source):
    root = _tree(tmp_path, {"__init__.py": "", "plan/__init__.py": "", "plan/facts.py": source,
                            "train/__init__.py": "", "train/engine.py": "", "train/run.py": ""})
    problems = layer_violations(root, LAYERS)
    assert len(problems) == 1 and "plan imports apr.train" in problems[0] and "sibling" in problems[0]
    assert "facts.py:" in problems[0]


def test_the_check_catches_an_upward_import_and_an_unlisted_package(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "steps/__init__.py": "",
                            "steps/algebra.py": "import os\n\nfrom apr.model.spec import param_count\n",
                            "model/__init__.py": "", "model/spec.py": "from apr.steps import algebra\n",
                            "newpkg/__init__.py": ""})
    problems = layer_violations(root, LAYERS)
    assert any("algebra.py:3: steps imports apr.model.spec, a higher layer" in p for p in problems)
    assert any("'newpkg' has no layer" in p for p in problems)
    assert len(problems) == 2  # model -> steps is downward: allowed


def test_validate_loads_neither_torch_nor_the_trainer(repo, tmp_path):
    probe = (
        "import sys; from apr.cli.entry import run; sys.argv = ['apr', 'train', 'validate', sys.argv[1]]\n"
        "try:\n    run()\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "heavy = ('torch', 'apr.train', 'apr.apply')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "print('LOADED', loaded, 'STEPS', 'apr.steps.strategy' in sys.modules, 'EXIT', code)\n"
    )
    for cfg in ("demo-tiny.yaml", "pretrain-350m-v2.yaml"):
        out = subprocess.run([sys.executable, "-c", probe, str(repo / "configs/train" / cfg)],
                             capture_output=True, text=True, cwd=tmp_path)
        # validate reads the step strategy (facts.execution) from apr.steps, not from apr.train
        assert "LOADED [] STEPS True EXIT 0" in out.stdout, out.stdout + out.stderr


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """Module -> the apr modules it imports (function-local and TYPE_CHECKING ones too), each named
    by the module that defines it (``from apr.config import X`` is ``apr.config``)."""
    modules = {module_name(p, package_root): p for p in sorted(package_root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for target, _line in imports_of(path, package_root):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # a package's own __init__
                deps.add(target)
        graph[name] = deps
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_module_of_apr_imports_itself_through_others():
    assert import_circles(import_graph(ROOT / "apr")) == []


def test_the_circle_check_finds_a_circle_through_a_lazy_import(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "train/__init__.py": "",
                            "train/engine.py": "import apr.train.run\n",
                            "train/stop.py": "from apr.train.engine import x\n",
                            "train/run.py": "def f():\n    from apr.train.stop import y\n"})
    assert import_circles(import_graph(root)) == [["apr.train.engine", "apr.train.run", "apr.train.stop"]]


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_the_trainer_reads_in_short_pieces():
    """docs/design.md, "The composed engine": no function in apr/train/ over 60 lines, and the run
    loop's class under 300 (it composes components; it does not hold them)."""
    long = [f"{p.name}:{n.lineno} {n.name} ({size} lines)" for p in sorted((ROOT / "apr" / "train").glob("*.py"))
            for n, size in _functions(p) if not isinstance(n, ast.ClassDef) and size > 60]
    assert long == []
    run = {n.name: size for n, size in _functions(ROOT / "apr" / "train" / "run.py") if isinstance(n, ast.ClassDef)}
    assert run["Run"] < 300
