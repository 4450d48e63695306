"""Fused ops behind one interface (DESIGN.md decision 4).

``get_backend(name, device)`` returns a ``KernelBackend``: ``torch`` (the reference, any device)
or ``cupy`` (``apr.kernels.cupy_backend``, CUDA only, compiled from ``kernels/*.cu``). ``auto``
picks CuPy on a CUDA device when it imports, else torch. Importing this package does not import
torch.
"""

from __future__ import annotations

from apr.errors import AprError
from apr.kernels.interface import DecayRanges, KernelBackend

__all__ = ["DecayRanges", "KernelBackend", "get_backend", "resolve_backend_name"]

_CACHE: dict[str, KernelBackend] = {}


def _cupy_backend() -> KernelBackend:
    from apr.kernels.cupy_backend import CupyBackend  # written with the CUDA kernels

    return CupyBackend()


def resolve_backend_name(name: str, device_type: str) -> str:
    """The backend ``name`` ("auto", "torch", "cupy") means on a device of ``device_type``."""
    name = str(name)
    if name == "auto":
        if device_type != "cuda":
            return "torch"
        try:
            _cupy_backend()
        except Exception:
            return "torch"
        return "cupy"
    return name


def get_backend(name: str = "auto", device=None) -> KernelBackend:
    device_type = getattr(device, "type", None) or str(device or "cpu").split(":")[0]
    resolved = resolve_backend_name(name, device_type)
    if resolved not in _CACHE:
        if resolved == "torch":
            from apr.kernels.torch_backend import TorchBackend

            _CACHE[resolved] = TorchBackend()
        elif resolved == "cupy":
            if device_type != "cuda":
                raise AprError(f"training.kernels: cupy needs a CUDA device, got {device_type}")
            try:
                _CACHE[resolved] = _cupy_backend()
            except ImportError as err:
                raise AprError(f"training.kernels: cupy backend unavailable ({err})") from err
        else:
            raise AprError(f"unknown kernel backend {name!r} (expected auto, torch or cupy)")
    return _CACHE[resolved]
