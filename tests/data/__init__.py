"""Tests of apr.data and `apr data ...`."""
