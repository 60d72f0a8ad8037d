import pytest

from kvdepot.core import InvalidArgumentError
from kvdepot.vllm_connector._config import DEFAULT_TIMEOUT, KEYS, ConnectorConfig


def test_defaults():
    """No extra config: the local default address, default timeouts, no server started."""
    config = ConnectorConfig.from_extra_config(None)
    assert config.address is None
    assert config.timeout == DEFAULT_TIMEOUT
    assert config.chunk_size == 256
    assert config.start_server is False


def test_kvdepot_keys():
    """kvdepot.* keys set every field."""
    config = ConnectorConfig.from_extra_config(
        {
            "kvdepot.address": "tcp://127.0.0.1:7000",
            "kvdepot.timeout": "2.5",
            "kvdepot.lookup_timeout": 0.25,
            "kvdepot.heartbeat_interval": 1,
            "kvdepot.chunk_size": 512,
            "kvdepot.start_server": "false",
            "kvdepot.auth": "s3cret",
            "kvdepot.test.fail_loads": True,
        }
    )
    assert config.address == "tcp://127.0.0.1:7000"
    assert (config.timeout, config.lookup_timeout, config.heartbeat_interval) == (2.5, 0.25, 1.0)
    assert config.chunk_size == 512
    assert config.start_server is False
    assert config.auth == "s3cret"
    assert config.fail_loads is True


def test_lmcache_mp_keys_are_accepted():
    """LMCache MP's host, port, timeout and heartbeat keys map onto kvdepot's."""
    config = ConnectorConfig.from_extra_config(
        {
            "lmcache.mp.host": "localhost",
            "lmcache.mp.port": 6555,
            "lmcache.mp.mq_timeout": 3,
            "lmcache.mp.heartbeat_interval": 4,
        }
    )
    assert config.address == "tcp://localhost:6555"
    assert config.timeout == 3.0
    assert config.heartbeat_interval == 4.0


def test_lmcache_backend_starts_a_server_sized_by_offloading():
    """With the lmcache backend and no address, a local server is started with --kv-offloading-size GiB."""
    config = ConnectorConfig.from_extra_config({}, lmcache_backend=True, offloading_gib=4.0)
    assert config.start_server is True
    assert config.capacity == "4GiB"
    explicit = ConnectorConfig.from_extra_config({"kvdepot.address": "ipc:///x"}, lmcache_backend=True)
    assert explicit.start_server is False


@pytest.mark.parametrize(
    "extra",
    [
        {"kvdepot.adress": "ipc:///typo"},
        {"kvdepot.timeout": "soon"},
        {"kvdepot.timeout": -1},
        {"kvdepot.chunk_size": 0},
        {"kvdepot.chunk_size": "256"},
        {"kvdepot.start_server": "maybe"},
        {"lmcache.mp.unknown": 1},
    ],
)
def test_bad_settings_raise_typed_errors(extra):
    """Typos and bad values are refused with InvalidArgumentError naming the key."""
    with pytest.raises(InvalidArgumentError) as info:
        ConnectorConfig.from_extra_config(extra)
    assert any(key in str(info.value) for key in extra)


def test_every_key_is_documented():
    """Every accepted key appears in docs/vllm.md."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "vllm.md").read_text()
    assert all(f"`{key}`" in doc for key in KEYS)
