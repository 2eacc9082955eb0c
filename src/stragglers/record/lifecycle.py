"""The context-manager shape shared by attach()'s handles: closing is collective on success."""

from __future__ import annotations


class ClosesOnExit:
    """`with attach(...) as rec:` closes on exit; after an exception the close is local only.

    A rank leaving on an error must not enter a collective the others may never reach.
    Subclasses keep their hook handles in `_handles` and release the rest in `_release`.
    """

    _closed = False
    _handles: list

    def close(self, collective: bool = True) -> None:
        """Remove the hooks, then release the rest (flush, close the Recorder: a collective)."""
        if self._closed:
            return
        self._closed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._release(collective)

    def _release(self, collective: bool) -> None:  # pragma: no cover - always overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(collective=exc_type is None)
