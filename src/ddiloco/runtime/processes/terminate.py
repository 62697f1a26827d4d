"""A clean stop asked of a service: SIGTERM, or its host's call where a signal cannot land.

``ddiloco syncer`` and ``ddiloco learner`` end cleanly on SIGTERM (the syncer with its summary,
a learner with a goodbye). Python takes signals only on the main thread; a process hosted on
another thread (a Ray actor's method runs on one of the actor's threads) registers the same
handler here instead, and its host calls :func:`terminate` to deliver it.

A signal handler takes no lock: Python runs it on the main thread between two bytecodes, so
one that calls ``Event.set()`` deadlocks when the signal lands while that thread holds the
event's lock, which is what a second SIGTERM a moment after the first does (``scancel
--full`` signals the job's shell, whose trap signals the service again): the second handler
runs inside the first one's ``set()`` and waits for its lock for ever, while the network
thread keeps the learners' links alive (CI saw a syncer hang so for 2 minutes). The handler
only writes a byte to a pipe; a thread of its own reads it and calls the handler there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable

_handlers: list[Callable[[], None]] = []
_lock = threading.Lock()


def on_terminate(handler: Callable[[], None]) -> None:
    """Call ``handler`` on SIGTERM (on the main thread), else on :func:`terminate`."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _relayed(handler))
        return
    with _lock:
        _handlers.append(handler)


def _relayed(handler: Callable[[], None]) -> Callable[..., None]:
    """A signal handler that only writes to a pipe, and the thread that calls ``handler``
    for each byte read from it."""
    read, write = os.pipe()
    os.set_blocking(write, False)  # (a full pipe: signals enough are already on their way)

    def relay() -> None:
        while os.read(read, 1):
            handler()

    threading.Thread(target=relay, name="sigterm", daemon=True).start()

    def on_signal(*_: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(write, b"t")

    return on_signal


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
