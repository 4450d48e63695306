"""The recorder interface of the run loop: RunRecorder and NullRecorder implement all of it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import apr
from apr.track.protocol import NullRecorder, Recorder
from apr.track.recorder import RunRecorder

PROTOCOL_METHODS = sorted(name for name, value in vars(Recorder).items()
                          if callable(value) and not name.startswith("_"))


def test_the_protocol_lists_what_the_loop_calls():
    """Every ``recorder.NAME(`` call in the package is a protocol method (a rank other than 0 holds a
    NullRecorder: a method missing there fails that rank only, e.g. flush during a rollback)."""
    called = {m for path in Path(apr.__file__).parent.rglob("*.py")
              for m in re.findall(r"\brecorder\.([a-z_]+)\(", path.read_text())}
    assert "flush" in called and "log_step" in called
    assert called <= set(PROTOCOL_METHODS), called - set(PROTOCOL_METHODS)
    assert isinstance(vars(Recorder)["warnings"], property)


@pytest.mark.parametrize("cls", [RunRecorder, NullRecorder])
@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_each_recorder_implements_each_method_with_the_same_parameters(cls, name):
    method = getattr(cls, name, None)
    assert callable(method), f"{cls.__name__} has no {name}()"
    want = inspect.signature(getattr(Recorder, name))
    got = inspect.signature(method)
    assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in want.parameters.values()], f"{cls.__name__}.{name}{got} != {want}"


@pytest.mark.parametrize("cls", [RunRecorder, NullRecorder])
def test_each_recorder_has_the_warnings_property(cls):
    assert isinstance(inspect.getattr_static(cls, "warnings"), property)


def test_the_null_recorder_records_nothing_and_keeps_the_run_id():
    rec = NullRecorder("run-7")
    assert isinstance(rec, Recorder)
    rec.start(resume_step=3)
    rec.log_step(4, {"loss": 1.0})
    assert rec.run_id == "run-7" and rec.warnings == [] and rec.check_alerts({"loss": 1e9}) == []
    assert NullRecorder(None).run_id == "rank-local"


def test_a_run_recorder_is_a_recorder(recorder_factory):
    assert isinstance(recorder_factory(), Recorder)
