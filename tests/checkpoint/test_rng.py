import json
import random

import numpy as np
import pytest
import torch

from apr.checkpoint.rng import capture_rng, restore_rng


def draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.normal(),
            torch.rand(4).tolist(), torch.randint(0, 1000, (3,)).tolist())


def test_capture_restore_replays_every_generator_through_json():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()  # move away from the seeded states; leaves a cached gaussian in python and numpy
    random.gauss(0, 1)
    np.random.normal()
    saved = json.loads(json.dumps(capture_rng(), allow_nan=False))  # survives strict JSON
    expected = draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert draws() != expected
    assert restore_rng(saved) == []
    assert draws() == expected


def test_missing_generators_are_left_alone_and_unknown_format_refused():
    torch.manual_seed(5)
    saved = capture_rng()
    del saved["python"], saved["numpy"]
    random.seed(7)
    expected_py = random.random()
    random.seed(7)
    torch.rand(2)
    restore_rng(saved)
    assert random.random() == expected_py
    with pytest.raises(ValueError, match="format"):
        restore_rng({"format_version": 42})


def test_cuda_state_without_cuda_is_reported(monkeypatch):
    saved = capture_rng()
    saved["torch_cuda"] = {"device": 0, "state": saved["torch_cpu"]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    notes = restore_rng(saved)
    assert len(notes) == 1 and "CUDA" in notes[0]


@pytest.mark.gpu
def test_cuda_generator_round_trip():
    torch.cuda.manual_seed(3)
    torch.rand(1, device="cuda")
    saved = capture_rng()
    assert "torch_cuda" in saved
    expected = torch.rand(5, device="cuda").tolist()
    torch.cuda.manual_seed(9)
    restore_rng(saved)
    assert torch.rand(5, device="cuda").tolist() == expected
