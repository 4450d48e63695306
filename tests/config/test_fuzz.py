"""Random YAML documents and random mutations of the shipped configs never produce a traceback."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from apr.config import load_config
from apr.config.loader import read_yaml
from apr.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs" / "train").glob("*.yaml"))

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["512K", "1.5M", "10B", "32_768", "fp16", "cosine", "-1", "1e-5"]),
)
keys = st.one_of(st.text(min_size=1, max_size=10), st.sampled_from(
    ["model", "data", "training", "optimizer", "monitoring", "architecture", "hidden_size", "batch_size",
     "seq_len", "alerts", "condition", "lr", "epochs", "train"]))
documents = st.recursive(scalars, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=5)), max_leaves=25)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _validate_file(path: Path) -> None:
    try:
        load_config(path)
    except ConfigError as err:
        assert err.findings, "a ConfigError must carry at least one finding"
        for f in err.findings:
            assert f.severity == "error" and f.message and f.file == str(path)


@SETTINGS
@given(doc=documents)
def test_random_documents_give_findings_not_tracebacks(tmp_path, doc):
    path = tmp_path / "fuzz.yaml"
    with open(path, "w") as f:
        YAML().dump(doc, f)
    _validate_file(path)


@SETTINGS
@given(text=st.text(max_size=200))
def test_random_text_gives_findings_not_tracebacks(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    _validate_file(path)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@SETTINGS
@given(data=st.data())
def test_random_mutations_of_shipped_configs(tmp_path, data):
    source = data.draw(st.sampled_from(SHIPPED))
    doc, _, _ = read_yaml(source)
    paths = [p for p in _paths(doc) if p]
    target = data.draw(st.sampled_from(paths))
    parent = doc
    for part in target[:-1]:
        parent = parent[part]
    action = data.draw(st.sampled_from(["replace", "delete", "rename"]))
    if action == "replace":
        parent[target[-1]] = data.draw(documents)
    elif action == "delete" and isinstance(parent, dict):
        del parent[target[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(keys)] = parent.pop(target[-1])
    path = tmp_path / "cfg.yaml"
    with open(path, "w") as f:
        YAML().dump(doc, f)
    _validate_file(path)
