"""The teacher output cache (training.distill.cache_teacher_outputs): a cached phase 1 trains the
student bitwise as an uncached one, cold and warm; a damaged slot is recomputed, never trusted; another
teacher's cache is not used; a full disk turns the cache off and the run goes on."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from apr.config.schema import AprConfig
from apr.steps.resolved import resolve as plan_of
from tests.train import test_distill
from tests.train.run_helpers import make_dataset
from tests.train.test_distill import _student_doc

teacher = test_distill.teacher  # the distillation tests' trained 4-block teacher (a module fixture)


def _phase1(doc: dict, batches: list[torch.Tensor]):
    from apr.train.build import build_engine

    engine = build_engine(plan_of(AprConfig.model_validate(doc)), "cpu")
    for step, batch in enumerate(batches, start=1):
        engine.current_step = step
        engine.train_step([batch], 1e-2)
    return engine


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 61, (4, 17), generator=g)
    return [rows, rows.flip(0), rows, rows]  # phase 1: blocks 0 and 1, 2 steps each, the same rows again


def _warnings(engine) -> list[str]:
    return [message for kind, message, _ in engine.loss.events if kind == "teacher_cache"]


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    make_dataset(tmp_path)
    return tmp_path


def test_a_cached_phase_1_trains_the_student_bitwise_as_an_uncached_one_cold_and_warm(teacher, home):
    plain = _phase1(_student_doc(home, teacher), _batches())
    doc = _student_doc(home, teacher, cache_teacher_outputs=True)
    cold = _phase1(doc, _batches())
    assert cold.loss.cache.count == 4 and cold.loss.cache.hits == 3  # each row computed once, for all blocks
    warm = _phase1(doc, _batches())
    assert warm.loss.cache.misses == 0 and warm.loss.cache.hits == 4  # another run (or a resume) reads it all
    for engine in (cold, warm):
        for k, v in plain.model.state_dict().items():
            assert torch.equal(engine.model.state_dict()[k], v), k
    assert not _warnings(cold) and not _warnings(warm)


def test_a_damaged_cache_is_recomputed_and_another_teachers_is_not_used(teacher, home):
    doc = _student_doc(home, teacher, cache_teacher_outputs=True)
    first = _phase1(doc, _batches()[:1])
    cache = first.loss.cache
    raw = bytearray(cache.data.read_bytes())
    raw[100:108] = b"\0" * 8  # zeros over part of the first row's states
    cache.data.write_bytes(bytes(raw))
    again = _phase1(doc, _batches()[:1])
    assert len(_warnings(again)) == 1 and "do not match the checksum" in _warnings(again)[0]
    for k, v in first.model.state_dict().items():  # trained on the teacher's states, not the damaged ones
        assert torch.equal(again.model.state_dict()[k], v), k
    third = _phase1(doc, _batches()[:1])  # the slot was rewritten: read from the cache, checked good
    assert third.loss.cache.hits == 1 and not _warnings(third)

    from apr.train.teacher_cache import TeacherCache

    meta = json.loads(cache.meta.read_text())
    other = TeacherCache(cache.data.parent, "another-teacher", meta["boundaries"], meta["row_len"], meta["hidden"],
                         0, lambda m: None)
    assert other.data != cache.data and other.count == 0
    assert other.get(_batches()[0][:, :16]) is None  # nothing of the first teacher's is handed out
    cache.meta.write_text(json.dumps({**meta, "teacher": "another-teacher"}))  # a foreign entry under this key
    assert _phase1(doc, _batches()[:1]).loss.cache.hits == 0


def test_a_full_disk_turns_the_cache_off_and_the_run_goes_on(teacher, home, monkeypatch):
    from apr.train.teacher_cache import TeacherCache

    def full(self, key, raw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TeacherCache, "_append", full)
    plain = _phase1(_student_doc(home, teacher), _batches())
    engine = _phase1(_student_doc(home, teacher, cache_teacher_outputs=True), _batches())
    said = _warnings(engine)
    assert len(said) == 1 and "No space left on device" in said[0] and "goes on without it" in said[0]
    for k, v in plain.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[k], v), k


def test_the_plan_shows_the_caches_size_on_disk_and_the_teacher_flops_it_saves(teacher, home):
    from apr.plan.build import build_plan
    from apr.plan.render import render_text

    doc = _student_doc(home, teacher, cache_teacher_outputs=True)
    path = home / "cached.json"
    path.write_text(json.dumps(doc))
    plan = build_plan(path)
    assert not [f for f in plan.findings if f.severity == "error"], plan.findings
    cache = plan.facts["distill"]["teacher_cache"]
    c = AprConfig.model_validate(doc)
    seq, hidden = c.data.seq_len, c.model.architecture.hidden_size
    rows = min(4 * c.data.batch_size, plan.facts["data"]["train"]["sequences"])  # phase 1: 2 blocks x 2 steps
    assert cache["boundaries"] == 3 and cache["rows"] == rows  # teacher blocks 0, 2 and 4's input
    assert cache["bytes"] == rows * (3 * seq * hidden * 4 + 32)
    # uncached: block 0's steps run 2 teacher blocks, block 1's 4; cached each row once through 4
    assert cache["teacher_flops_uncached"] * 4 * rows == cache["teacher_flops_cold"] * 2 * (2 + 4) * c.data.batch_size
    assert "teacher cache: " in render_text(plan)


def test_a_fifo_in_the_cache_folder_turns_the_cache_off_without_blocking(tmp_path):
    import os

    from apr.train.teacher_cache import TeacherCache

    said = []
    first = TeacherCache(tmp_path, "t", [0, 1], 4, 8, 0, said.append)
    first.idx.unlink()
    os.mkfifo(first.idx)
    again = TeacherCache(tmp_path, "t", [0, 1], 4, 8, 0, said.append)
    ids = torch.zeros(2, 4, dtype=torch.int64)
    assert not again.enabled and again.get(ids) is None and "not a regular file" in said[0]
    again.put(ids, torch.zeros(2, 2, 4, 8))  # nothing written, nothing raised
