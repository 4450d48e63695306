"""Plan files: saved atomically, read back, refused when the config or the data changed since."""

from __future__ import annotations

import json
import os

import pytest
from plan_helpers import apr_cli

from apr.config.loader import config_doc_hash
from apr.errors import AprError
from apr.plan.build import build_plan
from apr.plan.examples import materialize, write_shards
from apr.plan.planfile import check_plan_fresh, load_plan_file, save_plan


@pytest.fixture
def saved(tmp_path):
    cfg, _ = materialize({}, tmp_path / "run")
    path = tmp_path / "plan.json"
    save_plan(build_plan(cfg, gpu="4090"), path)
    return cfg, path


def _refusal(doc) -> AprError:
    with pytest.raises(AprError) as info:
        check_plan_fresh(doc)
    return info.value


def test_fresh_plan_returns_the_config_path(saved):
    cfg, path = saved
    doc = load_plan_file(path)
    assert check_plan_fresh(doc) == cfg.resolve()
    assert doc["target"]["gpu"] == "4090" and doc["target"]["vram"] is None  # what apply passes back
    assert {f["role"] for f in doc["data_fingerprint"]["files"]} == {"train", "val", "tokenizer"}
    assert not list(path.parent.glob(".plan.json.*"))  # no temp file left behind


def test_comment_only_edit_keeps_the_plan_fresh(saved):
    cfg, path = saved
    cfg.write_text("# a comment\n" + cfg.read_text())
    assert check_plan_fresh(load_plan_file(path)) == cfg.resolve()


def test_a_plan_made_before_a_key_was_added_is_fresh_but_an_edited_one_is_not(saved):
    """A plan file saved by an earlier apr lacks the keys added since (here data.repeat, with its
    default): not a change. Its stored config must still hash to its config_hash."""
    cfg, path = saved
    doc = load_plan_file(path)
    del doc["config"]["data"]["repeat"], doc["config"]["data"]["stages"]
    doc["config_hash"] = config_doc_hash(doc["config"])
    assert check_plan_fresh(doc) == cfg.resolve()
    doc["config"]["training"]["max_steps"] = 99  # edited without its hash: refused
    assert "the config changed" in _refusal(doc).message


def test_changed_config_is_refused_with_the_keys_that_changed(saved):
    cfg, path = saved
    cfg.write_text(cfg.read_text().replace("max_steps: 20", "max_steps: 30"))
    err = _refusal(load_plan_file(path))
    assert "the config changed (training.max_steps)" in err.message
    f = next(f for f in err.findings if f.code == "plan.stale.config")
    assert f.path == "training.max_steps" and f.expected == "20" and f.got == "30" and f.line is not None


def test_touched_data_file_is_refused(saved):
    cfg, path = saved
    shard = cfg.parent / "train" / "shard-00000.parquet"
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    err = _refusal(load_plan_file(path))
    assert "the data changed (1 changed: " in err.message and f"{shard})" in err.message
    f = err.findings[0]
    assert f.code == "plan.stale.data" and f.file == str(shard) and "modified" in f.message


def _rewrite_keeping_size_and_mtime(path, offset: int):
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_same_size_change_with_mtime_restored_is_refused(saved):
    cfg, path = saved
    shard = cfg.parent / "train" / "shard-00000.parquet"
    _rewrite_keeping_size_and_mtime(shard, shard.stat().st_size // 2)  # a small file is hashed whole
    err = _refusal(load_plan_file(path))
    f = err.findings[0]
    assert f.code == "plan.stale.data" and f.file == str(shard) and "different content" in f.message


def test_large_file_digest_sees_its_footer_and_samples_not_every_byte(tmp_path):
    from apr.readers import DIGEST_HEAD, content_digest

    big = tmp_path / "big.parquet"
    big.write_bytes(bytes(8 * 2**20))
    before = content_digest(big)
    _rewrite_keeping_size_and_mtime(big, big.stat().st_size - 100)  # inside the footer (the tail)
    assert content_digest(big) != before
    changed = content_digest(big)
    _rewrite_keeping_size_and_mtime(big, DIGEST_HEAD + 10)  # between the samples: documented as not seen
    assert content_digest(big) == changed


def test_added_and_removed_data_files_are_refused(saved):
    cfg, path = saved
    write_shards(cfg.parent / "train" / "more", rows=4, row_len=33, max_token=10)
    (cfg.parent / "val" / "shard-00000.parquet").unlink()
    err = _refusal(load_plan_file(path))
    assert "1 added" in err.message and "1 removed" in err.message
    messages = {f.file: f.message for f in err.findings}
    assert messages[str(cfg.parent / "train" / "more" / "shard-00000.parquet")].startswith("added since the plan")
    assert messages[str(cfg.parent / "val" / "shard-00000.parquet")].startswith("removed")


def test_changed_tokenizer_is_refused(saved):
    cfg, path = saved
    tok = cfg.parent / "tokenizer.json"
    tok.write_text(tok.read_text() + " ")
    err = _refusal(load_plan_file(path))
    assert "tokenizer.json" in err.message and "size" in err.findings[0].message


def test_deleted_config_is_a_config_error(saved):
    from apr.errors import ConfigError

    cfg, path = saved
    cfg.unlink()
    with pytest.raises(ConfigError, match="config file not found"):
        check_plan_fresh(load_plan_file(path))


@pytest.mark.parametrize(("content", "needle"), [
    (None, "plan file not found"),
    ("{ not json", "invalid JSON"),
    ("[1, 2]", "is not an apr plan file"),
    ('{"format": "terraform"}', "is not an apr plan file"),
    ('{"format": "apr-plan", "format_version": "99"}', "format version '99'"),
    ('{"format": "apr-plan", "format_version": "1", "config_path": "x"}', "missing config_hash, data_fingerprint"),
])
def test_bad_plan_files_are_clear_errors(tmp_path, content, needle):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AprError) as info:
        load_plan_file(path)
    assert needle in info.value.message and info.value.findings[0].file == str(path)


def test_unwritable_plan_path_is_a_clear_error(saved, tmp_path):
    cfg, _ = saved
    with pytest.raises(AprError, match="cannot write the plan file"):
        save_plan(build_plan(cfg), tmp_path / "no" / "such" / "dir" / "plan.json")


def test_overrides_are_recorded_and_reapplied(saved):
    cfg, _ = saved
    plan = build_plan(cfg, overrides={"max_steps": 10, "seed": 7})
    assert plan.config.training.max_steps == 10 and plan.config.training.seed == 7
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["overrides"] == {"training.max_steps": 10, "training.seed": 7}
    assert check_plan_fresh(doc) == cfg  # the same overrides give the same hash


def test_cli_out_then_stale_detection_end_to_end(saved, tmp_path):
    cfg, _ = saved
    path = tmp_path / "cli-plan.json"
    assert apr_cli("train", "plan", str(cfg), "-out", str(path)).returncode == 0
    doc = json.loads(path.read_text())
    assert doc["format"] == "apr-plan" and check_plan_fresh(doc) == cfg.resolve()
    cfg.write_text(cfg.read_text().replace("batch_size: 2", "batch_size: 1"))
    assert "data.batch_size" in _refusal(load_plan_file(path)).message


def test_hostile_plan_files_are_clear_errors(tmp_path, saved):
    """A FIFO, a huge file, deep nesting and wrong field types: each a clean AprError naming the file."""
    _, good = saved
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(2**31)
    deep = tmp_path / "deep.json"
    deep.write_text('{"format": "apr-plan", "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
    doc = json.loads(good.read_text())
    typed = {}
    for key, value in (("config_path", 5), ("config_hash", ["x"]), ("overrides", "max_steps"),
                       ("data_fingerprint", {"files": [{"path": 1, "size": "big", "mtime_ns": 0}]})):
        typed[key] = tmp_path / f"typed-{key}.json"
        typed[key].write_text(json.dumps({**doc, key: value}))
    cases = [(fifo, "file.not_regular"), (huge, "file.too_large"), (deep, "file.too_deep")] + \
        [(p, "plan.field") for p in typed.values()]
    for path, code in cases:
        with pytest.raises(AprError) as info:
            load_plan_file(path)
        assert info.value.findings[0].code == code and info.value.findings[0].file == str(path), path


def test_a_plan_saved_by_another_apr_version_is_refused_naming_both(saved):
    """Another apr may resolve the same config into another run (issue 46): the saved plan names the
    version that made it, and apply refuses it rather than run what this version would decide."""
    import json

    from apr import __version__

    _, path = saved
    doc = json.loads(path.read_text())
    doc["apr_version"] = "0.0.9"
    path.write_text(json.dumps(doc))
    with pytest.raises(AprError) as info:
        load_plan_file(path)
    err = info.value
    assert "planned by apr 0.0.9" in err.message and f"this is apr {__version__}" in err.message
    (finding,) = err.findings
    assert (finding.code, finding.expected, finding.got) == ("plan.apr_version", __version__, "0.0.9")
