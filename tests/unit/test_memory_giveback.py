"""The syncer gives freed fragment-sized buffers back to the system (glibc's mmap threshold
fixed): a heap pinned by a small allocation above them keeps nothing they left; a trim gives
back what a heap kept (the launcher, after its pre-flight)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHILD = """
import json, sys
from ddiloco.runtime.processes.memory import give_back_freed_memory, trim_heap

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

fixed = give_back_freed_memory() if sys.argv[1] == "fixed" else None
big = bytearray(16 << 20)  # mapped and freed: glibc's own threshold rises to 16 MiB
del big
start = rss_mib()
blocks = [bytearray(2 << 20) for _ in range(100)]  # 200 MiB of fragment-sized buffers
pin = bytearray(256 << 10)  # a small block above them: the heap cannot shrink past it
held = rss_mib()
del blocks
trimmed = trim_heap() if sys.argv[1] == "trim" else None
after = rss_mib()
print(json.dumps(dict(fixed=fixed, trimmed=trimmed, start=start, held=held, after=after)))
"""


def run(mode: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_freed_buffers_are_given_back_with_the_threshold_fixed_and_kept_without():
    fixed, default = run("fixed"), run("default")
    if fixed["fixed"] is False:
        pytest.skip("not glibc: mallopt is not there")
    assert fixed["held"] - fixed["start"] > 150  # the buffers were really resident
    assert fixed["after"] - fixed["start"] < 20, fixed  # and given back when freed
    assert default["after"] - default["start"] > 150, default  # what glibc did by itself


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, /proc")
def test_a_trim_gives_back_what_the_heap_kept():
    """What the launcher does after its pre-flight step of the model (issue 28)."""
    trimmed = run("trim")
    if trimmed["trimmed"] is False:
        pytest.skip("not glibc: malloc_trim is not there")
    assert trimmed["held"] - trimmed["start"] > 150
    assert trimmed["after"] - trimmed["start"] < 20, trimmed
