from pathlib import Path

import pytest

from apr.errors import AprError
from apr.track.names import (
    apr_home,
    experiment_from_dir,
    global_db_path,
    local_db_path,
    new_run_id,
    validate_experiment,
    validate_run_id,
)


@pytest.mark.parametrize(
    "bad",
    ["", "../etc", "a/b", "a\\b", "..", ".hidden", "-rf", "x..y", "a b", "a;rm", "é", "x" * 129, "a\nb", "a%"],
)
def test_unsafe_run_ids_are_refused_with_a_finding(bad):
    with pytest.raises(AprError) as e:
        validate_run_id(bad)
    assert e.value.findings[0].code == "track.invalid_run_id"
    with pytest.raises(AprError):
        validate_experiment(bad)


@pytest.mark.parametrize("good", ["20261122-153012-a1b2c3", "run_1", "v2.lr-3e-4", "A" * 128])
def test_safe_names_pass_unchanged(good):
    assert validate_run_id(good) == good
    assert validate_experiment(good) == good


def test_new_run_ids_are_valid_unique_and_sort_by_time():
    ids = {new_run_id() for _ in range(200)}
    assert len(ids) == 200
    for i in ids:
        validate_run_id(i)
    assert new_run_id(now=0.0) < new_run_id(now=1e9)
    assert new_run_id(now=0.0).startswith("19700101-000000-")


def test_experiment_from_dir_is_always_a_valid_name(tmp_path):
    for name in ["my run (v2)", "...", "ok-name", "a..b"]:
        exp = experiment_from_dir(tmp_path / name)
        assert validate_experiment(exp) == exp
    assert experiment_from_dir(tmp_path / "my run (v2)") == "my-run-v2"
    assert experiment_from_dir(tmp_path / "...") == "default"


def test_apr_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("APR_HOME", str(tmp_path / "h"))
    assert apr_home() == tmp_path / "h"
    assert global_db_path() == tmp_path / "h" / "experiments.db"
    monkeypatch.delenv("APR_HOME")
    assert apr_home() == Path.home() / ".apr"
    assert local_db_path(tmp_path) == tmp_path / ".apr" / "experiments.db"


def test_the_compile_cache_lives_in_apr_home_unless_inductor_is_told_otherwise(tmp_path, monkeypatch):
    from apr.track.names import compile_cache_dir, compile_cache_warm

    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = compile_cache_dir()
    assert folder == tmp_path / "home" / "cache" / "inductor" and not compile_cache_warm()
    folder.mkdir(parents=True)
    assert not compile_cache_warm()  # an empty folder: a first compile still pays the cold cost
    (folder / "fxgraph" / "ab").mkdir(parents=True)
    (folder / "locks").mkdir()
    assert not compile_cache_warm()  # folders and locks, no compiled graph: still cold
    (folder / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    assert compile_cache_warm()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"
