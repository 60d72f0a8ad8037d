"""`kvdepot serve` as a build one tier format ahead of this one would run: it writes objects of
format ``FORMAT_VERSION + 1`` (the same layout) and reads this build's as an older version it
knows. Run as a script, with `kvdepot serve`'s arguments; the rolling-upgrade tests start it."""

from __future__ import annotations

import sys

from kvdepot.server import _tier_format

_tier_format.OLDER_VERSIONS = frozenset({*getattr(_tier_format, "OLDER_VERSIONS", ()), _tier_format.FORMAT_VERSION})
_tier_format.FORMAT_VERSION += 1

from kvdepot.server._cli import main  # noqa: E402 - after the format is moved ahead

sys.exit(main(sys.argv[1:]))
