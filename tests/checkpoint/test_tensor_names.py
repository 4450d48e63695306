"""apr/checkpoint/names.py: the checkpoint's tensor names and the one model check."""

from __future__ import annotations

import pytest
import torch

from apr.checkpoint.names import expected_tensors, is_optimizer_state, moment_names, tensor_mismatches, torch_mismatches
from apr.model.spec import param_specs
from apr.steps.resolved import resolve as plan_of
from tests.checkpoint.conftest import make_config, make_tensors


def test_every_parameter_has_weights_and_two_moments_of_its_shape():
    arch = make_config().model.architecture
    want = expected_tensors(arch)
    specs = param_specs(arch)
    assert len(want) == 3 * len(specs)
    for p in specs:
        m, v = moment_names(p.name)
        assert want[p.name] == want[m] == want[v] == tuple(p.shape)
        assert is_optimizer_state(m) and is_optimizer_state(v) and not is_optimizer_state(p.name)


def test_a_model_state_matches_and_each_kind_of_difference_is_named():
    config = make_config()
    want = expected_tensors(config.model.architecture)
    tensors = make_tensors(config)
    assert torch_mismatches(tensors, want) == []
    name = "model.norm.weight"
    m, _ = moment_names(name)
    del tensors[m]
    tensors["optimizer.w.stray"] = torch.zeros(1)
    tensors[name] = torch.zeros(3)
    tensors["lm_head.weight"] = tensors["lm_head.weight"].half()
    problems = torch_mismatches(tensors, want)
    assert any("missing 1" in p and m in p for p in problems)
    assert any("1 unexpected" in p and "optimizer.w.stray" in p for p in problems)
    assert any(p.startswith(name) and "shape [3]" in p for p in problems)
    assert any(p.startswith("lm_head.weight") and "float16" in p for p in problems)


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_both_engines_write_the_names_the_checkpoint_expects(engine_kind):
    from apr.train.build import build_engine

    config = make_config(**{"training.engine": engine_kind})
    engine = build_engine(plan_of(config), torch.device("cpu"))
    tensors = engine.train_state_tensors()
    assert tensor_mismatches({n: tuple(t.shape) for n, t in tensors.items()}, {},
                             expected_tensors(config.model.architecture)) == []


@pytest.mark.parametrize("engine_kind", ["interleaved", "standard"])
def test_both_engines_refuse_a_state_of_another_shape_naming_the_tensor(engine_kind):
    from apr.errors import AprError
    from apr.train.build import build_engine

    config = make_config(**{"training.engine": engine_kind})
    engine = build_engine(plan_of(config), torch.device("cpu"))
    tensors = {n: t.clone() for n, t in engine.train_state_tensors().items()}
    tensors["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(AprError, match=r"model\.norm\.weight has shape \[3\]"):
        engine.load_train_state_tensors(tensors)


def test_a_loss_parts_tensors_listed_in_a_checkpoint_json_are_expected_with_moments_and_checked():
    from apr.checkpoint.names import LOSS_PREFIX, OPT_M, OPT_V, is_optimizer_state, loss_state_shapes

    name = LOSS_PREFIX + "distill.down"
    assert loss_state_shapes({"loss_tensors": {name: [16, 32]}}) == {name: (16, 32), OPT_M + name: (16, 32),
                                                                     OPT_V + name: (16, 32)}
    assert loss_state_shapes({}) == {} and is_optimizer_state(name)  # readers of model weights leave it
    for bad in ({"model.norm.weight": [16]}, {name: [16, -1]}, {name: "16x32"}, [name]):
        with pytest.raises(ValueError):
            loss_state_shapes({"loss_tensors": bad})


def test_a_bf16_state_configs_checkpoints_hold_bf16_and_each_dtype_is_held_to_its_config():
    from apr.checkpoint.names import stored_dtype

    fp32 = make_config()
    bf16 = make_config(**{"training.mixed_precision": "bf16", "training.state_dtype": "bf16"})
    assert (stored_dtype(fp32), stored_dtype(bf16)) == ("float32", "bfloat16")
    assert stored_dtype({"training": {}}) == "float32"  # a checkpoint saved before the key
    assert stored_dtype(bf16.model_dump(mode="json")) == "bfloat16"
    want = expected_tensors(bf16.model.architecture)
    halves = {n: t.bfloat16() for n, t in make_tensors(bf16).items()}
    assert torch_mismatches(halves, want, stored_dtype(bf16)) == []
    (problem, *_) = torch_mismatches(halves, want, stored_dtype(fp32))
    assert "is bfloat16, checkpoints hold float32" in problem
    (problem, *_) = torch_mismatches(make_tensors(fp32), want, stored_dtype(bf16))
    assert "is float32, checkpoints hold bfloat16 (training.state_dtype)" in problem
    assert torch_mismatches(halves, want) == []  # no config at hand: either dtype apr writes
