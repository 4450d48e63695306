"""The study's storage (apr/sweep/storage.py): made in the sweep folder, reopened by the same
sweep, and anything else (corrupt, foreign, another sweep's, unreachable) refused and left as is."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from apr.sweep.spec import SweepError, load_sweep
from apr.sweep.storage import default_url, display_url, open_study

SWEEP = "method: random\nrun_cap: 3\nparameters:\n  optimizer.lr: {min: 0.001, max: %s}\n"


def _spec(tmp_path, high="0.01", name="sweep.yaml"):
    path = tmp_path / name
    path.write_text(SWEEP % high)
    return load_sweep(path)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_same_sweep_reopens_its_study_with_its_trials(tmp_path):
    url = default_url(tmp_path)
    study = open_study(_spec(tmp_path), url)
    trial = study.ask()
    study.tell(trial, 1.5)
    again = open_study(_spec(tmp_path), url)
    assert [t.value for t in again.trials] == [1.5] and (tmp_path / "study.db").is_file()


def test_another_sweep_under_the_same_name_is_refused(tmp_path):
    url = default_url(tmp_path)
    open_study(_spec(tmp_path), url)
    before = _digest(tmp_path / "study.db")
    with pytest.raises(SweepError, match="holds another sweep"):
        open_study(_spec(tmp_path, high="0.02"), url)
    assert _digest(tmp_path / "study.db") == before


@pytest.mark.parametrize("content, words", [
    (b"not a database at all\n" * 10, "not a SQLite database"),
    (b"", "not a SQLite database"),
])
def test_a_corrupt_file_is_refused_and_left_as_it_is(tmp_path, content, words):
    (tmp_path / "study.db").write_bytes(content)
    with pytest.raises(SweepError, match=words) as info:
        open_study(_spec(tmp_path), default_url(tmp_path))
    assert info.value.findings[0].path == "--storage"
    assert (tmp_path / "study.db").read_bytes() == content


def test_a_foreign_database_is_refused_and_left_as_it_is(tmp_path):
    db = tmp_path / "study.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE invoices (id INTEGER, amount REAL)")
    conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    conn.commit()
    conn.close()
    before = _digest(db)
    with pytest.raises(SweepError, match="other tables"):
        open_study(_spec(tmp_path), default_url(tmp_path))
    assert _digest(db) == before


@pytest.mark.parametrize("url", ["sqlite:////no/such/folder/study.db", "nosuchdb://host/x",
                                 "postgresql://user:secret@127.0.0.1:1/db"])
def test_a_storage_that_cannot_be_opened_is_refused_without_its_password(tmp_path, url):
    with pytest.raises(SweepError) as info:
        open_study(_spec(tmp_path), url)
    assert "secret" not in info.value.message and info.value.findings[0].path == "--storage"


def test_display_url_hides_the_password():
    assert display_url("postgresql://me:pw@db.example/optuna") == "postgresql://me:***@db.example/optuna"
    assert display_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
