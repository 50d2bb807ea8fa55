"""Lab hosts keep their SSH port across `docker stop` / `docker start` (issue 38, item 5).

Docker keeps a published port only when the host port is named (`-p 127.0.0.1:PORT:22`); with
`-p 127.0.0.1::22` it allocates a new one at every start. The container itself is exercised by
`mlafleet lab up` in the molecule scenarios; here, what `up` asks Docker for.
"""

from __future__ import annotations

import socket

from mlafleet.lab import containers as lab


def test_ssh_is_published_on_a_named_port():
    port = lab.free_local_port()
    args = lab.ssh_publish_args(port)
    assert args == ["-p", f"127.0.0.1:{port}:22"]
    host, named, container = args[1].split(":")
    assert host == "127.0.0.1" and named.isdigit() and int(named) > 0 and container == "22"


def test_the_port_chosen_is_free_on_loopback():
    port = lab.free_local_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # would raise if something held it
    assert 1024 <= port <= 65535


def test_up_publishes_ssh_on_a_named_port():
    import inspect

    source = inspect.getsource(lab.up)
    assert "ssh_publish_args(free_local_port())" in source and "127.0.0.1::22" not in source
