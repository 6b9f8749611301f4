"""The session's shared torchrun launches (``one_launch.SharedLaunches``): one per world size for the cases of
every selected test module that declares ``LAUNCHES``."""

import pytest

from e2e.one_launch import SharedLaunches, timing_lines


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory):
    return SharedLaunches(request.session.items, tmp_path_factory.mktemp("launches"))


def pytest_terminal_summary(terminalreporter):
    for line in timing_lines():
        terminalreporter.write_line(line)
