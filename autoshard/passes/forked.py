"""One computation in a forked process, its answer sent back: what a plan runs on a second core.

The TP proof's degrees (``passes.capturing.tp_proof._each_degree``), the search's candidates priced ahead and the
unit tables its bounds read (``passes.planning.price_ahead``) each hand ``Forked.start`` a computation whose answer
is plain data, and compute it themselves where there is no answer. Both phases use it and neither may import the
other, so it sits beneath them beside ``passes.layouts`` (pyproject.toml's passes contract):

    Forked.start(compute)   None where the machine cannot fork or make a pipe (memory, process limits)
    .result()               compute()'s value, or None if it raised or the process died
    .stop()                 kill it if it is still running, reap it

``os.fork`` itself, not multiprocessing's Process: the capture's child is a daemon, which multiprocessing forbids
to start processes. The forked process ends with ``os._exit`` (no teardown of torch's modules, no buffer flushed
twice), and a pipe leaves nothing to clean up.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Callable
from typing import Any


class Forked:
    """A forked process computing one value, and this process's end of the pipe it answers through."""

    def __init__(self, pid: int, conn) -> None:
        self.pid, self.conn = pid, conn

    @classmethod
    def start(cls, compute: Callable[[], Any]) -> Forked | None:
        try:
            parent_end, child_end = multiprocessing.Pipe(duplex=False)
        except OSError:
            return None
        try:
            pid = os.fork()
        except OSError:
            parent_end.close()
            child_end.close()
            return None
        if pid == 0:  # the forked process
            parent_end.close()
            try:
                answer = compute()
            except BaseException:  # noqa: BLE001 (the caller computes it again and raises what it raises)
                answer = None
            try:
                child_end.send(answer)
            finally:
                os._exit(0)
        child_end.close()
        return cls(pid, parent_end)

    def result(self) -> Any:
        """The forked computation's value, or None if it raised or its process died."""
        try:
            return self.conn.recv()
        except EOFError:
            return None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)  # one that answered is ending anyway
        os.waitpid(self.pid, 0)
        self.conn.close()
