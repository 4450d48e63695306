"""Tests of apr.sweep (a package: test_storage.py shares its name with tests/plan/test_storage.py)."""
