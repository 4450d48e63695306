"""Multi-head latent attention on two data-parallel ranks (CPU, gloo) through the flat-buffer walk:
DDP's all-reduce and FSDP2's shards of the latent projections equal one process accumulating the
same micro-batches."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "train"))
from run_helpers import make_dataset  # noqa: E402

from tests.distributed.ranks import two_ranks_against_one  # noqa: E402

MLA = {"num_key_value_heads": None, "attention": {"kind": "mla", "kv_lora_rank": 6, "qk_rope_head_dim": 4,
                                                  "q_lora_rank": 8}}


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "full"])  # the layout in the id (apr/steps/composition.py)
def test_latent_attention_on_two_ranks_equals_one_process_accumulating_the_same_micro_batches(tmp_path, sharding):
    make_dataset(tmp_path, train_rows=96)
    a, _ = two_ranks_against_one(tmp_path, sharding, {"engine": "interleaved"}, model={"architecture": MLA})
    assert any(".self_attn.kv_b_proj.weight" in k for k in a)
