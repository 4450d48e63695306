"""Per-block ``torch.compile`` (``training.execution.compile``; docs/training.md, "Execution").

Each decoder block, the unit the interleaved engine walks, is compiled on its own; the blocks share
their code, so inductor compiles one graph per mode (forward with or without autograd, recompute)
and reuses it for every block. ``compile_blocks`` compiles block 0 at once on an input of the run's
shape, so a machine that cannot compile (no C++ compiler for inductor on the CPU, no Triton on CUDA)
fails when the engine is built, before any step, with an error that says what to change.

Inductor's compiled graphs are cached in ``apr.track.names.compile_cache_dir()`` (``$APR_HOME``'s
``cache/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set), which outlives the system's /tmp, so
a resume or a second run of the same shape loads them instead of compiling again (docs/design.md,
"Compile when it pays")."""

from __future__ import annotations

import os

import torch

from apr.errors import AprError
from apr.steps.execution import compile_problem
from apr.track.names import compile_cache_dir

HINT = "set training.execution.compile: false (or auto: compiled only where the toolchain works and it pays)"


def compile_blocks(model, device: torch.device, sample_shape: tuple[int, int], dtype: torch.dtype,
                   autocast_ctx, sharded: bool = False) -> None:
    """``torch.compile`` every decoder block in place, then compile block 0 on a ``[batch, seq]``
    input so that a failure surfaces now as an ``AprError``."""
    problem = compile_problem(device.type)
    if problem is not None:
        raise AprError(f"training.execution.compile: {problem}; {HINT}")
    use_compile_cache()
    layers = model.model.layers
    for layer in layers:
        layer.compile(dynamic=False)
    if sharded:  # a block under FSDP2 runs only inside the root's forward (its lazy init, the
        return  # all-gather streams): the first step compiles it (validate checked the toolchain)
    batch, seq = sample_shape
    x = torch.zeros(batch, seq, model.arch.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cos, sin = model.rope(seq, device)
    try:
        with autocast_ctx:
            layers[0](x, cos, sin).float().sum().backward()
    except Exception as err:  # inductor/dynamo raise many types; the message says which
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise AprError(f"training.execution.compile: torch.compile failed on this machine: "
                       f"{type(err).__name__}: {first[:300]}; {HINT}") from None
    for p in layers[0].parameters():
        p.grad = None


def use_compile_cache() -> str:
    """Point inductor at apr's compile cache unless the user chose one (read by inductor when it
    first compiles in this process); returns the folder."""
    folder = str(compile_cache_dir())
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", folder)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
