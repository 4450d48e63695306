"""Per-block ``torch.compile`` (``training.execution.compile``; docs/training.md, "Execution").

Each decoder block, the unit the interleaved engine walks, is compiled on its own; the blocks share
their code, so inductor compiles one graph per mode (forward with or without autograd, recompute)
and reuses it for every block. ``compile_blocks`` compiles block 0 at once on an input of the run's
shape, so a machine that cannot compile (no C++ compiler for inductor on the CPU, no Triton on CUDA)
fails when the engine is built, before any step, with an error that says what to change."""

from __future__ import annotations

import torch

from apr.errors import AprError
from apr.steps.execution import compile_problem

HINT = "set training.execution.compile: false"


def compile_blocks(model, device: torch.device, sample_shape: tuple[int, int], dtype: torch.dtype,
                   autocast_ctx, sharded: bool = False) -> None:
    """``torch.compile`` every decoder block in place, then compile block 0 on a ``[batch, seq]``
    input so that a failure surfaces now as an ``AprError``."""
    problem = compile_problem(device.type)
    if problem is not None:
        raise AprError(f"training.execution.compile: {problem}; {HINT}")
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
