"""The files a rank writes beside its training (`--save-plan`, `--limits-out`, the curves PNG, the
metrics file, TensorBoard's): one that cannot be written (a UserError naming the path) is kept and
reported after the result line, never ending the run before it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tpurec.errors import UserError


class SideOutputs:
    """The files written beside the training (plan, limits, curves, metrics): a failure (a UserError
    naming the path) is kept in `failures` and reported after the result line."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        try:
            yield
        except UserError as e:
            self.failures.append(str(e))

    def failed(self, path: str) -> bool:
        return any(str(path) in f for f in self.failures)

    def raise_any(self) -> None:
        if self.failures:
            raise UserError("; ".join(self.failures))
