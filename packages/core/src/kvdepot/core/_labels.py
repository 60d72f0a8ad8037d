"""Public names for secret things: what kvdepot shows of a cache salt wherever others can read it."""

from __future__ import annotations

import hashlib
import hmac

import attrs

from kvdepot.core._errors import InvalidArgumentError

#: Bytes of the key a deployment's server makes for its labels (random; see `SaltLabeler`).
LABEL_KEY_BYTES = 32
#: A shorter key is refused: it could be guessed along with the salts.
MIN_LABEL_KEY_BYTES = 16
#: Hex digits of the HMAC a label keeps: 64 bits, so that thousands of salts never share one.
LABEL_HEX_DIGITS = 16


def salt_label(salt: str) -> str:
    """``s-`` and 12 hex digits of the unkeyed SHA-256 of ``salt``.

    Unkeyed, so anyone can compute it: a dictionary of guessable salts (``tenant-42``, user
    ids) reverses it. kvdepot names salts with a `SaltLabeler` (keyed) wherever others read
    them; this stays for readers of labels written by earlier versions.
    """
    return "s-" + hashlib.sha256(salt.encode()).hexdigest()[:12]


def _check_key(instance: object, attribute: object, key: bytes) -> None:
    if len(key) < MIN_LABEL_KEY_BYTES:
        raise InvalidArgumentError(
            f"a salt-label key of {len(key)} bytes is too short to keep labels secret; use at least "
            f"{MIN_LABEL_KEY_BYTES} random bytes (a kvdepot server makes {LABEL_KEY_BYTES})",
            length=len(key),
        )


@attrs.frozen
class SaltLabeler:
    """Names a cache salt by ``s-`` and `LABEL_HEX_DIGITS` hex digits of HMAC-SHA256(key, salt).

    How /metrics, a server's Stats to peers that are not its owner, its logs and the engines'
    KV events name a tenant. A salt is a tenant's secret (it isolates the tenant's chunks) and
    those are readable by every local user or subscriber: keyed with a secret of the deployment
    (the server's label key, which it hands to its owner's engines in `HelloReply.label_key`),
    a label is stable wherever that key is, and nobody without the key can tell which salt it
    names, even from a list of guesses. ``labeler(salt)`` is the label.
    """

    key: bytes = attrs.field(repr=False, validator=_check_key)
    _mac: hmac.HMAC = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_mac", hmac.new(self.key, digestmod=hashlib.sha256))

    def __call__(self, salt: str) -> str:
        mac = self._mac.copy()  # the key's inner and outer pads hashed once, not per salt
        mac.update(salt.encode())
        return "s-" + mac.hexdigest()[:LABEL_HEX_DIGITS]
