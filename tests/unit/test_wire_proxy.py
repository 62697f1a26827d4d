"""The fault-injecting proxy's spec and decisions: validated, seeded, and each fault real."""

from __future__ import annotations

import pytest

from ddiloco.errors import ConfigError
from ddiloco.runtime.processes.proxy import FaultProxy, Faults
from ddiloco.runtime.processes.wire import Wire, WireError


def test_a_spec_is_parsed_and_a_bad_one_names_the_field():
    f = Faults.parse("drop=0.1, delay=0.5,delay_seconds=0.2")
    assert (f.drop, f.delay, f.delay_seconds, f.corrupt) == (0.1, 0.5, 0.2, 0.0)
    with pytest.raises(ConfigError, match=r"processes\.proxy"):
        Faults.parse("lose=0.1")
    with pytest.raises(ConfigError, match=r"processes\.proxy\.drop"):
        Faults.parse("drop=1.5")
    with pytest.raises(ConfigError, match=r"processes\.proxy\.corrupt"):
        Faults.parse("corrupt=lots")


@pytest.mark.parametrize(
    ("spec", "reason", "copies"),
    [
        ("drop=1", None, 0),
        ("duplicate=1", "replay", 2),
        ("corrupt=1", "checksum", 1),
        ("truncate=1", "truncated", 1),
    ],
)
def test_each_fault_damages_a_frame_the_way_the_wire_then_refuses(spec, reason, copies):
    proxy = FaultProxy("127.0.0.1:0", "127.0.0.1:1", Faults.parse(spec), seed=3)
    try:
        tx, rx = Wire("r", b"k" * 32, "L0", 1), Wire("r", b"k" * 32, "S", 1)
        frame = [bytes(p) for p in tx.encode("answer", payload=b"\x07" * 300)]
        out = proxy.injure(frame)
        assert len(out) == copies
        if reason == "replay":
            rx.decode(out[0])
        if reason is not None:
            with pytest.raises(WireError) as info:
                rx.decode(out[-1])
            # a flipped bit may land in the prefix: then the sizes or the magic refuse it first
            assert info.value.reason in (reason, "truncated", "oversized", "magic", "version")
    finally:
        proxy.front.close(0)


def test_the_same_seed_makes_the_same_decisions():
    def decisions(seed: int) -> list[int]:
        proxy = FaultProxy("127.0.0.1:0", "127.0.0.1:1", Faults.parse("drop=0.5"), seed=seed)
        try:
            return [len(proxy.injure([b"a", b"b", b"c"])) for _ in range(50)]
        finally:
            proxy.front.close(0)

    assert decisions(1) == decisions(1) != decisions(2)
