"""The one exception type a user sees: a one-line message that names the fix (exit code 2)."""


class DihalError(Exception):
    """Bad input or an unmet precondition; the CLI prints `error: <message>` and exits 2."""
