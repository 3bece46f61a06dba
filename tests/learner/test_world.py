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


def test_a_command_waits_past_timeout_s_and_giving_one_never_waits_for_a_reader():
    """Names travel through the store: rank 0 sets a key whether or not a rank reads it (a
    broadcast would wait for a stopped rank's recv), and a rank waits for the next name
    longer than ``timeout_s`` (rank 0 may evaluate for minutes between commands)."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from turnrl.learner.world import World, store_client

    served = rendezvous_store(2, timeout_s=1)
    client = store_client("127.0.0.1", served.port, 2, timeout_s=1)
    leader, follower = (World(rank, 2, "fsdp", torch.device("cpu"), 1.0,
                              dist.PrefixStore("run/", store))
                        for rank, store in ((0, served), (1, client)))
    started = time.monotonic()
    leader.command("gather")  # nobody reads it yet: returns at once
    assert time.monotonic() - started < 1
    assert follower.receive() == ("gather", None)
    timer = threading.Timer(2.5, leader.command, args=("stop",))
    timer.start()
    started = time.monotonic()
    try:
        assert follower.receive() == ("stop", None)
    finally:
        timer.join()
    assert time.monotonic() - started >= 2  # past timeout_s (1 s), still waiting
