"""dihal.cli: the `dihal` command (Typer, thin). main.py is the place to start reading."""
