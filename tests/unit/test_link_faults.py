"""The launcher's side of link faults (``launcher/link_faults.py``): what reaches the proxy's
control pipe and when. A fault played while the proxy starts, or while it is down, is sent
once the proxy is up, with what is left of it; a restarted proxy hears every fault not over."""

from __future__ import annotations

import io
import json
import time
from typing import Any

from ddiloco.chaos.plan import ChaosEvent
from ddiloco.config import load_config
from ddiloco.runtime.processes.launcher.link_faults import LinkFaults


class Life:
    """One proxy life as the launcher sees it: a pipe to its stdin, an exit code."""

    def __init__(self) -> None:
        self.stdin = io.StringIO()
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def heard(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdin.getvalue().splitlines()]


def links() -> tuple[LinkFaults, list[Life]]:
    lives: list[Life] = []
    config = load_config(None, ["runtime='processes'"])
    faults = LinkFaults(
        config, "127.0.0.1:1", "127.0.0.1:2", "run", lambda args: lives.append(Life()),
        lambda: lives[-1] if lives else None,
    )  # fmt: skip
    return faults, lives


def test_a_fault_played_while_the_proxy_starts_is_sent_once_it_is_up():
    faults, lives = links()
    faults.start()
    faults.play(ChaosEvent(0.0, "link_cut", 1, duration=30.0))
    assert lives[0].heard() == []  # not up yet: nothing on its pipe
    faults.up()
    cut, opened = lives[0].heard()  # what is left of the cut, then it may forward
    assert cut["link"] == 1 and 29.0 < cut["cut_seconds"] <= 30.0
    assert opened == {"open": True}
    faults.play(ChaosEvent(0.0, "link_slow", 0, factor=4.0))
    assert lives[0].heard()[2] == {"link": 0, "factor": 4.0, "seconds": 0.0}  # up: at once


def test_a_restarted_proxy_hears_what_is_left_of_each_fault_once_up():
    faults, lives = links()
    faults.start()
    faults.up()
    faults.play(ChaosEvent(0.0, "link_cut", 1, duration=30.0))
    faults.play(ChaosEvent(0.0, "link_cut", 0, duration=0.05))  # over before the restart
    faults.play(ChaosEvent(0.0, "link_slow", 2, factor=8.0))  # (0: to the end)
    lives[0].code = -9  # the proxy died
    time.sleep(0.1)
    faults.start()
    faults.play(ChaosEvent(0.0, "link_slow", 3, factor=2.0, duration=60.0))  # while it starts
    faults.up()
    *heard, opened = lives[1].heard()
    assert opened == {"open": True}  # (after the faults: nothing slips through before them)
    assert [c["link"] for c in heard] == [1, 2, 3]
    assert 29.0 < heard[0]["cut_seconds"] < 30.0
    assert heard[1] == {"link": 2, "factor": 8.0, "seconds": 0.0}
    assert heard[2]["factor"] == 2.0 and 59.0 < heard[2]["seconds"] <= 60.0
