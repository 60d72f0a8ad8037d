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


def test_values_as_a_command_line_writes_them():
    """Numbers and booleans may come as strings, booleans also as yes/no or on/off in any case;
    an explicit null start_server means its default."""
    config = ConnectorConfig.from_extra_config(
        {
            "kvdepot.lookup_timeout": "0.5",
            "kvdepot.load_step_share": "1",
            "kvdepot.prefault_pool": "Off",
            "kvdepot.test.fail_loads": "YES",
            "kvdepot.test.load_delay": 2,
            "kvdepot.start_server": None,
            "lmcache.mp.host": "tcp://10.0.0.1",
            "lmcache.mp.port": "6000",
        },
        lmcache_backend=True,
    )
    assert (config.lookup_timeout, config.load_step_share, config.load_delay) == (0.5, 1.0, 2.0)
    assert (config.prefault_pool, config.fail_loads) == (False, True)
    assert config.address == "tcp://10.0.0.1:6000"
    assert config.start_server is False  # an address is set
    assert ConnectorConfig.from_extra_config({"kvdepot.start_server": "on"}).start_server is True


@pytest.mark.parametrize(
    ("extra", "allowed"),
    [
        ({"kvdepot.timeout": True}, "a positive number of seconds"),
        ({"kvdepot.lookup_timeout": "nan"}, "a positive number of seconds"),
        ({"kvdepot.load_step_share": 1.5}, "more than 0 and at most 1"),
        ({"kvdepot.load_step_share": "0"}, "more than 0 and at most 1"),
        ({"kvdepot.prefault_pool": 2}, "a boolean"),
        ({"kvdepot.test.fail_loads": None}, "a boolean"),
        ({"kvdepot.chunk_size": 256.0}, "a positive int"),
        ({"lmcache.mp.port": "abc"}, "a port number"),
        ({"lmcache.mp.port": 70000}, "a port number"),
        ({"lmcache.mp.mq_timeout": "soon"}, "a positive number of seconds"),
    ],
)
def test_bad_values_name_the_key_and_what_it_allows(extra, allowed):
    """A value of the wrong type or out of range is refused with InvalidArgumentError that names
    the key as given (an LMCache key too) and says what the key allows."""
    (key,) = extra
    with pytest.raises(InvalidArgumentError, match=f"^{key} must be .*{allowed}") as info:
        ConnectorConfig.from_extra_config(extra)
    assert info.value.key == key


def test_a_null_secret_is_no_secret():
    """`kvdepot.auth: null` in a JSON config means no secret, not the secret "None"."""
    assert ConnectorConfig.from_extra_config({"kvdepot.auth": None}).auth == ""
    assert ConnectorConfig.from_extra_config({"kvdepot.auth": "s3cret"}).auth == "s3cret"
