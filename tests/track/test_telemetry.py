import sys
import types

import pytest

from apr.track import telemetry


@pytest.fixture
def fresh_nvml(monkeypatch):
    monkeypatch.setitem(telemetry._nvml, "module", None)
    monkeypatch.setitem(telemetry._nvml, "failed", False)


def _fake_pynvml(fail_power=False):
    m = types.ModuleType("pynvml")
    m.NVML_TEMPERATURE_GPU = 0
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: ("h", i)
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=30 * 2**30, total=80 * 2**30, free=0)
    m.nvmlDeviceGetTemperature = lambda h, kind: 61

    def power(h):
        if fail_power:
            raise RuntimeError("not supported")
        return 350_500

    m.nvmlDeviceGetPowerUsage = power
    return m


def test_snapshot_maps_nvml_readings_to_documented_units(monkeypatch, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    assert telemetry.gpu_snapshot() == {
        "name": "NVIDIA H100 80GB HBM3",
        "utilization": 87,
        "memory_used": 30 * 2**30,
        "memory_total": 80 * 2**30,
        "temperature": 61,
        "power_w": 350.5,
    }


def test_an_unreadable_field_is_none_not_an_error(monkeypatch, fresh_nvml):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_power=True))
    snap = telemetry.gpu_snapshot()
    assert snap["power_w"] is None and snap["utilization"] == 87


def test_no_nvml_means_none(monkeypatch, fresh_nvml):
    m = types.ModuleType("pynvml")

    def init():
        raise RuntimeError("NVML Shared Library Not Found")

    m.nvmlInit = init
    monkeypatch.setitem(sys.modules, "pynvml", m)
    assert telemetry.gpu_snapshot() is None
    assert telemetry.gpu_snapshot() is None  # remembered: no second init attempt needed


def test_real_environment_gives_none_or_a_full_snapshot():
    snap = telemetry.gpu_snapshot()
    assert snap is None or set(snap) == {"name", "utilization", "memory_used", "memory_total", "temperature",
                                         "power_w"}


def test_device_index_follows_local_rank_and_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert telemetry.default_device_index() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert telemetry.default_device_index() == 5
    monkeypatch.delenv("LOCAL_RANK")
    assert telemetry.default_device_index() == 3
