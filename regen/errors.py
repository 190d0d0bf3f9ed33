"""User-facing errors.

A `UserError` is a problem with what the user gave us (config, data, paths, checkpoints).
The CLI prints its message on one line and exits non-zero without a traceback; anything
else is a bug in regen and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user; the message names the problem and where it is."""


class ConfigError(UserError):
    """Invalid configuration: unknown key, wrong type, impossible combination."""


class DataError(UserError):
    """Unreadable or malformed prompt/demonstration data."""


class RunStopped(UserError):
    """The run stopped itself (e.g. no rewards for too long) after saving a checkpoint."""
