"""apr/train/flat.py: a group's parameters become views of one flat buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from apr.model.spec import ParamSpec
from apr.train.flat import flatten_group


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(3, 2, bias=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.randn(2))


SPECS = [ParamSpec("proj.weight", (2, 3), "g", True), ParamSpec("norm.weight", (2,), "g", False)]


def flat_group(numel=8):
    model = Tiny()
    before = [model.proj.weight.detach().clone(), model.norm.weight.detach().clone()]
    m, v = torch.full((numel,), 7.0), torch.full((numel,), 7.0)
    group = flatten_group(model, "g", SPECS, torch.empty(numel), m, v)
    return model, before, group


def test_parameters_are_copied_in_spec_order_and_become_views_of_the_flat_buffer():
    model, before, group = flat_group()
    assert group.offsets == [0, 6] and group.numel == 8
    assert torch.equal(group.flat_params, torch.cat([before[0].flatten(), before[1]]))
    group.flat_params[6] = 42.0  # the model sees writes to the buffer: no copy in between
    assert model.norm.weight[0].item() == 42.0
    assert model.proj.weight.data_ptr() == group.flat_params.data_ptr()
    assert torch.count_nonzero(group.exp_avg) == 0 and torch.count_nonzero(group.exp_avg_sq) == 0


def test_decay_covers_the_matrix_but_not_the_norm():
    _, _, group = flat_group()
    assert group.decay.ranges == ((0, 6),)


def test_a_buffer_of_the_wrong_size_is_refused_with_the_group_name():
    with pytest.raises(ValueError, match="g: buffer holds 9 elements, parameters 8"):
        flat_group(numel=9)


def test_autograd_adds_into_the_bound_gradient_buffer_and_release_unbinds():
    model, _, group = flat_group()
    workspace = torch.zeros(10)  # a shared workspace may be longer than the group
    group.bind_grads(workspace)
    x = torch.ones(4, 3)
    (model.proj(x) * model.norm.weight).sum().backward()
    expected_w = (model.norm.weight.detach()[:, None] * 4).expand(2, 3)
    assert torch.allclose(workspace[:6].view(2, 3), expected_w)
    assert torch.allclose(workspace[6:8], model.proj(x).detach().sum(0))
    assert torch.count_nonzero(workspace[8:]) == 0
    group.release_grads()
    assert all(p.grad is None for p in group.params)
