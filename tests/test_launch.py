"""apr/launch.py: what torchrun told the process, read without torch."""

from __future__ import annotations

from apr.launch import env_nodes, env_ranks_per_node, env_world_size


def test_the_world_size_and_nodes_come_from_torchruns_environment(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "APR_SHARD_GROUP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert env_world_size() == 1 and env_nodes(1) == 1  # a plain process
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert env_world_size() == 8 and env_ranks_per_node(8) == 4 and env_nodes(8) == 2
    monkeypatch.setenv("APR_SHARD_GROUP_SIZE", "2")  # a test's simulated nodes win over torchrun's
    assert env_nodes(8) == 4
    monkeypatch.setenv("WORLD_SIZE", "eight")
    monkeypatch.setenv("APR_SHARD_GROUP_SIZE", "3")
    assert env_world_size() == 1 and env_nodes(8) == 1  # unreadable or uneven: one node, never a crash
