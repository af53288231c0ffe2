"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on two cores that other work shares, two threads wait for
    each other, and several threads may sum in another order when the machine is loaded (last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
