"""Sizes with units, as typed on the command line."""

from __future__ import annotations

import pytest

from kvdepot.server import ServerArgumentError, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64GiB", 64 << 30), ("512M", 512 << 20), ("1.5g", 3 << 29), ("2kb", 2000), ("8 MiB", 8 << 20)],
)
def test_parse_size_reads_units(text, expected):
    """Binary and decimal units and bare byte counts are understood."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "12 parsecs", "1e9"])
def test_parse_size_rejects_garbage_with_an_example(text):
    """Unreadable sizes raise an argument error whose message shows a valid example."""
    with pytest.raises(ServerArgumentError, match="64GiB"):
        parse_size(text)


def test_format_size_is_short():
    """Byte counts print with a binary unit."""
    assert format_size(64 << 30) == "64.0 GiB"
    assert format_size(17) == "17 B"
