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


class ModuleHeaders:
    """Under `-q` pytest prints only dots, and under xdist not even the file names: name each test module
    (and the worker running it) when its first test starts, so a run shows where it is. A line of dots
    a header ends gets its progress (`[ 42%]`) at the right edge first, as pytest ends a full line."""

    def __init__(self, config):
        self.config = config
        self.current: dict = {}  # worker id ("" in one process) -> the module it is running

    def pytest_runtest_logreport(self, report):
        if report.when != "setup":
            return
        module = report.nodeid.split("::")[0]
        node = getattr(report, "node", None)  # xdist: the worker that ran the test
        worker = node.gateway.id if node is not None else ""
        if self.current.get(worker) != module:
            self.current[worker] = module
            reporter = self.config.pluginmanager.getplugin("terminalreporter")
            if reporter._tw.width_of_current_line:  # after a line of dots: its progress, then a new line
                progress = getattr(reporter, "_write_progress_information_filling_space", None)  # pytest's own
                if progress is not None and getattr(reporter, "_show_progress_info", False):
                    progress()
                reporter.write("\n")
            reporter.write_line(f"[{worker}] {module}" if worker else module)


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: its controller reports
        return
    xdist = (getattr(config.option, "numprocesses", None) or 0) > 0 if config.pluginmanager.has_plugin("xdist") else False
    verbose = config.option.verbose
    if verbose < 0 or (verbose == 0 and xdist):  # else pytest names the modules (or the tests) itself
        config.pluginmanager.register(ModuleHeaders(config), "module-headers")
