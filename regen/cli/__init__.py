"""The `regen` command line (main.py: the verbs and their options; eval.py: `regen eval`)."""

from regen.cli.main import main

__all__ = ["main"]
