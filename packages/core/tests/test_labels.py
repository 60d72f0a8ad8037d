"""Salt labels: keyed, so a list of guessed salts does not reverse them."""

from __future__ import annotations

import re

import pytest

from kvdepot.core import LABEL_KEY_BYTES, InvalidArgumentError, SaltLabeler, salt_label

KEY_A = bytes(range(LABEL_KEY_BYTES))
KEY_B = bytes(range(1, LABEL_KEY_BYTES + 1))


def test_a_label_is_keyed_and_stable_under_one_key():
    """Two labelers with one key agree; with another key, or unkeyed, a salt's label differs."""
    label = SaltLabeler(KEY_A)("tenant-42")
    assert re.fullmatch(r"s-[0-9a-f]{16}", label)
    assert SaltLabeler(KEY_A)("tenant-42") == label
    assert SaltLabeler(KEY_B)("tenant-42") != label
    assert label != salt_label("tenant-42")
    assert SaltLabeler(KEY_A)("tenant-43") != label


def test_a_dictionary_of_guesses_without_the_key_does_not_find_the_salt():
    """The unkeyed digest of every guess misses the keyed label (what reversed labels before)."""
    label = SaltLabeler(KEY_A)("tenant-42")
    guesses = {salt_label(f"tenant-{i}"): f"tenant-{i}" for i in range(1000)}
    assert label not in guesses


def test_a_short_key_is_refused_and_never_shown():
    """A key too short to be secret is a typed error; a labeler's repr does not show its key."""
    with pytest.raises(InvalidArgumentError, match="too short"):
        SaltLabeler(b"short")
    assert KEY_A.hex() not in repr(SaltLabeler(KEY_A))
    assert str(KEY_A) not in repr(SaltLabeler(KEY_A))
