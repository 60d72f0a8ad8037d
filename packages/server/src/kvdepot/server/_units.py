"""Byte sizes with units, as operators type them (`64GiB`, `512M`, `1.5g`, `4096`)."""

from __future__ import annotations

import re

from kvdepot.server._errors import ServerArgumentError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
#: The largest size accepted (1 EiB): anything larger is a typo.
MAX_SIZE = 2**60
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional unit (KiB/MiB/GiB/TiB, K/M/G/T = binary, KB/MB/GB/TB = decimal)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ServerArgumentError(
            f"cannot read {text!r} as a size; write a number with an optional unit, e.g. 64GiB, 512MiB or 4096",
            text=text,
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not value < MAX_SIZE:  # also inf, for hundreds of digits
        raise ServerArgumentError(f"{text!r} is more bytes than any machine has (at most 2**60)", text=text)
    return int(value)


def format_size(size: float) -> str:
    """A short human form of a byte count: `64.0 GiB`, `512.0 MiB`, `17 B`."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
