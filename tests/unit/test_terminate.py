"""SIGTERM reaches a service's stop handler off the signal's own frame: a second SIGTERM
during the first one's handler must not deadlock it (the syncer hung so under SLURM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

SERVICE = textwrap.dedent(
    """
    import threading, time
    from ddiloco.runtime.processes.terminate import on_terminate

    stop, lock, calls = threading.Event(), threading.Lock(), []

    def handler():  # takes a lock, as Event.set() does, and holds it a while
        with lock:
            calls.append(1)
            time.sleep(0.5)
            stop.set()

    on_terminate(handler)
    print("ready", flush=True)
    while not stop.wait(0.01):
        pass
    time.sleep(0.7)  # the second signal's handler runs too
    print("stopped", len(calls), flush=True)
    """
)


def test_two_sigterms_in_a_row_stop_the_service_once_each_never_deadlocked():
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)  # inside the first handler
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and out.strip() == "stopped 2", (out, err)
