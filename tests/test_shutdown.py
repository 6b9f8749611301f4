"""``runtime.shutdown``: how every emitted program ends (exit 0 without the interpreter's teardown)."""

import os
import subprocess
import sys


def test_shutdown_exits_0_with_buffered_output_flushed_and_skips_exit_handlers(in_repo):
    """Output still in the buffers (a pipe is block-buffered) reaches the reader; atexit handlers,
    which run in the interpreter's teardown, do not run."""
    code = (
        "import atexit, sys\n"
        "from autoshard.runtime.distributed import shutdown\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "print('last step', end='')\n"
        "sys.stderr.write('to stderr')\n"
        "shutdown()\n"
        "print('after shutdown')\n"
    )
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # so the flush matters
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=in_repo,
        timeout=120,
        check=False,
        env=buffered,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "last step"
    assert proc.stderr.endswith("to stderr")
