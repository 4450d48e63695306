"""What the plan decided for one run, frozen and handed to the trainer (decision 13 of the design;
docs/design.md, "The composed engine").

``apr train apply`` plans first (at the world size torchrun started, with a resume's elastic
layout and the device's memory) and hands the run one ``Resolved``: the config after layering,
overrides and layout, the execution policy the plan chose, and the layout change a resume on
another number of ranks makes. The run builds from it and re-derives none of it: it never calls a
``from_config`` default and never edits the config. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from apr.config.schema import AprConfig
from apr.steps.execution import Execution


@dataclass(frozen=True)
class Resolved:
    config: AprConfig  # layered, overridden and laid out (world size, gradient accumulation)
    execution: Execution  # the plan's policy at the config's depth
    world_size: int
    nodes: int
    total_steps: int | None  # None where the data was unreadable (the plan then failed)
    elastic: Mapping | None = None  # a resume on another world size: from/to ranks and accumulation, message

    def execution_at(self, layers: int) -> Execution:
        """The same policy at another depth (progressive stacking's earlier stages)."""
        if layers == self.execution.layers:
            return self.execution
        return Execution.from_dict(self.execution.to_dict(), layers)
