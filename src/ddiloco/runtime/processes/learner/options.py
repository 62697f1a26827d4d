"""How a learner process starts, where it serves its peers, and when it stops of its own
accord: the ``ddiloco learner`` command's options, one object from the command (or a user's
own loop, :mod:`.own_loop`, from its ``DDILOCO_*`` variables) down to the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LearnerOptions:
    join: bool = False  # a newcomer or a restart: copy a healthy peer first
    resume: bool = False  # start from this learner's newest local save
    leave_after: float = 0.0  # leave cleanly after this many seconds (0: never)
    max_steps: int = 0  # leave cleanly at this step (0: never)
    peer_host: str = "127.0.0.1"  # the address peers copy this learner from
    peer_port: int = 0  # (0: any free port; rank r of a sharded learner serves on port + r)
    peer_bind: str | None = None  # the interface its server binds (default: peer_host)
    state_dir: Path | None = None  # its local saves (None: no saves)

    def env(self) -> dict[str, object]:
        """As the environment of a user's own loop gives them (:data:`.own_loop.ENV`)."""
        return {
            "join": int(self.join),
            "resume": int(self.resume),
            "state_dir": self.state_dir or "",
            "peer_host": self.peer_host,
            "peer_port": self.peer_port,
            "peer_bind": self.peer_bind or "",
            "leave_after": self.leave_after,
            "max_steps": self.max_steps,
        }
