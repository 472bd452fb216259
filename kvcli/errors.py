"""The one error type the CLI turns into a clear line and exit code 1."""


class KvcliError(Exception):
    """A user-facing failure: bad input, missing file, unsupported model. One line, no traceback."""
