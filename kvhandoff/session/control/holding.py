"""Per-thread holding blocks: what a thread hands over inside one waits for its end.

:class:`~kvhandoff.session.control.write_batch.WriteBatcher` (prefill's writes) and
:class:`~kvhandoff.session.control.post_batch.PostBatcher` (decode's control messages) both hold
what the calling thread produces while it is inside ``held()``, and let it go when the
outermost block exits; the blocks nest and count per thread (another thread is never
held by them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class Holding(threading.local):
    """How deep the calling thread is in nested holding blocks."""

    depth = 0

    @property
    def active(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def block(self, release: Callable[[], None]) -> Iterator[None]:
        """A holding block for the calling thread: ``release`` runs when the outermost
        one exits (however it exits)."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth:
                release()
