"""A learner's answers the syncer has not acknowledged yet, in one object.

An answer is kept from the moment it is encoded until the syncer acknowledges it: a verdict
(it was dropped, and why), or its key in a merged fragment (which also acknowledges the older
answers of the same life, fragment and base: superseded or "base already merged"). Until
then it is pushed again whenever the syncer may not have it: a new syncer life (it lost what
the earlier one was sent), a connection that had to prove itself (the frames before were
dropped unread), a syncer that cannot read our /dev/shm (what went by shared memory). The
shared-memory slot each one went in stays reserved meanwhile (the syncer may not have read
it yet). No I/O here: the link's thread owns it and does the sending.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ddiloco.runtime.processes import protocol

Key = tuple[int, int, int]  # an answer's (learner, incarnation, seq)


@dataclass
class Unacknowledged:
    """One answer: what was sent, where, and in which slot."""

    message: protocol.Answer
    payload: bytes
    session: int | None = None  # the syncer life it last went to (None: not sent yet)
    slot: bytes | None = None  # its shared-memory reference, if it went that way


class PendingAnswers:
    """The unacknowledged answers, oldest first; beyond ``limit`` the oldest is given up
    (its round is long closed)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._answers: dict[Key, Unacknowledged] = {}

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._answers))

    def __len__(self) -> int:
        return len(self._answers)

    def __contains__(self, key: object) -> bool:
        return key in self._answers

    def __getitem__(self, key: Key) -> Unacknowledged:
        return self._answers[key]

    def add(self, message: protocol.Answer, payload: bytes) -> Unacknowledged:
        entry = Unacknowledged(message, payload)
        self._answers[message.answer.key] = entry
        while len(self._answers) > self.limit:
            self.forget(next(iter(self._answers)))
        return entry

    def forget(self, key: Key) -> None:
        """Acknowledged (or given up): its slot is free again."""
        self._answers.pop(key, None)

    def merged(self, key: Key) -> bool:
        """The syncer merged ``key``: it and the older answers of the same life, fragment and
        base are acknowledged; False if ``key`` was not ours (already forgotten)."""
        entry = self._answers.get(key)
        if entry is None:
            return False
        a = entry.message.answer
        for k in self:
            b = self._answers[k].message.answer
            if k[:2] == key[:2] and b.fragment == a.fragment and b.base_version <= a.base_version:
                self.forget(k)
        return True

    def not_sent_to(self, session: int | None) -> list[Key]:
        """The answers a syncer life ``session`` was never sent (a restarted syncer)."""
        return [k for k, e in self._answers.items() if e.session != session]

    def unsent(self) -> None:
        """Every answer counts as not sent (the syncer dropped what it had unread)."""
        for entry in self._answers.values():
            entry.session = None

    def by_shared_memory(self) -> list[Key]:
        """The answers that went in a shared-memory slot; they go inline from now on."""
        keys = [k for k, e in self._answers.items() if e.slot is not None]
        for entry in self._answers.values():
            entry.slot = None
        return keys

    def slots(self) -> frozenset[bytes]:
        """The slots the next answers must not overwrite."""
        return frozenset(e.slot for e in self._answers.values() if e.slot is not None)
