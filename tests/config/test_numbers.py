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
    "text,value", [("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("16G", 16 * 2**30), ("512B", 512), ("4MB", 4 * 10**6),
                   (2**30, 2**30), ("2000000", 2_000_000), (2.5e10, 25 * 10**9)]
)
def test_byte_sizes(text, value):
    assert parse_bytes(text) == value


def test_byte_sizes_reject_unknown_units():
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("12 parsecs")


def test_formatting_is_short_and_readable():
    assert format_count(432_063_488) == "432M"
    assert format_bytes(24 * 2**30) == "24.00 GiB"


@pytest.mark.parametrize("bare", [24, "24", "80", 1023, "1_000", 0.0, 2**20 - 1])
def test_bare_numbers_below_a_mebibyte_are_refused_with_a_unit_suggested(bare):
    with pytest.raises(ValueError, match=r"with a unit such as \d+GiB"):
        parse_bytes(bare)


@pytest.mark.parametrize("bad", ["0B", "2EiB", 2**61, -5, float("inf"), float("nan"), "1e400", True])
def test_byte_sizes_are_bounded_and_finite(bad):
    with pytest.raises(ValueError, match="expected"):
        parse_bytes(bad)


@pytest.mark.parametrize("huge", ["1e20", 10**30, "1e400", float("inf"), "99999999999T"])
def test_counts_are_bounded(huge):
    with pytest.raises(ValueError, match="expected"):
        parse_count(huge)
