"""Public names for secret things: what kvdepot shows of a cache salt wherever others can read it."""

from __future__ import annotations

import hashlib


def salt_label(salt: str) -> str:
    """``s-`` and 12 hex digits of the SHA-256 of ``salt``: how /metrics and KV events name a tenant.

    A salt is a tenant's secret (it isolates the tenant's chunks), and /metrics and the KV event
    streams are readable by every local user or subscriber; the label is stable and not reversible.
    """
    return "s-" + hashlib.sha256(salt.encode()).hexdigest()[:12]
