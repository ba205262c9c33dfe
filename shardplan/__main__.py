"""``python -m shardplan``: the command line."""

from shardplan.tools.cli import _entry

_entry()
