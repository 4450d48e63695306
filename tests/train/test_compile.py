"""training.execution.compile: compiled blocks train like eager ones; a machine that cannot compile
is refused before any step with an error naming the key."""

from __future__ import annotations

import pytest
import torch

from apr.errors import AprError
from apr.steps.execution import compile_problem
from apr.steps.resolved import resolve as plan_of
from apr.train import compile as compile_mod
from apr.train.build import build_engine
from tests.train.tiny import batches, make_config


def _config(compile: bool, activations: str = "keep", gradients: str = "kept"):
    return make_config(training={"execution": {"activations": activations, "gradients": gradients,
                                               "compile": compile}})


@pytest.mark.slow
@pytest.mark.parametrize("activations,gradients", [("keep", "kept"), ("recompute", "workspace")])
def test_compiled_blocks_train_the_same_weights_as_eager_ones(activations, gradients):
    if compile_problem("cpu") is not None:
        pytest.skip(compile_problem("cpu"))
    results = []
    for compiled in (False, True):
        config = _config(compiled, activations, gradients)
        engine = build_engine(plan_of(config))
        layer = engine.model.model.layers[0]
        assert (type(layer).__name__ == "OptimizedModule" or getattr(layer, "_compiled_call_impl", None)
                is not None) == compiled
        data = batches(config, 3)
        losses = [engine.train_step([b], lr=1e-2).loss.item() for b in data]
        results.append((losses, {k: v.clone() for k, v in engine.train_state_tensors().items()}))
    (eager_losses, eager), (comp_losses, comp) = results
    assert comp_losses == pytest.approx(eager_losses, rel=1e-5)
    initial = build_engine(plan_of(_config(False))).train_state_tensors()
    for name, tensor in eager.items():
        if name.startswith("optimizer."):
            continue
        # fused kernels round differently, and AdamW's m / sqrt(v) magnifies that where gradients are
        # ~0: close relative to what the 3 steps moved, not bitwise
        moved = (tensor - initial[name]).norm()
        assert (comp[name] - tensor).norm() <= 1e-3 * moved, name


def test_no_compiler_is_refused_when_the_engine_is_built(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(AprError) as err:
        build_engine(plan_of(_config(True)))
    message = str(err.value)
    assert "training.execution.compile" in message and "no C++ compiler" in message
    assert "compile: false" in message


def test_a_compile_failure_is_a_clean_error_before_any_step(monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("inductor: the C++ compile failed\nlong log ...")

    monkeypatch.setattr(compile_mod, "compile_problem", lambda device_type: None)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: setattr(self, "forward", broken.__get__(self)))
    with pytest.raises(AprError) as err:
        build_engine(plan_of(_config(True)))
    assert "torch.compile failed on this machine: RuntimeError: inductor: the C++ compile failed" in str(err.value)
    assert "long log" not in str(err.value)


def test_validate_and_plan_refuse_compile_without_a_compiler_at_its_line(tmp_path, monkeypatch):
    from apr.config import load_config
    from apr.plan.validate import config_findings
    from tests.plan.plan_helpers import plan_for

    example = {"config": {"training": {"execution": {"compile": True}}}}
    if compile_problem("cpu") is None:  # this machine has inductor's compiler: nothing to say
        plan = plan_for(example, tmp_path / "ok")
        assert not [f for f in plan.findings if f.path == "training.execution.compile"]

    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    plan = plan_for(example, tmp_path / "bad")
    found = [f for f in plan.findings if f.path == "training.execution.compile"]
    assert len(found) == 1 and found[0].severity == "error"
    assert "no-such-compiler-xyz is not on PATH" in found[0].message and found[0].line is not None
    validate = config_findings(load_config(plan.config_path))
    assert [f.message for f in validate if f.path == "training.execution.compile"] == [found[0].message]


def test_compiling_points_inductor_at_the_apr_home_cache_unless_the_user_chose_one(tmp_path, monkeypatch):
    monkeypatch.setenv("APR_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compile_mod.use_compile_cache() == str(tmp_path / "home" / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_mod.use_compile_cache() == str(tmp_path / "mine")
