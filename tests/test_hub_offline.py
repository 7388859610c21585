"""A hub id fails fast when the hub is unreachable; the probe still says yes when something answers."""

import socket
import time

import pytest

from kvviz.runtime import models
from kvviz.runtime.models import ModelError, hub_reachable, load_model


@pytest.fixture
def closed_endpoint(monkeypatch):
    """A hub endpoint on a loopback port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "_hub_probes", {})


def test_a_hub_id_fails_at_once_when_the_hub_is_unreachable(closed_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty local cache
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import kvviz.cache.capture  # noqa: F401 - imports (slow on a loaded machine) are not what this test times

    started = time.monotonic()
    with pytest.raises(ModelError, match="not reachable from this server"):
        load_model("nobody-here/no-such-model", device="cpu")
    assert time.monotonic() - started < 10


def test_the_probe_sees_a_listening_hub_and_honours_offline_mode(monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setattr(models, "_hub_probes", {})
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        assert hub_reachable()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert not hub_reachable()
