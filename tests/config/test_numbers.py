import pytest

from apr.config.numbers import parse_bytes, parse_count
from apr.fmt import format_bytes, format_count


@pytest.mark.parametrize(
    "text,value",
    [(32768, 32768), ("32_768", 32768), ("32768", 32768), ("512K", 512_000), ("10B", 10**10),
     ("1.5M", 1_500_000), ("1e6", 1_000_000), ("2k", 2000), (4.0, 4)],
)
def test_counts_accept_shorthand(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("bad", [True, "abc", "1.5", "10X", "", None, [1], 2.5, "1.2345K"])
def test_counts_reject_non_counts(bad):
    with pytest.raises(ValueError, match="expected"):
        parse_count(bad)


@pytest.mark.parametrize(
    "text,value", [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("16G", 16 * 2**30), (1024, 1024)]
)
def test_byte_sizes(text, value):
    assert parse_bytes(text) == value


def test_byte_sizes_reject_unknown_units():
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("12 parsecs")


def test_formatting_is_short_and_readable():
    assert format_count(432_063_488) == "432M"
    assert format_bytes(24 * 2**30) == "24.00 GiB"
