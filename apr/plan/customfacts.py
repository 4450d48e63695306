"""What `apr train validate` and `apr train plan` refuse about the custom objective (``training.mode:
custom``, apr/train/losses.py ``CustomTargets``; docs/training.md, "Custom targets").

Validate checks the config (torch-free, no data read): the mode and its section go together; the
loss runs on autograd only (the flat-buffer walk fuses the next-token loss into its head step); what
is not built for targets beside the ids (FSDP2's validation, mixtures, the trunk's cache) is refused.
The plan also reads the Parquet footers of ``data.train`` and ``data.val``: every shard must hold
the targets column, a list of integers as long as its token rows.
"""

from __future__ import annotations

import os
from functools import partial

from apr.config import LoadedConfig
from apr.data.loader import check_shard
from apr.data.shards import shard_files
from apr.errors import AprError, Finding
from apr.plan.keyfacts import key_error
from apr.steps.execution import gradient_source

_finding = partial(key_error, code="config.custom")


def custom_config_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    tr = c.training
    if str(tr.mode) != "custom":
        return [_finding(loaded, ("training", "custom"), f"training.custom is set but training.mode is {tr.mode}",
                         "mode: custom", str(tr.mode))] if tr.custom is not None else []
    if tr.custom is None:
        return [_finding(loaded, ("training", "mode"), "training.mode custom needs a training.custom section (at "
                         "least its targets_column)", "training.custom.targets_column", "none")]
    stacking = c.model.stacking
    not_built = "not built for targets beside the ids: "
    checks = [
        (gradient_source(c) == "interleaved", ("training", "engine"), "the custom loss runs on autograd: the "
         "flat-buffer walk (training.engine: interleaved) fuses the causal-LM loss, every position's next id, "
         "into its head step", "training.engine: standard", str(tr.engine)),
        (stacking is not None and stacking.cache_activations, ("model", "stacking", "cache_activations"),
         not_built + "the trunk's cache reads token rows only", "cache_activations: false", "true"),
    ]
    return [_finding(loaded, key, message, expected, got) for bad, key, message, expected, got in checks if bad]


def custom_findings(loaded: LoadedConfig) -> list[Finding]:
    """The plan's: ``custom_config_findings`` and, where the config passes, every training and
    validation shard holds ``training.custom.targets_column`` with rows of ``seq_len + 1`` integers
    (the footer's schema and value count; the values themselves are checked as the loader reads them)."""
    c = loaded.config
    if str(c.training.mode) != "custom" and c.training.custom is None:
        return []
    out = custom_config_findings(loaded)
    if out:
        return out
    column, width = c.training.custom.targets_column, c.data.seq_len + 1
    for _key, path in [*c.data.train_paths(), *c.data.val_paths()]:
        for shard in shard_files(os.path.expanduser(path)):
            try:
                check_shard(shard, column, width, key="training.custom.targets_column")
            except AprError as err:
                out += err.findings
                break  # one finding per folder
    return out
