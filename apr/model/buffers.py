"""Moved to ``apr.memory.buffers`` (issue 46: one torch-free memory package). These names stay
importable from here until apr/train imports them from there; then this file goes."""

from apr.memory.buffers import (  # noqa: F401
    Buffer,
    autograd_buffers,
    buffer_plan,
    compute_dtype_name,
    frozen_buffers,
    fsdp2_buffers,
    optimizer_state_details,
    sharded,
    source_buffers,
    step_buffers,
    uses_compute_copy,
    walk_buffers,
)
