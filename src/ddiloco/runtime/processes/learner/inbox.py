"""Merged fragments a link received, the newest version of each, until the training thread
takes them: the learner's link (:mod:`.link`) and a sharded learner's rank links
(:mod:`.part_link`) each keep one, filled by their network thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import MutableMapping

import torch

from ddiloco.runtime.processes.transport.wire import WireError, decode_update

log = logging.getLogger(__name__)

Held = dict[int, tuple[int, list[torch.Tensor]]]  # fragment -> (version, values)


class FragmentInbox:
    """``shapes``: what each fragment's payload decodes to (a sharded rank's: its rows);
    ``refused``: the link's wire tally; ``who`` names the link in the log."""

    def __init__(
        self, shapes: list[list[tuple[int, ...]]], who: str, refused: MutableMapping[str, int]
    ) -> None:
        self.shapes = shapes
        self.who = who
        self.refused = refused
        self._held: Held = {}
        self._lock = threading.Lock()

    def put(self, p: int, version: int, payload: memoryview) -> bool:
        """Fragment ``p`` at ``version`` (kept if newer than the one held); False, refused
        and said, when it is no fragment of ours or does not decode to its shapes."""
        if not 0 <= p < len(self.shapes):
            self.refused["meta"] += 1
            return False
        try:
            values = decode_update(payload, self.shapes[p])
        except WireError as exc:
            log.warning("%s: refused fragment %d: %s", self.who, p, exc)
            return False
        with self._lock:
            held = self._held.get(p)
            if held is None or held[0] < version:
                self._held[p] = (version, values)
        return True

    def take(self) -> Held:
        """What came since the last call (the newest version of each fragment)."""
        with self._lock:
            held, self._held = self._held, {}
        return held
