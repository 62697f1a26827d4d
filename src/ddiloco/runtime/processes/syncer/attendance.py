"""Who the syncer has heard from, who it gave up on and since when: the run's uptime and
the learner time lost to outages, for the summary's goodput.

A learner silent for ``detect_seconds`` is overdue: the service stops waiting for it, and
its down time starts ``detect_seconds`` back (when it went silent). It ends when a new life
of it says hello, else at the end of the run. Call order: :meth:`heard` for every message,
:meth:`overdue` once a beat, :meth:`change` before every membership change (with the number
live until then), :meth:`back` on a hello.
"""

from __future__ import annotations

from collections.abc import Iterable

from ddiloco.report.summary import Uptime


class Attendance:
    def __init__(self, quorum: int, detect_seconds: float) -> None:
        self.detect_seconds = detect_seconds
        self.last_heard: dict[int, float] = {}
        self.down_since: dict[int, float] = {}  # learner -> since when, for the given up
        self.down_seconds = 0.0  # of outages that ended
        self.uptime = Uptime(quorum, start=None)  # counted from the first hello

    def heard(self, m: int, now: float) -> None:
        self.last_heard[m] = now

    def change(self, now: float, live: int) -> None:
        """Time with at least a quorum of ``live`` learners is up."""
        self.uptime.account(now, live)

    def back(self, m: int, now: float) -> None:
        """A new life of ``m`` said hello: its outage, if any, ends now."""
        if m in self.down_since:
            self.down_seconds += now - self.down_since.pop(m)

    def overdue(self, live: Iterable[int], now: float) -> list[int]:
        """The live learners silent for ``detect_seconds``, now counted down (the caller
        gives each up, after a :meth:`change`)."""
        late = [m for m in sorted(live) if now - self.last_heard.get(m, now) > self.detect_seconds]
        for m in late:
            self.down_since[m] = now - self.detect_seconds
        return late

    def down_total(self, now: float) -> float:
        """Learner-seconds lost to outages so far, the open ones counted up to ``now``."""
        return self.down_seconds + sum(now - s for s in self.down_since.values())
