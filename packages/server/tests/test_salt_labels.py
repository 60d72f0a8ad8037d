"""Salt labels of a real `kvdepot serve` (issue 45): keyed with a key file of the server's user
alone, made at the first start and kept across restarts, handed to the owner's engines only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvdepot.core import LABEL_KEY_BYTES, SaltLabeler, salt_label
from kvdepot.server import ServerProcess
from kvdepot.server._label_key import LabelKeyError, load_label_key
from kvdepot.server._process import ServerStartError
from kvdepot.server.testing import free_port, metrics_salt_labels
from kvdepot.transport import CacheClient

pytestmark = pytest.mark.integration

T = 10.0
TENANT = "tenant-42"


def _serve(short_tmp: Path, address: str, *args: str) -> ServerProcess:
    return ServerProcess(
        address,
        capacity="4MiB",
        args=["--page-size", "1MiB", "--pool-dir", str(short_tmp), *args],
        log_path=short_tmp / "server.log",
    )


def _store(address: str, salt: str) -> None:
    with CacheClient(address, timeout=T) as client:
        client.register("layout", 256, 4096).result(T)
        res = client.reserve(salt, [os.urandom(32)], 4096).result(T)
        client.commit(res.reservation_id).result(T)


def _metrics_label(short_tmp: Path, port: int, *args: str) -> str:
    """Start a server with /metrics on ``port``, store a chunk of `TENANT`, read its label, stop."""
    with _serve(short_tmp, f"ipc://{short_tmp}/kvd.sock", "--metrics-port", str(port), *args) as proc:
        _store(proc.address, TENANT)
        labels = metrics_salt_labels(f"http://127.0.0.1:{port}/metrics")
    assert len(labels) == 1, labels
    return labels.pop()


def test_a_key_file_made_owner_only_at_the_first_start_keeps_labels_across_a_restart(short_tmp, monkeypatch):
    """With no flag the key goes to $XDG_STATE_HOME/kvdepot/salt-label.key (0600, in a 0700
    directory); /metrics names the tenant by the keyed label, not the unkeyed digest, and a
    restarted server reads the same file and shows the same label."""
    monkeypatch.setenv("XDG_STATE_HOME", str(short_tmp / "state"))
    key_file = short_tmp / "state" / "kvdepot" / "salt-label.key"
    port = free_port()
    first = _metrics_label(short_tmp, port)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    key = key_file.read_bytes()
    assert len(key) == LABEL_KEY_BYTES
    assert first == SaltLabeler(key)(TENANT)
    assert first != salt_label(TENANT)
    assert _metrics_label(short_tmp, port) == first
    assert key_file.read_bytes() == key
    key_file.unlink()  # deleting it rotates the labels
    assert _metrics_label(short_tmp, port) != first


def test_a_key_file_others_may_read_keeps_the_server_from_starting(short_tmp):
    """A group-readable key file (anyone in the group could reverse the labels) is refused with
    an error that names the file and the flag, and the server exits with a usage error."""
    key_file = short_tmp / "label.key"
    key_file.write_bytes(os.urandom(LABEL_KEY_BYTES))
    key_file.chmod(0o640)
    proc = _serve(short_tmp, f"ipc://{short_tmp}/kvd.sock", "--no-metrics", "--label-key-file", str(key_file))
    with pytest.raises(ServerStartError, match="exited with code 2") as info:
        proc.start(timeout=T)
    assert "--label-key-file" in str(info.value)
    assert str(key_file) in str(info.value)
    assert "mode 640" in str(info.value)
    with pytest.raises(LabelKeyError) as refused:
        load_label_key(key_file)
    assert refused.value.reason == "unsafe"


@pytest.mark.parametrize(
    ("content", "reason"), [(b"", "malformed"), (b"x" * (LABEL_KEY_BYTES + 1), "malformed"), (None, "not_a_file")]
)
def test_a_key_file_that_is_not_a_key_is_refused(short_tmp, content, reason):
    """An empty or over-long file, or a directory where the file should be, is a typed error."""
    path = short_tmp / "label.key"
    if content is None:
        path.mkdir(mode=0o700)
    else:
        path.write_bytes(content)
        path.chmod(0o600)
    with pytest.raises(LabelKeyError) as refused:
        load_label_key(path)
    assert refused.value.reason == reason


def test_the_owners_engines_get_the_key_in_hello_and_others_do_not(short_tmp, make_server):
    """An ipc client (the server's own user) and a tcp client with the shared secret get the key in
    `HelloReply.label_key`; a tcp client of a server without a secret (any local user) gets none."""
    key_file = short_tmp / "label.key"
    flags = ("--no-metrics", "--label-key-file", str(key_file))
    with (
        _serve(short_tmp, f"ipc://{short_tmp}/kvd.sock", *flags) as proc,
        CacheClient(proc.address, timeout=T) as client,
    ):
        assert client.hello().result(T).label_key == key_file.read_bytes()
        assert client.label_key == key_file.read_bytes()
    with (
        _serve(short_tmp, f"tcp://127.0.0.1:{free_port()}", *flags) as proc,
        CacheClient(proc.address, timeout=T) as client,
    ):
        assert client.hello().result(T).label_key == b""
        assert client.label_key == b""
    secured = make_server(address=f"tcp://127.0.0.1:{free_port()}", auth_secret="s3cret", label_key_file=key_file)
    with CacheClient(secured.address, timeout=T, auth_secret="s3cret") as client:
        assert client.hello().result(T).label_key == key_file.read_bytes()


def test_kvdepot_label_prints_the_label_metrics_shows(short_tmp, capsys, monkeypatch):
    """`kvdepot label SALT` reads the server's key file (it never makes one) and prints the label."""
    import io

    from kvdepot.server._cli import main

    key_file = short_tmp / "label.key"
    assert main(["label", "--label-key-file", str(key_file), TENANT]) == 1
    assert "no salt-label key file" in capsys.readouterr().err
    assert not key_file.exists()
    key_file.write_bytes(os.urandom(LABEL_KEY_BYTES))
    key_file.chmod(0o600)
    assert main(["label", "--label-key-file", str(key_file), TENANT]) == 0
    assert capsys.readouterr().out == SaltLabeler(key_file.read_bytes())(TENANT) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{TENANT}\nother\n"))
    assert main(["label", "--label-key-file", str(key_file)]) == 0
    labeler = SaltLabeler(key_file.read_bytes())
    assert capsys.readouterr().out == f"{labeler(TENANT)}\n{labeler('other')}\n"
