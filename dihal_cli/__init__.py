"""The `dihal` command line (Typer). Thin: parses flags, calls stages/, prints results."""
