"""Tokenizer training, pretokenizing to Parquet shards, and the resumable shard loader."""
