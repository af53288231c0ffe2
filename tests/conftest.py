"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread_for_the_suite():
    """The suite's models are small: one intra-op thread is the fastest on two cores that other work shares
    (two threads wait for each other there); tests that need more set it themselves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on two cores that other work shares, two threads wait for
    each other, and several threads may sum in another order when the machine is loaded (last bits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
