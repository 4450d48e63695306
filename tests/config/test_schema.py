"""apr/config/schema.py: values derived from the architecture, defined once."""

from __future__ import annotations

from apr.config.schema import Architecture


def arch(**over) -> Architecture:
    doc = {"hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": 6, "intermediate_size": 256,
           "vocab_size": 100, "max_position_embeddings": 32}
    return Architecture.model_validate({**doc, **over})


def test_head_dim_is_an_int():
    hd = arch().head_dim
    assert hd == 16 and isinstance(hd, int)


def test_kv_heads_default_to_the_attention_heads():
    assert arch().kv_heads == 6 and arch(num_key_value_heads=2).kv_heads == 2


def test_derived_values_are_not_part_of_the_dumped_config():
    # the config hash and the saved config.yaml hold only what the user wrote
    assert "head_dim" not in arch().model_dump() and "kv_heads" not in arch().model_dump()
