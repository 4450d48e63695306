"""A feature check's error at its key (apr/plan/keyfacts.py): the file, line and column the key was read
from, or, for a key the file leaves at its default, its nearest stated section's."""

from __future__ import annotations

from apr.config.loader import load_config
from apr.plan.examples import to_yaml
from apr.plan.keyfacts import key_error
from tests.train.tiny import make_config


def test_an_error_points_at_its_key_or_at_the_section_that_holds_its_default(tmp_path):
    doc = make_config().model_dump(mode="json")
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(doc))
    loaded = load_config(path)
    lines = path.read_text().splitlines()
    stated = key_error(loaded, ("training", "seed"), "m", "e", "g", code="config.test")
    assert stated.code == "config.test" and stated.file == str(path) and stated.path == "training.seed"
    assert lines[stated.line - 1].strip().startswith("seed:")
    doc["training"].pop("seed")
    path.write_text(to_yaml(doc))
    default = key_error(load_config(path), ("training", "seed"), "m", "e", "g", code="config.test")
    assert default.path == "training.seed" and path.read_text().splitlines()[default.line - 1].startswith("training:")
