"""The session's shared torchrun launches (``one_launch.SharedLaunches``): one per world size for the cases of
every selected test module that declares ``LAUNCHES``; and its one-process reference runs, each computed once
(``one_launch.once_per_arguments``)."""

import sys

import pytest

import autoshard.verify
from e2e.one_launch import SharedLaunches, once_per_arguments


@pytest.fixture(scope="session")
def launches(request, tmp_path_factory):
    return SharedLaunches(request.session.items, tmp_path_factory.mktemp("launches"))


@pytest.fixture(scope="session", autouse=True)
def one_reference_run_per_arguments():
    """``verify.train_reference`` with random ops fixed, once per distinct arguments, wherever a module of this
    session holds it (verify's judge, zoo._verdict, the tests' own comparisons)."""
    original = autoshard.verify.train_reference
    once = once_per_arguments(original)
    with pytest.MonkeyPatch.context() as mp:
        for module in list(sys.modules.values()):
            if getattr(module, "train_reference", None) is original:
                mp.setattr(module, "train_reference", once)
        yield
