"""The syncer's record of each learner slot: which life registered, where it serves peer
snapshots, which life its credit budget is of, and where it stands, in one named state.

A learner slot is :attr:`Presence.UP` from its hello (the core waits for it: it is in
``SyncerState.live``), :attr:`Presence.DOWN` once given up for silence (frozen, cut off or
dead: its outage runs until a life of it contributes again, :mod:`.attendance`), and
:attr:`Presence.LEFT` after a clean goodbye. Every change goes through one method here, made
by the service in the same turn as the core's ``join`` / ``leave``, so the status page, the
summary and the service read one record instead of maps kept side by side. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Presence(Enum):
    UP = "up"  # registered and waited for
    DOWN = "down"  # given up for silence: back when a life of it says hello
    LEFT = "left"  # said goodbye


@dataclass
class Member:
    """One learner slot as the syncer knows it."""

    learner: int
    presence: Presence
    incarnation: int | None  # the life registered (None once it left)
    address: str = ""  # where it serves peer snapshots ("" if it does not)
    budget_life: int | None = None  # the life its credit budget (core/credit.py) is of


class Roster:
    """Every learner slot the syncer has heard a hello from."""

    def __init__(self) -> None:
        self._members: dict[int, Member] = {}

    def __contains__(self, m: object) -> bool:
        return m in self._members

    def get(self, m: int) -> Member | None:
        return self._members.get(m)

    def members(self) -> list[Member]:
        """Every slot, by learner id."""
        return [self._members[m] for m in sorted(self._members)]

    def registered(self) -> list[int]:
        """The slots whose registered life has not left (whom the network thread beats and
        the run's stop goes to)."""
        return [m.learner for m in self.members() if m.incarnation is not None]

    def life(self, m: int) -> int | None:
        """The life learner ``m`` registered with (None: none, or it left)."""
        member = self._members.get(m)
        return None if member is None else member.incarnation

    def address(self, m: int) -> str:
        member = self._members.get(m)
        return "" if member is None else member.address

    # -- the changes ------------------------------------------------------------------------
    def hello(self, m: int, incarnation: int, address: str) -> bool:
        """Life ``incarnation`` of ``m`` registered (UP); True when it replaces another life
        (a restart)."""
        member = self._members.get(m)
        restarted = member is not None and member.incarnation not in (None, incarnation)
        if member is None:
            member = self._members[m] = Member(m, Presence.UP, incarnation, address)
        member.presence, member.incarnation, member.address = Presence.UP, incarnation, address
        return restarted

    def given_up(self, m: int) -> None:
        """``m`` went silent for the detection time (DOWN)."""
        member = self._members.get(m)
        if member is not None:
            member.presence = Presence.DOWN

    def bye(self, m: int) -> None:
        """``m`` left cleanly (LEFT): its life is over."""
        member = self._members.get(m)
        if member is not None:
            member.presence, member.incarnation = Presence.LEFT, None

    def new_budget_life(self, m: int, incarnation: int) -> bool:
        """Whether ``incarnation`` is a life ``m``'s credit budget has not seen (and it now
        has): the budget starts it afresh."""
        member = self._members[m]
        if member.budget_life == incarnation:
            return False
        member.budget_life = incarnation
        return True
