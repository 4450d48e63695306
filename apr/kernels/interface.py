"""The fused-op interface every kernel backend implements (docs/design.md, "Kernels").

Conventions shared by all backends:
- Buffers are flat, contiguous float32 device tensors unless said otherwise.
- Nothing here synchronises with the host unless a docstring says so: results that are scalars
  (norms, loss sums) come back as 0-dim float32 tensors on the input's device.
- Scalars that depend on device results (a clipping coefficient, an overflow flag) are passed as
  0-dim device tensors so the caller never has to read them on the host.
"""

from __future__ import annotations

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
