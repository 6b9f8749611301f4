"""User-facing errors.

Every mistake a user can make (a bad model file, an invalid cluster, a plan that does not
fit) raises :class:`AutoshardError` with one line that names the problem and the fix. The
CLI prints that line and exits with status 2; ``--debug`` shows the traceback.
Internal invariants use ``assert`` instead: those are our bugs, not the user's.
"""


class AutoshardError(ValueError):
    """A problem in the user's input, stated in one line with the fix."""

    exit_code = 2

    def __init__(self, message: str):
        assert "\n" not in message.strip(), "user errors are one line"
        super().__init__(message.strip())
