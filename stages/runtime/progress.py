"""How stages report long work without knowing about terminals: the CLI passes a Progress.

A stage calls start(description, total, unit), then advance(amount, **info) as work completes
(info: numbers worth showing, such as loss=0.23), log(message) for one-off lines, and stop().
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, description: str, total: float, unit: str = "tok") -> None: ...

    def advance(self, amount: float, **info: float) -> None: ...

    def log(self, message: str) -> None: ...

    def stop(self) -> None: ...


class NullProgress:
    def start(self, description: str, total: float, unit: str = "tok") -> None:
        pass

    def advance(self, amount: float, **info: float) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def stop(self) -> None:
        pass
