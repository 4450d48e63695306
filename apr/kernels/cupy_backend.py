"""The CuPy backend: the fused ops as CUDA kernels from ``kernels/*.cu`` (docs/design.md, "Kernels").

* Each ``kernels/<name>.cu`` is compiled once per process and device with NVRTC through
  ``cupy.RawModule`` (CuPy also keeps the binary in its on-disk kernel cache). Quoted includes
  (``apr_common.cuh``) are inlined here first, so NVRTC needs no include path or CUDA headers and
  CuPy's cache key covers the headers too.
* Launches go on torch's current stream (``cupy.cuda.ExternalStream``), so they are ordered with
  the torch ops around them exactly as a torch op would be; tensors are shared with CuPy through
  DLPack (``cupy.from_dlpack``), without copies.
* Nothing here synchronises with the host: norms, loss sums, clipping coefficients and overflow
  flags stay 0-dim device tensors, and temporaries come from torch's caching allocator on the
  same stream.

``kernel_source(name)`` is importable without CuPy or a GPU (the compile tests use it).
"""

from __future__ import annotations

import math
import re
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from apr.errors import AprError
from apr.kernels.interface import DecayRanges, KernelBackend
from apr.resources import resource_dir

KERNEL_FILES = ("adamw", "sq_norm", "cross_entropy")
# Every kernel each file must define (checked at load, and by the compile tests).
KERNEL_NAMES = {
    "adamw": ("apr_adamw_f32", "apr_adamw_f32_copy_bf16", "apr_adamw_f32_copy_f16", "apr_adamw_bf16_sr",
              "apr_adamw_bf16_sr_grad_bf16"),
    "sq_norm": ("apr_sq_norm_partial_f32", "apr_sq_norm_partial_bf16", "apr_sq_norm_partial_f16",
                "apr_sq_norm_finish"),
    "cross_entropy": ("apr_ce_fwd_bwd_f32",),  # logits are always float32 (apr/kernels/linear_ce.py)
}
NVRTC_OPTIONS = ("-std=c++17",)

# Launch shapes; the .cu files declare matching __launch_bounds__.
ADAMW_THREADS = 256
SQ_NORM_THREADS = 256
SQ_NORM_FINISH_THREADS = 1024
SQ_NORM_MAX_PARTIALS = 1024
CE_MAX_THREADS = 1024
BLOCKS_PER_SM = 8  # grid-stride kernels: enough resident blocks to saturate HBM

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", re.MULTILINE)
_NULL = np.uint64(0)  # a null pointer argument


def kernels_dir() -> Path:
    return resource_dir("kernels")


def kernel_source(name: str, directory: Path | None = None) -> str:
    """``kernels/<name>.cu`` with its quoted includes inlined (each header once)."""
    directory = directory or kernels_dir()
    seen: set[str] = set()

    def expand(text: str) -> str:
        def include(match: re.Match) -> str:
            header = match.group(1)
            if header in seen:
                return f"// {header}: already included\n"
            seen.add(header)
            body = _PRAGMA_ONCE.sub("", (directory / header).read_text())
            return f"// ---- begin {header}\n{expand(body)}\n// ---- end {header}\n"

        return _INCLUDE.sub(include, text)

    return expand((directory / f"{name}.cu").read_text())


ADAMW_SCALARS = ("decay_keep", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size",
                 "inv_sqrt_bc2")


def adamw_scalars(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: int) -> tuple[np.float32, ...]:
    """The AdamW kernel's float32 scalar arguments, in ``ADAMW_SCALARS`` order: each the float32
    rounding of the double the torch reference passes to its op (``inv_sqrt_bc2`` is
    ``1.0f / float(sqrt(bc2))``, the multiplier torch's CUDA division by a host scalar uses)."""
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    return (
        np.float32(1.0 - lr * weight_decay),
        np.float32(beta1), np.float32(1.0 - beta1),
        np.float32(beta2), np.float32(1.0 - beta2),
        np.float32(eps),
        np.float32(lr / bc1),
        np.float32(1.0) / np.float32(math.sqrt(bc2)),
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_DLPACK_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.bool: torch.uint8}


def _dlpack_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as CuPy can import it: detached (torch refuses to export a tensor that requires grad)
    and, for dtypes CuPy may not know (bfloat16) or need not know, the same bytes as an integer
    type. Kernels receive a pointer either way."""
    t = t.detach()
    view = _DLPACK_VIEW.get(t.dtype)
    return t if view is None else t.view(view)


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


class CupyBackend(KernelBackend):
    """Raises ``ImportError`` when CuPy is missing and ``AprError`` when it cannot be used (no CUDA
    device, NVRTC missing, a kernel that does not compile)."""

    name = "cupy"
    # Where the buffers live. Only the device-specific methods below (_ready, _launch, _stream,
    # _load) touch CuPy; the CPU emulation in tests/kernels/test_cupy_backend.py overrides those
    # and runs the same argument marshalling against the kernels compiled for the host.
    device_type = "cuda"

    def __init__(self, device: torch.device | str | int | None = None):
        import cupy  # noqa: F401  (ImportError: the caller says how to install it)

        self._cp = cupy
        if not torch.cuda.is_available():
            raise AprError("no CUDA device is visible to torch")
        self._lock = threading.Lock()
        self._functions: dict[tuple[int, str], object] = {}
        self._sm_count: dict[int, int] = {}
        self._streams: dict[tuple[int, int], object] = {}
        self._decay_tables: dict[tuple, torch.Tensor] = {}
        self._sources = {name: kernel_source(name) for name in KERNEL_FILES}
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise AprError(f"the CuPy backend needs a CUDA device, got {dev}")
        self._load(self._index(dev))  # compile now, so a broken toolchain fails here and not mid-step

    # ------------------------------------------------------------------------------ plumbing

    @staticmethod
    def _index(device: torch.device) -> int:
        return torch.cuda.current_device() if device.index is None else device.index

    def _load(self, idx: int) -> None:
        with self._lock:
            if idx in self._sm_count:
                return
            cp = self._cp
            with cp.cuda.Device(idx):
                for file in KERNEL_FILES:
                    try:
                        module = cp.RawModule(code=self._sources[file], options=NVRTC_OPTIONS)
                        module.compile()
                        for fn in KERNEL_NAMES[file]:
                            self._functions[(idx, fn)] = module.get_function(fn)
                    except Exception as err:  # CompileException, missing NVRTC, driver errors
                        raise AprError(f"kernels/{file}.cu: could not compile/load with CuPy on cuda:{idx}: "
                                       f"{type(err).__name__}: {err}") from err
            self._sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count

    def _ready(self, device: torch.device) -> int:
        """The device's index, with the kernels loaded on it."""
        idx = self._index(device)
        if idx not in self._sm_count:
            self._load(idx)
        return idx

    def _launch(self, device: torch.device, name: str, grid: int, block: int, args: tuple) -> None:
        """Launch on torch's current stream of ``device``; tensor arguments go through DLPack."""
        cp = self._cp
        idx = self._ready(device)
        fn = self._functions[(idx, name)]
        stream = self._stream(idx)
        with cp.cuda.Device(idx), stream:
            # Converted inside the stream context: torch's __dlpack__ then sees the consumer stream
            # equal to its own current stream and adds no cross-stream wait.
            cargs = tuple(cp.from_dlpack(_dlpack_view(a)) if isinstance(a, torch.Tensor) else a for a in args)
            fn((grid,), (block,), cargs)

    def _stream(self, idx: int):
        """torch's current stream on device ``idx`` as a CuPy stream (cached by handle)."""
        torch_stream = torch.cuda.current_stream(idx)
        key = (idx, torch_stream.cuda_stream)
        stream = self._streams.get(key)
        if stream is None:
            cp = self._cp
            if hasattr(cp.cuda, "ExternalStream"):
                with warnings.catch_warnings():  # deprecated in CuPy 14 for Stream.from_external
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stream = cp.cuda.ExternalStream(torch_stream.cuda_stream, idx)
            else:
                stream = cp.cuda.Stream.from_external(torch_stream)
            self._streams[key] = stream
        return stream

    def _grid(self, idx: int, work: int, threads: int, blocks_per_sm: int = BLOCKS_PER_SM) -> int:
        return max(1, min(_cdiv(work, threads), self._sm_count[idx] * blocks_per_sm))

    def _decay_table(self, decay: DecayRanges, device: torch.device, idx: int) -> torch.Tensor:
        """The decay ranges as a flat int64 device tensor, uploaded once per (ranges, device)."""
        key = (decay.numel, decay.ranges, idx)
        table = self._decay_tables.get(key)
        if table is None:
            host = torch.tensor([v for r in decay.ranges for v in r], dtype=torch.int64)
            if device.type == "cuda":  # pinned + async: no host sync, even the first time
                host = host.pin_memory()
            table = host.to(device, non_blocking=True)
            self._decay_tables[key] = table
        return table

    def _check_cuda(self, name: str, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            raise AprError(f"cupy backend: {name} is on {t.device}, expected a CUDA tensor")

    def _device_scalar(self, value, device: torch.device, what: str):
        """(host float, device float32 0-dim tensor or None) for a float or a 0-dim tensor."""
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise AprError(f"cupy backend: {what} must be a scalar, got shape {tuple(value.shape)}")
            if value.device.type != self.device_type:
                return float(value.item()), None  # a host tensor: reading it costs no device sync
            if value.device != device:
                raise AprError(f"cupy backend: {what} is on {value.device}, the buffers on {device}")
            return 1.0, value.detach().reshape(()).to(torch.float32).contiguous()
        return float(value), None

    # ------------------------------------------------------------------------------------ ops

    def adamw_step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        step: int,
        decay: DecayRanges,
        grad_scale: torch.Tensor | float = 1.0,
        found_inf: torch.Tensor | None = None,
        param_copy: torch.Tensor | None = None,
        rounding: tuple[int, int, int] | None = None,
    ) -> None:
        """See ``KernelBackend.adamw_step``; one kernel launch. ``grad`` is only read.

        ``param_copy`` (CuPy-backend extension): a bfloat16 or float16 tensor of ``param``'s size
        that receives the updated weights rounded to its dtype in the same launch (the compute
        copy a bf16 forward reads), and is left unchanged when the step is skipped."""
        if param.dtype == torch.bfloat16:
            self._adamw_bf16_state(param, grad, exp_avg, exp_avg_sq, rounding, param_copy, lr=lr, beta1=beta1,
                                   beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, decay=decay,
                                   grad_scale=grad_scale, found_inf=found_inf)
            return
        n = param.numel()
        for label, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            self._check_cuda(label, t)
            if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device != param.device:
                raise AprError(f"cupy adamw_step: {label} must be a contiguous float32 tensor of {n} elements "
                               f"on {param.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if step < 1:
            raise AprError(f"cupy adamw_step: step is 1-based, got {step}")
        if decay.numel != n:
            raise AprError(f"cupy adamw_step: decay ranges cover {decay.numel} elements, the buffer has {n}")
        if n == 0:
            return
        device = param.device
        idx = self._ready(device)

        scale, scale_t = self._device_scalar(grad_scale, device, "grad_scale")
        flag = self._found_flag(found_inf)
        if flag is None:
            return
        found_kind, found_t = flag

        kernel, copy_bytes = "apr_adamw_f32", 0
        if param_copy is not None:
            self._check_cuda("param_copy", param_copy)
            kernels = {torch.bfloat16: "apr_adamw_f32_copy_bf16", torch.float16: "apr_adamw_f32_copy_f16"}
            if param_copy.dtype not in kernels or param_copy.numel() != n or not param_copy.is_contiguous():
                raise AprError(f"cupy adamw_step: param_copy must be a contiguous bfloat16/float16 tensor of {n} "
                               f"elements, got {param_copy.dtype} {tuple(param_copy.shape)}")
            kernel, copy_bytes = kernels[param_copy.dtype], 8

        vec = all(_aligned(t, 16) for t in (param, grad, exp_avg, exp_avg_sq))
        if param_copy is not None:
            vec = vec and _aligned(param_copy, copy_bytes)
        n_vec4 = n // 4 if vec else 0

        use_decay = weight_decay != 0.0 and decay.ranges
        table = self._decay_table(decay, device, idx) if use_decay else None
        args = (
            param, grad, exp_avg, exp_avg_sq,
            param_copy if param_copy is not None else _NULL,
            table if table is not None else _NULL,
            np.int32(len(decay.ranges) if use_decay else 0),
            scale_t if scale_t is not None else _NULL,
            found_t if found_t is not None else _NULL,
            np.int32(found_kind),
            np.int64(n), np.int64(n_vec4),
            *adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step),
            np.float32(scale),
        )
        work = n_vec4 + (n - 4 * n_vec4)
        self._launch(device, kernel, self._grid(idx, work, ADAMW_THREADS), ADAMW_THREADS, args)

    def _found_flag(self, found_inf: torch.Tensor | None) -> tuple[int, torch.Tensor | None] | None:
        """(kind, device flag) for the kernels' found_inf arguments; None: a host flag that is set (skip)."""
        if found_inf is None:
            return 0, None
        if found_inf.device.type != self.device_type:
            return None if bool(found_inf.item()) else (0, None)
        if found_inf.dtype in (torch.bool, torch.uint8):
            return 2, found_inf.detach().reshape(()).contiguous().view(torch.uint8)
        return 1, found_inf.detach().reshape(()).to(torch.float32).contiguous()

    def _adamw_bf16_state(self, param, grad, exp_avg, exp_avg_sq, rounding, param_copy, *, lr, beta1, beta2, eps,
                          weight_decay, step, decay, grad_scale, found_inf) -> None:
        """bf16 weights and moments (``training.state_dtype: bf16``): one launch of
        ``apr_adamw_bf16_sr`` (float32 gradient) or ``apr_adamw_bf16_sr_grad_bf16``."""
        n = param.numel()
        for label, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)):
            self._check_cuda(label, t)
            wanted = (torch.bfloat16, torch.float32) if label == "grad" else (torch.bfloat16,)
            if t.dtype not in wanted or not t.is_contiguous() or t.numel() != n or t.device != param.device:
                raise AprError(f"cupy adamw_step (bf16 state): {label} must be a contiguous "
                               f"{'/'.join(str(d).removeprefix('torch.') for d in wanted)} tensor of {n} elements on "
                               f"{param.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if rounding is None or len(rounding) != 3:
            raise AprError("cupy adamw_step (bf16 state): the three stochastic-rounding keys are needed "
                           "(apr.kernels.interface.rounding_keys)")
        if param_copy is not None:
            raise AprError("cupy adamw_step (bf16 state): the weights are the compute copy; param_copy must be None")
        if step < 1 or decay.numel != n:
            raise AprError(f"cupy adamw_step: step {step} (1-based), decay ranges over {decay.numel} of {n} elements")
        flag = self._found_flag(found_inf)
        if n == 0 or flag is None:
            return
        device = param.device
        idx = self._ready(device)
        scale, scale_t = self._device_scalar(grad_scale, device, "grad_scale")
        use_decay = weight_decay != 0.0 and decay.ranges
        table = self._decay_table(decay, device, idx) if use_decay else None
        keys = tuple(np.int32(np.uint32(k & 0xFFFFFFFF).view(np.int32)) for k in rounding)  # the bits, as int
        args = (
            param, grad, exp_avg, exp_avg_sq,
            table if table is not None else _NULL,
            np.int32(len(decay.ranges) if use_decay else 0),
            scale_t if scale_t is not None else _NULL,
            flag[1] if flag[1] is not None else _NULL,
            np.int32(flag[0]),
            np.int64(n), *keys,
            *adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step),
            np.float32(scale),
        )
        kernel = "apr_adamw_bf16_sr_grad_bf16" if grad.dtype == torch.bfloat16 else "apr_adamw_bf16_sr"
        self._launch(device, kernel, self._grid(idx, n, ADAMW_THREADS), ADAMW_THREADS, args)

    def sq_norm(self, x: torch.Tensor) -> torch.Tensor:
        self._check_cuda("x", x)
        kernels = {torch.float32: ("apr_sq_norm_partial_f32", 16), torch.bfloat16: ("apr_sq_norm_partial_bf16", 8),
                   torch.float16: ("apr_sq_norm_partial_f16", 8)}
        if x.dtype not in kernels:
            x = x.float()
        x = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
        out = torch.empty((), dtype=torch.float32, device=x.device)
        n = x.numel()
        if n == 0:
            return out.zero_()
        idx = self._ready(x.device)
        kernel, align = kernels[x.dtype]
        n_vec4 = n // 4 if _aligned(x, align) else 0
        work = n_vec4 + (n - 4 * n_vec4)
        # The grid depends only on n and the device, so the sum's order (and value) is reproducible.
        blocks = min(self._grid(idx, work, SQ_NORM_THREADS, blocks_per_sm=4), SQ_NORM_MAX_PARTIALS)
        partials = torch.empty(blocks, dtype=torch.float64, device=x.device)
        self._launch(x.device, kernel, blocks, SQ_NORM_THREADS, (x, np.int64(n), np.int64(n_vec4), partials))
        self._launch(x.device, "apr_sq_norm_finish", 1, SQ_NORM_FINISH_THREADS,
                     (partials, np.int32(blocks), out, np.int32(0)))
        return out

    def _cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, grad_scale, ignore_index: int,
                       write_grad: bool, position_losses: torch.Tensor | None = None) -> torch.Tensor:
        self._check_cuda("logits", logits)
        kernels = {torch.float32: ("apr_ce_fwd_bwd_f32", 16)}
        if logits.dim() != 2 or logits.dtype not in kernels or (logits.shape[1] > 1 and logits.stride(1) != 1):
            raise AprError(f"cupy cross-entropy: logits must be [n, vocab] float32 with a "
                           f"contiguous last dimension, got {logits.dtype} {tuple(logits.shape)} "
                           f"strides {logits.stride()}")
        rows, vocab = logits.shape
        if targets.numel() != rows:
            raise AprError(f"cupy cross-entropy: {targets.numel()} targets for {rows} rows")
        device = logits.device
        if rows == 0:
            return torch.zeros((), dtype=torch.float32, device=device)
        if targets.device != device:
            raise AprError(f"cupy cross-entropy: targets on {targets.device}, logits on {device}")
        targets = targets.reshape(-1).to(torch.int64).contiguous()
        scale, scale_t = self._device_scalar(grad_scale, device, "grad_scale")
        kernel, align = kernels[logits.dtype]
        row_stride = logits.stride(0) if rows > 1 else vocab
        vec4 = vocab % 4 == 0 and row_stride % 4 == 0 and _aligned(logits, align)
        work = vocab // 4 if vec4 else vocab
        threads = CE_MAX_THREADS if work >= 4 * CE_MAX_THREADS else max(32, min(CE_MAX_THREADS,
                                                                                 _cdiv(_cdiv(work, 4), 32) * 32))
        row_loss = position_losses  # each position's loss, then their sum
        if row_loss is None:
            row_loss = torch.empty(rows, dtype=torch.float32, device=device)
        elif (row_loss.dtype, row_loss.numel(), row_loss.device) != (torch.float32, rows, device) \
                or not row_loss.is_contiguous():
            raise AprError(f"cupy cross-entropy: position_losses must be float32 [{rows}] contiguous on {device}")
        args = (logits, targets, np.int64(vocab), np.int64(row_stride), np.int64(ignore_index), np.float32(scale),
                scale_t if scale_t is not None else _NULL, row_loss, np.int32(vec4), np.int32(write_grad))
        self._launch(device, kernel, rows, threads, args)
        return row_loss.sum()

    fills_position_losses = True  # the kernel writes each position's loss before summing them (apr runs blame)

    def cross_entropy_fwd_bwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, grad_scale: float | torch.Tensor,
        ignore_index: int = -100, position_losses: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``position_losses`` (float32 ``[n]``, optional): the kernel's per-position losses are
        written there, the values the sum is taken over (the loss is the same with or without it)."""
        return self._cross_entropy(logits, targets, grad_scale, ignore_index, write_grad=True,
                                   position_losses=position_losses)

    def cross_entropy_fwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
    ) -> torch.Tensor:
        return self._cross_entropy(logits, targets, 1.0, ignore_index, write_grad=False)
