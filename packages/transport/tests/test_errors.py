"""Unit tests of the error tree."""

from __future__ import annotations

import pytest

import kvdepot.transport as t
from kvdepot.core import InvalidArgumentError, KVDepotError
from kvdepot.transport._errors import ERROR_CLASSES, ERROR_CODES, remote_error


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_every_code_maps_to_its_class(code: str) -> None:
    """remote_error builds the subclass registered for each code, with fields as attributes."""
    exc = remote_error(code, "message", {"lease_id": 3})
    assert type(exc) is ERROR_CLASSES[code]
    assert exc.code == code
    assert exc.lease_id == 3
    assert isinstance(exc, t.RemoteError)
    assert isinstance(exc, t.TransportError)
    assert isinstance(exc, KVDepotError)


def test_unknown_codes_keep_their_name() -> None:
    """A code from a newer server becomes a plain RemoteError that still carries the code."""
    exc = remote_error("brand_new", "m", {"code": "shadow"})
    assert type(exc) is t.RemoteError
    assert exc.code == "brand_new"


def test_whose_fault_hierarchy() -> None:
    """The classes say who is at fault and fit the standard exception types."""
    assert issubclass(t.RemoteInvalidArgumentError, InvalidArgumentError)
    assert issubclass(t.DeadlineExceededError, TimeoutError)
    assert not issubclass(t.LocalProtocolError, t.RemoteProtocolError)
    assert not issubclass(t.TransportClosedError, t.TransportBrokenError)
