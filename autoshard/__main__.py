"""``python -m autoshard``: the same as the ``autoshard`` command."""

from autoshard.cli import entry

entry()
