"""Every random number generator a run touches, as JSON and back: torch's CPU generator, the current
CUDA device's generator (when CUDA is in use), Python's ``random`` and NumPy's global generator.

Byte states are base64 so the result sits in a checkpoint's JSON as it is.
"""

from __future__ import annotations

import base64
import random

RNG_FORMAT_VERSION = 1


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def capture_rng() -> dict:
    """The state of every generator, JSON-serialisable."""

    import numpy as np
    import torch

    version, py_state, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict = {
        "format_version": RNG_FORMAT_VERSION,
        "python": {"version": version, "state": list(py_state), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": name,
            "keys": _b64(np.asarray(keys, dtype="<u4").tobytes()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": _b64(torch.get_rng_state().numpy().tobytes()),
    }
    # Only the current device, and only when this process already uses CUDA: asking for every device
    # would create a context on each GPU (under data parallelism, on other ranks' GPUs).
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        out["torch_cuda"] = {"device": device, "state": _b64(torch.cuda.get_rng_state(device).numpy().tobytes())}
    return out


def restore_rng(state: dict) -> list[str]:
    """Put every generator back as ``capture_rng`` found it. Returns notes on what could not be
    restored (a CUDA state on a machine without CUDA); an empty list means everything was."""

    import numpy as np
    import torch

    if state.get("format_version") != RNG_FORMAT_VERSION:
        raise ValueError(f"unknown RNG state format {state.get('format_version')!r}")
    notes: list[str] = []
    py = state.get("python")
    if py is not None:
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npst = state.get("numpy")
    if npst is not None:
        keys = np.frombuffer(_unb64(npst["keys"]), dtype="<u4").astype(np.uint32)
        np.random.set_state((npst["bit_generator"], keys, npst["pos"], npst["has_gauss"],
                             npst["cached_gaussian"]))
    cpu = state.get("torch_cpu")
    if cpu is not None:
        torch.set_rng_state(torch.frombuffer(bytearray(_unb64(cpu)), dtype=torch.uint8))
    cuda = state.get("torch_cuda")
    if cuda is not None:
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(_unb64(cuda["state"])), dtype=torch.uint8),
                                     device)
        else:
            notes.append("the checkpoint holds a CUDA RNG state but CUDA is not available; not restored")
    return notes
