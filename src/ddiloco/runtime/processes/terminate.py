"""A clean stop asked of a service: SIGTERM, or its host's call where a signal cannot land.

``ddiloco syncer`` and ``ddiloco learner`` end cleanly on SIGTERM (the syncer with its summary,
a learner with a goodbye). Python takes signals only on the main thread; a process hosted on
another thread (a Ray actor's method runs on one of the actor's threads) registers the same
handler here instead, and its host calls :func:`terminate` to deliver it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

_handlers: list[Callable[[], None]] = []
_lock = threading.Lock()


def on_terminate(handler: Callable[[], None]) -> None:
    """Call ``handler`` on SIGTERM (on the main thread), else on :func:`terminate`."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: handler())
        return
    with _lock:
        _handlers.append(handler)


def terminate() -> int:
    """Deliver a clean stop to every handler registered off the main thread; how many."""
    with _lock:
        handlers = list(_handlers)
    for handler in handlers:
        handler()
    return len(handlers)


def forget() -> None:
    """Drop the handlers of a process that ended (its host may start another)."""
    with _lock:
        _handlers.clear()
