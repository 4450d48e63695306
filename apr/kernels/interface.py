"""The fused-op interface every kernel backend implements (docs/design.md, "Kernels").

Conventions shared by all backends:
- Buffers are flat, contiguous float32 device tensors unless said otherwise (``adamw_step`` also
  takes bfloat16 state: ``training.state_dtype: bf16``, stochastic rounding).
- Nothing here synchronises with the host unless a docstring says so: results that are scalars
  (norms, loss sums) come back as 0-dim float32 tensors on the input's device.
- Scalars that depend on device results (a clipping coefficient, an overflow flag) are passed as
  0-dim device tensors so the caller never has to read them on the host.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DecayRanges:
    """Which elements of a flat parameter buffer get weight decay, as half-open index ranges.

    Norm weights (and, by config, the embedding) sit in the same flat buffer as the matrices but
    must not decay. Backends use ``ranges`` directly (a per-range table).
    """

    numel: int
    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def from_segments(cls, segments: list[tuple[int, bool]]) -> DecayRanges:
        """From consecutive (numel, decays) segments in buffer order; adjacent decaying ones merge."""
        ranges: list[tuple[int, int]] = []
        offset = 0
        for numel, decays in segments:
            if decays and numel:
                if ranges and ranges[-1][1] == offset:
                    ranges[-1] = (ranges[-1][0], offset + numel)
                else:
                    ranges.append((offset, offset + numel))
            offset += numel
        return cls(offset, tuple(ranges))

    @property
    def decayed_numel(self) -> int:
        return sum(e - s for s, e in self.ranges)


_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rounding_keys(seed: int, step: int, group: str) -> tuple[int, int, int]:
    """The 32-bit keys (weights, first moment, second moment) of the stochastic rounding of one
    group's update at one optimizer step (``training.state_dtype: bf16``): a function of the run's
    seed, the step and the group's name only, so a resumed run draws the same noise as the run
    straight. Each element's noise is ``fmix32`` of its index in the group's flat buffer and the key
    (``apr.kernels.torch_backend.stochastic_round_bf16``, ``kernels/adamw.cu``): the same bits on any
    backend, thread count or launch shape."""
    base = _splitmix64((seed & _MASK64) ^ _splitmix64((step & _MASK32) | (zlib.crc32(group.encode()) << 32)))
    weights, first, second = (_splitmix64(base + k) & _MASK32 for k in (1, 2, 3))
    return weights, first, second


class KernelBackend(ABC):
    """Fused ops used by the training engine. ``apr.kernels.torch_backend`` is the reference."""

    name: str = "abstract"

    @abstractmethod
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
        """One AdamW update of a flat float32 buffer, in place, bit-for-bit the arithmetic of
        ``torch.optim.AdamW`` (decoupled decay ``p *= 1 - lr*wd`` on ``decay``'s ranges only, then
        the moments, then ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``).

        ``step`` is this update's 1-based count (bias correction). The gradient used is
        ``grad * grad_scale`` (clipping coefficient times loss-scale inverse; a 0-dim device
        tensor or a float). If ``found_inf`` (0-dim device tensor) is nonzero the update is
        skipped and param, exp_avg and exp_avg_sq are left unchanged; the flag is never read on the
        host. ``param_copy`` (a bfloat16/float16 tensor of ``param``'s size): also written with the
        updated parameter rounded to its dtype (the compute copy), unchanged on a skipped step.
        ``grad``'s contents are undefined afterwards (backends may use it as scratch).

        bf16 state (``training.state_dtype: bf16``): ``param``, ``exp_avg`` and ``exp_avg_sq`` are
        all bfloat16 (``grad`` bfloat16 or float32). The update is the float32 one above on their
        float32 values; each result is written back with stochastic rounding: 16 bits of noise
        (``rounding``'s key for that tensor, ``rounding_keys``; the element's index) are added to the
        float32 bits and the low 16 bits dropped, so the stored value's expectation is the float32
        one and updates smaller than half a bf16 ulp survive on average. A flagged step leaves the
        state unchanged (a bf16 value plus noise below one of its ulps truncates to itself).
        """

    @abstractmethod
    def sq_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of squares of a flat buffer, accumulated in float32, as a 0-dim device tensor.
        Non-finite inputs give a non-finite result (used as the overflow/NaN check)."""

    @abstractmethod
    def cross_entropy_fwd_bwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, grad_scale: float, ignore_index: int = -100
    ) -> torch.Tensor:
        """Cross-entropy over a logits chunk ``[n, vocab]`` (float32, contiguous) in one pass.

        Returns the summed loss over rows whose target is not ``ignore_index`` (0-dim float32) and
        overwrites ``logits`` with ``grad_scale * d(loss_sum)/d(logits)`` (rows ignored: zero).
        """

    @abstractmethod
    def cross_entropy_fwd(
        self, logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100
    ) -> torch.Tensor:
        """Summed cross-entropy of a logits chunk without gradient (evaluation). ``logits`` may
        be overwritten."""
