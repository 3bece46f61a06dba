"""Where learner ranks meet (turnrl/learner/world.py): the rendezvous store rank 0 (or a
launcher) serves, bound before any rank starts."""

from __future__ import annotations

import socket

import pytest

from turnrl.config import ConfigError
from turnrl.learner.world import rendezvous_store


def test_the_store_keeps_the_port_the_os_chose():
    """Port 0: the OS picks one, and it stays bound while the store lives (a port probed free
    and released could be taken before the ranks bind it)."""
    store = rendezvous_store(2, timeout_s=30)
    assert store.port > 0
    with pytest.raises(OSError), socket.create_server(("0.0.0.0", store.port)):
        pass
    store.set("key", b"value")
    assert store.get("key") == b"value"


def test_a_given_port_in_use_is_one_line_naming_learner_port():
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"learner.port {port} is in use") as err:
            rendezvous_store(2, timeout_s=30, port=port)
    assert "\n" not in str(err.value) and "learner.port at 0" in str(err.value)
