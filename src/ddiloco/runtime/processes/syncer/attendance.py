"""Who the syncer has heard from, who it gave up on and since when: the run's uptime and
the learner time lost to outages, for the summary's goodput.

A learner silent for ``detect_seconds`` is overdue: the service stops waiting for it, and
its down time starts ``detect_seconds`` back (when it went silent). A new life that says
hello before its old one was given up (a quick restart) is down from the old life's last
message. Either way the outage ends when the learner contributes again (the first merge
with an answer of it), not when it says hello: copying a peer and training its first sync
period are still lost capacity. Else it ends at the end of the run. Call order:
:meth:`heard` for every message, :meth:`overdue` once a beat, :meth:`change` before every
membership change (with the number live until then), :meth:`back` on a hello,
:meth:`contributed` after every merge.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ddiloco.report.summary import Uptime


class Attendance:
    def __init__(self, quorum: int, detect_seconds: float) -> None:
        self.detect_seconds = detect_seconds
        self.last_heard: dict[int, float] = {}
        self.heard_before: dict[int, float] = {}  # the message before the last, per learner
        self.down_since: dict[int, float] = {}  # learner -> since when, for the given up
        self.returning: dict[int, float] = {}  # back, not merged yet: since when it is down
        self.down_seconds = 0.0  # of outages that ended
        self.uptime = Uptime(quorum, start=None)  # counted from the first hello

    def heard(self, m: int, now: float) -> None:
        if m in self.last_heard:
            self.heard_before[m] = self.last_heard[m]
        self.last_heard[m] = now

    def change(self, now: float, live: int) -> None:
        """Time with at least a quorum of ``live`` learners is up."""
        self.uptime.account(now, live)

    def back(self, m: int, restarted: bool) -> None:
        """``m`` said hello (``restarted``: a new life of a learner the run had): down,
        if it was, until it contributes."""
        since = self.down_since.pop(m, None)
        if since is None and restarted:  # its old life died before it was given up
            since = self.heard_before.get(m)
        if since is not None:
            self.returning[m] = min(since, self.returning.get(m, since))

    def contributed(self, learners: Iterable[int], now: float) -> None:
        """A merge took answers of ``learners``: the outages of those returning end now."""
        for m in learners:
            if m in self.returning:
                self.down_seconds += now - self.returning.pop(m)

    def overdue(
        self, live: Iterable[int], now: float, received: Mapping[int, float] | None = None
    ) -> list[int]:
        """The live learners silent for ``detect_seconds``, now counted down (the caller
        gives each up, after a :meth:`change`). ``received``: when each learner's latest
        frame came, read or not yet (a busy loop reads late; the learner was not silent)."""
        received = received or {}

        def heard(m: int) -> float:
            return max(self.last_heard.get(m, now), received.get(m, -float("inf")))

        late = [m for m in sorted(live) if now - heard(m) > self.detect_seconds]
        for m in late:
            since = now - self.detect_seconds
            self.down_since[m] = min(since, self.returning.pop(m, since))  # (again, before
        return late  # it contributed: one outage)

    def down_total(self, now: float) -> float:
        """Learner-seconds lost to outages so far, the open ones counted up to ``now``."""
        open_ = [*self.down_since.values(), *self.returning.values()]
        return self.down_seconds + sum(now - s for s in open_)

    def learner_uptime(self, now: float, learners: int) -> float:
        """The share of the learners' time since the first hello they were contributing
        (1.0 before any hello)."""
        start = self.uptime.first
        if start is None or now <= start:
            return 1.0
        return max(0.0, 1.0 - self.down_total(now) / (learners * (now - start)))
