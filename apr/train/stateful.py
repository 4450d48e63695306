"""A checkpoint's metadata is the union of the run's registered stateful parts (docs/design.md,
"The composed engine"): each part writes its own keys of the checkpoint's ``meta`` and reads them
back. Save and load iterate the registry, so a new component (a sweep driver, an orchestrator) adds
its state by registering, never by editing a hand-assembled dictionary. The engine's tensors are
not metadata: the checkpoint manager writes them beside it."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass
class Part:
    """One part: ``save() -> {key: value}`` merged into the meta; ``load(meta)`` reads its keys back
    (``None`` for parts that are only recorded, such as the schedule's position)."""

    name: str
    save: Callable[[], dict]
    load: Callable[[dict], None] | None = None


class StateRegistry:
    def __init__(self) -> None:
        self.parts: list[Part] = []

    def register(self, name: str, save: Callable[[], dict], load: Callable[[dict], None] | None = None) -> None:
        if any(p.name == name for p in self.parts):
            raise ValueError(f"a stateful part named {name!r} is already registered")
        self.parts.append(Part(name, save, load))

    def state_dict(self) -> dict:
        meta: dict = {}
        for part in self.parts:
            state = part.save()
            clash = set(state) & set(meta)
            if clash:
                raise ValueError(f"stateful part {part.name!r} writes keys another part wrote: {sorted(clash)}")
            meta.update(state)
        return meta

    def load_state_dict(self, meta: dict, skip: Collection[str] = ()) -> None:
        """Every part reads its keys, in registration order; the parts named in ``skip`` stay as they are."""
        unknown = set(skip) - {p.name for p in self.parts}
        if unknown:
            raise ValueError(f"no stateful part named {sorted(unknown)} to keep")
        for part in self.parts:
            if part.load is not None and part.name not in skip:
                part.load(meta)
