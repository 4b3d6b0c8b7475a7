"""How stages report long work without knowing about terminals: the CLI passes a Progress."""
from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, description: str, total: float, unit: str = "tok") -> None: ...

    def advance(self, amount: float) -> None: ...

    def log(self, message: str) -> None: ...

    def stop(self) -> None: ...


class NullProgress:
    def start(self, description: str, total: float, unit: str = "tok") -> None:
        pass

    def advance(self, amount: float) -> None:
        pass

    def log(self, message: str) -> None:
        pass

    def stop(self) -> None:
        pass
