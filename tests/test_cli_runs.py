"""The subprocess helper of the CLI tests (tests/cli_runs.py): a run whose rendezvous lost its
port to another process is recognised from torch's own message, so it is started again."""

from __future__ import annotations

import datetime
import socket

import pytest
from torch.distributed import DistNetworkError, TCPStore

from cli_runs import port_taken


def test_a_taken_rendezvous_port_is_recognised_from_torchs_message() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(DistNetworkError) as failed:
            TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=5))
    assert port_taken(str(failed.value)), f"not recognised as a taken port: {failed.value}"
    assert not port_taken("error: hidden_size=256 is not divisible by num_heads=7")
