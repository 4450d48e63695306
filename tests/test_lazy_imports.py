"""Imports sit at the top of their module unless being lazy buys something (issue 13 item 8).

A function-local import is kept only where importing at the top would load a heavy third-party
package (torch, numpy, pydantic, textual, ...) that the module does not load already — so that
`apr train validate`, `apr train plan`, `apr runs ls` and `apr --help` stay fast and torch-free — or
where the top-level import would close an import cycle. Everything else (the standard library,
apr modules that are no heavier than the importer) belongs at the top. Computed statically from the
modules' top-level imports; an import line may say why it must stay anyway with ``# lazy: REASON``.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "numpy", "pyarrow", "textual", "transformers", "tokenizers", "safetensors", "cupy", "peft",
         "sqlite_utils", "plotext", "pydantic", "pydantic_core", "typer", "click", "rich", "ruamel", "celpy",
         "cel", "huggingface_hub", "pexpect", "tensorboard", "mlflow", "wandb", "textual_serve", "optuna",
         "sqlalchemy"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "apr").rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node, module: str) -> list[str]:
    """The modules an import statement loads (apr modules, with their parent packages, or top-level
    third-party names)."""
    is_pkg = MODULES[module].name == "__init__.py"
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = _resolve(node, module, is_pkg)
        names = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
    out = []
    for name in names:
        if name.split(".")[0] == "apr":
            parts = name.split(".")
            out += [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES]
        else:
            out.append(name.split(".")[0])
    return out


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


@cache
def _top_imports(module: str) -> frozenset[str]:
    tree = ast.parse(MODULES[module].read_text())
    found: list[str] = []

    def visit(stmts):
        for st in stmts:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                found.extend(_targets(st, module))
            elif isinstance(st, (ast.If, ast.Try)) and not _is_type_checking(st):
                for block in (getattr(st, "body", []), getattr(st, "orelse", []), getattr(st, "finalbody", []),
                              *[h.body for h in getattr(st, "handlers", [])]):
                    visit(block)

    visit(tree.body)
    return frozenset(found)


@cache
def _closure(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(apr modules, heavy third-party packages) that importing ``module`` loads."""
    seen, heavy, stack = {module}, set(), [module]
    while stack:
        for dep in _top_imports(stack.pop()):
            if dep in MODULES:
                if dep not in seen:
                    seen.add(dep)
                    stack.append(dep)
            elif dep in HEAVY:
                heavy.add(dep)
    return frozenset(seen), frozenset(heavy)


def unjustified_local_imports(only: str | None = None) -> list[str]:
    problems: list[str] = []
    for module, path in sorted(MODULES.items()):
        if only is not None and module != only:
            continue
        text = path.read_text()
        lines = text.splitlines()
        _, own_heavy = _closure(module)
        tree = ast.parse(text)
        guarded = {n.lineno for t in ast.walk(tree) if isinstance(t, ast.Try)  # optional: try/except ImportError
                   and any(h.type is None or "ImportError" in ast.unparse(h.type) for h in t.handlers)
                   for b in t.body for n in ast.walk(b) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for st in ast.walk(fn):
                if not isinstance(st, (ast.Import, ast.ImportFrom)) or "# lazy:" in lines[st.lineno - 1]:
                    continue
                if st.lineno in guarded:
                    continue
                if isinstance(st, ast.ImportFrom) and st.module == "__future__":
                    continue
                reasons = []
                for dep in _targets(st, module):
                    if dep in MODULES:
                        reach, heavy = _closure(dep)
                        if heavy - own_heavy:
                            reasons.append(f"{dep} loads {sorted(heavy - own_heavy)}")
                        if module in reach:
                            reasons.append(f"{dep} imports {module}: a cycle")
                    elif dep in HEAVY and dep not in own_heavy:
                        reasons.append(f"{dep} is heavy")
                    elif dep not in sys.stdlib_module_names and dep not in HEAVY and dep != "apr":
                        reasons.append(f"{dep}: an optional or third-party package")
                entry = f"{module}:{st.lineno}: {ast.unparse(st)}"
                if not reasons and entry not in problems:  # an import in a nested function is walked twice
                    problems.append(entry)
    return problems


def test_function_local_imports_are_only_where_being_lazy_keeps_a_heavy_package_or_a_cycle_away():
    problems = unjustified_local_imports()
    assert not problems, "move these imports to the top of their module:\n" + "\n".join(problems)


def test_the_check_flags_a_needless_local_import_and_accepts_a_lazy_heavy_one(tmp_path, monkeypatch):
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    import json\n    import torch\n    from apr.train import engine\n"
                    "    from apr.fsutil import atomic_path\n    return json, torch, engine\n")
    monkeypatch.setitem(MODULES, "apr.fake", fake)
    try:
        assert unjustified_local_imports(only="apr.fake") == [
            "apr.fake:2: import json", "apr.fake:5: from apr.fsutil import atomic_path"]
    finally:
        _top_imports.cache_clear()
        _closure.cache_clear()


# What `apr train validate CONFIG` may load (docs/performance.md, "apr train validate"): the schema, the
# config-only facts and contracts, and the CLI's rendering; never the plan's data, tokenizer, storage,
# checkpoint or calibration modules, nor a heavy package. A new import on this path must be added here
# on purpose (and measured: validate runs in CI on every push).
VALIDATE_APR_MODULES = {
    "apr", "apr.cel", "apr.cli", "apr.cli.cmd_runs", "apr.cli.cmd_train_validate", "apr.cli.entry",
    "apr.cli.ghactions", "apr.cli.render", "apr.cli.table", "apr.config", "apr.config.layers",
    "apr.config.loader", "apr.config.numbers", "apr.config.paths", "apr.config.schema", "apr.config.yamlfile",
    "apr.errors", "apr.fmt", "apr.severity",
    "apr.memory", "apr.memory.activations", "apr.memory.buffers", "apr.memory.table",  # the memory model
    "apr.memory.canonical",  # canonical reduction's bytes (a row of the memory table; stdlib only)
    "apr.fsutil", "apr.hardware", "apr.model", "apr.model.spec", "apr.plan", "apr.plan.configfacts",
    "apr.plan.contracts", "apr.plan.gpus", "apr.plan.memory", "apr.plan.validate", "apr.readers", "apr.resources",
    "apr.config.auto",  # the auto layout keys taken out before the schema (config-only)
    "apr.config.hf_folder",  # model.init_from's architecture from a Hugging Face folder (stdlib only)
    "apr.quoting",  # what an error may quote of a file (every reader's error rendering)
    "apr.steps", "apr.steps.algebra", "apr.steps.execution", "apr.steps.strategy", "apr.track", "apr.track.alerts",
    "apr.steps.stacking",
    "apr.track.state",
    "apr.plan.orchestratefacts", "apr.steps.orchestration",  # training.orchestrator's checks (torch-free)
    "apr.plan.reductionfacts",  # training.reduction: canonical's checks and cost (torch-free)
}
VALIDATE_PACKAGES = {"pydantic", "pydantic_core", "annotated_types", "typing_extensions", "typing_inspection",
                     "ruamel", "cel"}
NEVER_ON_VALIDATE = {"apr.plan.facts", "apr.plan.storage", "apr.track.trackers", "apr.plan.datafacts",
                     "apr.plan.distillfacts",
                     "apr.plan.mixfacts", "apr.plan.build", "apr.track.calibration", "apr.track.store", "sqlite3",
                     "typer", "click", "rich", *HEAVY - {"pydantic", "pydantic_core", "ruamel", "cel"},
                     # pydantic's plugin loader and what it imports (apr.cli.entry stands in for it)
                     "importlib.metadata", "email", "zipfile", "socket"}


def _modules_of_a_validate_run(config: Path) -> tuple[set[str], set[str]]:
    import json
    import subprocess

    probe = ("import json, sys\nfrom apr.cli.entry import run\nsys.argv = ['apr', 'train', 'validate', sys.argv[1]]\n"
             "try:\n    run()\nexcept SystemExit:\n    pass\n"
             "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", probe, str(config)], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    third_party = {m.split(".")[0] for m in loaded if not m.startswith(("_", "apr"))} - set(sys.stdlib_module_names)
    return loaded, third_party


def test_a_validate_run_imports_only_the_config_only_modules():
    loaded, third_party = _modules_of_a_validate_run(ROOT / "configs/train/pretrain-350m-v2.yaml")
    apr_modules = {m for m in loaded if m == "apr" or m.startswith("apr.")}
    assert apr_modules <= VALIDATE_APR_MODULES, f"new on validate's path: {sorted(apr_modules - VALIDATE_APR_MODULES)}"
    assert third_party <= VALIDATE_PACKAGES, f"packages on validate's path: {sorted(third_party - VALIDATE_PACKAGES)}"
    assert not loaded & NEVER_ON_VALIDATE, sorted(loaded & NEVER_ON_VALIDATE)
    assert {"apr.plan.configfacts", "apr.plan.contracts", "apr.config.schema"} <= apr_modules  # it did validate


_PLUGIN_PROBE = """
import os, sys
from apr.cli.entry import skip_plugin_loader
skip_plugin_loader()
from pydantic import BaseModel
class Off(BaseModel):
    x: int
print(Off(x=1).x, 'importlib.metadata' in sys.modules)
os.environ['PYDANTIC_DISABLE_PLUGINS'] = ''  # plugins back on: the real loader scans entry points
class On(BaseModel):
    y: int
print(On(y=2).y, 'importlib.metadata' in sys.modules, hasattr(sys.modules['pydantic.plugin._loader'], 'entry_points'))
"""


def test_the_plugin_loaders_stand_in_returns_no_plugins_while_they_are_off_and_hands_over_when_they_are_on():
    import os
    import subprocess

    env = {**os.environ, "PYDANTIC_DISABLE_PLUGINS": "__all__"}
    out = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE], capture_output=True, text=True, check=True, env=env,
                         cwd=ROOT)
    assert out.stdout.split("\n")[:2] == ["1 False", "2 True True"], out.stdout + out.stderr


def test_the_plugin_loader_is_left_alone_when_the_user_turns_plugins_on():
    import os
    import subprocess

    probe = ("import sys\nfrom apr.cli.entry import skip_plugin_loader\nskip_plugin_loader()\n"
             "print('pydantic.plugin._loader' in sys.modules)\n")
    env = {**os.environ, "PYDANTIC_DISABLE_PLUGINS": ""}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert out.stdout.strip() == "False"
