"""Fused ops behind one interface (docs/design.md, "Kernels").

``get_backend(name, device)`` returns a ``KernelBackend``: ``torch`` (the reference, any device)
or ``cupy`` (``apr.kernels.cupy_backend``, CUDA only, compiled from ``kernels/*.cu``). ``auto``
(``training.kernels: auto``) picks CuPy on a CUDA device when it imports and its kernels compile,
else torch, with a warning that says why. Importing this package imports neither torch nor CuPy.
"""

from __future__ import annotations

import warnings

from apr.errors import AprError
from apr.kernels.interface import DecayRanges, KernelBackend

__all__ = ["DecayRanges", "KernelBackend", "cupy_unavailable_reason", "get_backend", "resolve_backend_name"]

BACKENDS = ("auto", "torch", "cupy")
INSTALL_HINT = "install CuPy for your CUDA version, e.g. pip install 'apr[gpu]' (cupy-cuda12x)"

_CACHE: dict[str, KernelBackend] = {}
_CUPY_FAILURE: list[str] = []  # why the CuPy backend could not be built in this process (tried once)
_WARNED: list[bool] = []


def _device_type(device) -> str:
    return getattr(device, "type", None) or str(device or "cpu").split(":")[0]


def cupy_unavailable_reason() -> str | None:
    """None when the CuPy backend works in this process (CuPy imports, a CUDA device is visible,
    NVRTC compiles ``kernels/*.cu``), else why not. Tried once per process."""
    if "cupy" in _CACHE:
        return None
    if _CUPY_FAILURE:
        return _CUPY_FAILURE[0]
    try:
        from apr.kernels.cupy_backend import CupyBackend

        _CACHE["cupy"] = CupyBackend()
        return None
    except ImportError as err:
        reason = f"CuPy does not import ({err}); {INSTALL_HINT}"
    except AprError as err:
        reason = str(err)
    except Exception as err:  # driver/runtime errors raised by CuPy itself
        reason = f"CuPy is installed but unusable: {type(err).__name__}: {err}"
    _CUPY_FAILURE.append(reason)
    return reason


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend ``name`` ("auto", "torch", "cupy") means on a device of ``device_type``.
    Only ``auto`` is resolved (trying CuPy on CUDA); explicit names come back unchanged."""
    name = str(name)
    if name != "auto":
        return name
    if device_type != "cuda":
        return "torch"
    reason = cupy_unavailable_reason()
    if reason is None:
        return "cupy"
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"training.kernels: auto uses the torch kernels on CUDA: {reason}", RuntimeWarning,
                      stacklevel=3)
    return "torch"


def get_backend(name: str = "auto", device=None) -> KernelBackend:
    """The backend for ``training.kernels`` = ``name`` on ``device`` (a torch.device or a string)."""
    device_type = _device_type(device)
    if str(name) not in BACKENDS:
        raise AprError(f"unknown kernel backend {name!r} (expected auto, torch or cupy)")
    resolved = resolve_backend_name(name, device_type)
    if resolved == "torch":
        if "torch" not in _CACHE:
            from apr.kernels.torch_backend import TorchBackend

            _CACHE["torch"] = TorchBackend()
        return _CACHE["torch"]
    # explicit cupy (auto only resolves to cupy once it is in the cache)
    if device_type != "cuda":
        raise AprError(f"training.kernels: cupy needs a CUDA device, got {device_type} "
                       "(set training.device: cuda, or training.kernels: auto or torch)")
    reason = cupy_unavailable_reason()
    if reason is not None:
        raise AprError(f"training.kernels: cupy is unavailable: {reason}")
    return _CACHE["cupy"]
