"""Blockwise distillation's schedule (``training.mode: distill``), torch-free.

Phase 1 trains student block ``i`` for ``phase1_steps`` optimizer steps, blocks in order, to
reproduce the output of teacher blocks ``[start_i, end_i)`` from their input (the teacher's own
hidden state); phase 2 (every later step) trains the whole student on the KD + LM loss. See
docs/design.md, "Blockwise distillation".
"""

from __future__ import annotations


class MappingError(ValueError):
    """A block mapping that does not cover the teacher's blocks in order."""


def spans(student_depth: int, teacher_depth: int, block_map: list[list[int]] | None) -> list[tuple[int, int]]:
    """Per student block, the teacher blocks ``[start, end)`` it reproduces."""
    if block_map is None:
        if teacher_depth % student_depth:
            raise MappingError(f"the teacher's {teacher_depth} blocks do not split evenly over the student's "
                               f"{student_depth}: give training.distill.block_map")
        k = teacher_depth // student_depth
        return [(i * k, (i + 1) * k) for i in range(student_depth)]
    if len(block_map) != student_depth:
        raise MappingError(f"block_map has {len(block_map)} entries, the student has {student_depth} blocks: "
                           "one [start, end) per student block")
    out, at = [], 0
    for i, pair in enumerate(block_map):
        if len(pair) != 2:
            raise MappingError(f"block_map[{i}] is {pair}: expected [start, end)")
        a, b = int(pair[0]), int(pair[1])
        if a != at or b <= a:
            raise MappingError(f"block_map[{i}] is [{a}, {b}): expected [{at}, end) with end > {at} (the entries "
                               "cover the teacher's blocks in order, each at least one)")
        out.append((a, b))
        at = b
    if at != teacher_depth:
        raise MappingError(f"block_map covers teacher blocks 0-{at - 1}, the teacher has {teacher_depth}")
    return out


def converging(d) -> bool:
    """Whether phase 1 ends each block on its loss (``convergence_target`` / ``convergence_patience``)
    rather than after a fixed ``phase1_steps``."""
    return d is not None and (d.convergence_target is not None or d.convergence_patience is not None)


def block_steps(d) -> int:
    """The most optimizer steps one block trains in phase 1: ``phase1_steps``, or with convergence
    stopping ``convergence_max_steps`` (default ``phase1_steps``)."""
    if d is None:
        return 0
    return d.convergence_max_steps if converging(d) and d.convergence_max_steps is not None else d.phase1_steps


def phase1_steps(config) -> int:
    """Optimizer steps of phase 1 (with convergence stopping: the most it can take): ``block_steps``
    per student block."""
    return block_steps(config.training.distill) * config.model.architecture.num_hidden_layers


def phase_at(config, step: int) -> tuple[int, int | None]:
    """(1, student block) in phase 1, (2, None) after, for optimizer step ``step`` (1-based), with
    fixed ``phase1_steps``; with convergence stopping the phase is the run's own state
    (``apr.train.distill.Progress``)."""
    d = config.training.distill
    if d is None or step > phase1_steps(config):
        return 2, None
    return 1, (step - 1) // d.phase1_steps
