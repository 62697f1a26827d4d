"""Same-host fast path: frame payloads through shared memory instead of the socket.

When a syncer and its learners share a host (``ddiloco train --runtime processes``, or any
loopback address) a fragment need not cross the loopback socket twice (a kernel copy on each
side). The sender writes the payload once into a file of its own under the run's directory in
``/dev/shm`` and sends, in the frame's payload part, a small reference to it; the receiver
copies the bytes out and the wire checks them against the frame's digest exactly as it checks
an inline payload. So shared memory changes where the bytes travel, not what is trusted: a
slot rewritten, truncated or deleted under a slow reader is refused ("expired"), never applied.

Slots are files named ``<sender>-<key>-<0|1>``: two per key (kind and fragment), used in
turn, so the previous message for a key stays readable while the next is written, and a
restarted process overwrites its former life's files instead of leaking new ones. A slot
starts with a 24-byte stamp (session, sequence, length) written last, checked before and after
the reader's copy (a seqlock). The launcher removes the run's directory at the end.

Both sides use positional writes and reads (``pwrite``, ``preadv``), never a mapping: a mapped
slot's touched pages count in the process's resident memory, so a syncer that mapped every
learner's answer slots and its own broadcast slots held several model copies' worth of
shared pages on top of its own (issue 28). The bytes live once, in the tmpfs file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import struct
from hashlib import sha256
from pathlib import Path

SHM_ROOT = Path(os.environ.get("DDILOCO_SHM_ROOT", "/dev/shm"))  # (tests emulate containers)
MIN_BYTES = 64 * 1024  # smaller payloads go inline: a syscall costs more than their copy
STAMP = struct.Struct("<QQQ")  # session, sequence (0 while writing), payload length
REF = struct.Struct("<QQ")  # session, sequence; followed by the slot's file name
_NAME = re.compile(rb"^[A-Za-z0-9_.-]{1,120}$")


class ShmExpired(Exception):
    """The referenced slot no longer holds that payload (rewritten, deleted, damaged)."""


class ShmMissing(ShmExpired):
    """The slot is not there at all: most likely the sender sees another /dev/shm (a
    container reached through a forwarded loopback port), so its frames must go inline."""


def run_directory(run: str, root: Path = SHM_ROOT) -> Path | None:
    """This user's directory for ``run`` under ``root``; None where there is no tmpfs."""
    if not root.is_dir():
        return None
    digest = sha256(run.encode()).hexdigest()[:16]
    return root / f"ddiloco-{os.getuid()}-{digest}"


def remove_run_directory(run: str, root: Path = SHM_ROOT) -> None:
    """Delete the run's slots (the launcher, at the end of a run)."""
    path = run_directory(run, root)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _own_directory(path: Path, create: bool) -> bool:
    """Whether ``path`` is a directory only this user can touch (made so if ``create``)."""
    if create:
        path.mkdir(mode=0o700, exist_ok=True)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    )


class _Slot:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.size = 0
        self.digest = b""
        self.ref = b""

    def reserve(self, size: int) -> None:
        if self.size < size:
            size = max(size, os.fstat(self.fd).st_size)  # never shrink under a reader
            os.ftruncate(self.fd, size)
            os.posix_fallocate(self.fd, 0, size)  # a full /dev/shm: ENOSPC here
            self.size = size

    def write(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:  # (a regular file takes it whole; a short write is retried)
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n


def _read_into(fd: int, buffer: bytearray, offset: int) -> int:
    """Fill ``buffer`` from ``fd`` at ``offset``; the bytes read (fewer: the file is shorter)."""
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class ShmWriter:
    """One sender's slots. ``put`` returns the reference to send, or None (send inline)."""

    def __init__(
        self, run: str, sender: str, session: int, max_bytes: int = 2 << 30, root: Path = SHM_ROOT
    ) -> None:
        path = run_directory(run, root)
        if path is None or not _own_directory(path, create=True):
            raise OSError(f"no private shared-memory directory for run {run!r} under {root}")
        if not _NAME.match(sender.encode()):
            raise ValueError(f"sender name {sender!r} is not a safe file name")
        self.dir = path
        self.sender = sender
        self.session = session
        self.max_bytes = max_bytes
        self._slots: dict[str, _Slot] = {}
        self._turn: dict[str, int] = {}

    def put(
        self,
        key: str,
        payload: memoryview,
        digest: bytes,
        seq: int,
        busy: frozenset[bytes] = frozenset(),
    ) -> bytes | None:
        """Write ``payload`` (whose digest the frame carries) into the key's older slot, or
        the other one if the older still holds a message in ``busy`` (references a receiver
        may not have read yet: the sender keeps them until acknowledged); None if both do."""
        n = payload.nbytes
        if n < MIN_BYTES:
            return None
        for turn in (0, 1):  # the same payload sent again (a broadcast): no second copy
            slot = self._slots.get(f"{key}-{turn}")
            if slot is not None and slot.digest == digest:
                return slot.ref
        older = 1 - self._turn.get(key, 1)
        for turn in (older, 1 - older):
            name = f"{key}-{turn}"
            slot = self._slots.get(name)
            if slot is None or slot.ref not in busy:
                break
        else:
            return None  # both slots hold messages not yet acknowledged: send inline
        held = sum(s.size for s in self._slots.values())
        if held - (slot.size if slot else 0) + STAMP.size + n > self.max_bytes:
            return None
        try:
            if slot is None:
                if not _own_directory(self.dir, create=True):  # (another sender's close may
                    return None  # have removed the empty directory; never trust a foreign one)
                slot = self._slots[name] = _Slot(self.dir / f"{self.sender}-{name}")
            slot.reserve(STAMP.size + n)
            slot.write(0, STAMP.pack(self.session, 0, n))  # readers now see "being written"
            slot.write(STAMP.size, payload)
            slot.write(0, STAMP.pack(self.session, seq + 1, n))
        except OSError:  # no room in /dev/shm (or the directory went away): send inline
            return None
        self._turn[key] = turn
        slot.digest = digest
        slot.ref = REF.pack(self.session, seq + 1) + f"{self.sender}-{name}".encode()
        return slot.ref

    def close(self) -> None:
        """Unmap and delete this sender's slots."""
        for name, slot in self._slots.items():
            os.close(slot.fd)
            (self.dir / f"{self.sender}-{name}").unlink(missing_ok=True)
        self._slots.clear()
        with contextlib.suppress(OSError):  # the last sender out removes the directory
            self.dir.rmdir()


class ShmReader:
    """Copies payloads out of other processes' slots (keeps their files open)."""

    def __init__(self, run: str, root: Path = SHM_ROOT) -> None:
        self.dir = run_directory(run, root)
        self._files: dict[bytes, int] = {}  # name -> open file

    def get(self, ref: memoryview, length: int) -> bytearray:
        """The referenced payload of ``length`` bytes, copied; raises :class:`ShmExpired`."""
        if len(ref) <= REF.size or not _NAME.match(bytes(ref[REF.size :])):
            raise ShmExpired("malformed shared-memory reference")
        want = (*REF.unpack_from(ref, 0), length)
        name = bytes(ref[REF.size :])
        fd = self._files.get(name)  # a slot already open: one system call less on the way
        if fd is None or self._stamp(fd) != want:
            fd = self._open(name)  # first use, or replaced by a restarted sender
            if self._stamp(fd) != want:
                raise ShmExpired(f"slot {name.decode()} was rewritten")
        data = bytearray(length)  # the one copy, straight from the file
        if _read_into(fd, data, STAMP.size) != length:
            raise ShmExpired(f"slot {name.decode()} is shorter than its stamp says")
        if self._stamp(fd) != want:
            raise ShmExpired(f"slot {name.decode()} was rewritten while being read")
        return data

    @staticmethod
    def _stamp(fd: int) -> tuple[int, ...] | None:
        head = os.pread(fd, STAMP.size, 0)
        return STAMP.unpack(head) if len(head) == STAMP.size else None

    def _open(self, name: bytes) -> int:
        if self.dir is None or not _own_directory(self.dir, create=False):
            raise ShmMissing("no private shared-memory directory for the run here")
        try:
            fd = os.open(self.dir / name.decode(), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ShmMissing(f"slot {name.decode()} does not exist here") from None
        except OSError as exc:
            raise ShmExpired(f"slot {name.decode()}: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ShmExpired(f"slot {name.decode()} is not a regular file")
        old = self._files.pop(name, None)
        if old is not None:
            os.close(old)
        self._files[name] = fd
        return fd

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (so peers share /dev/shm)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def writer_for(run: str, sender: str, session: int, host: str, enabled: bool) -> ShmWriter | None:
    """A writer when shared memory is ``enabled`` and the peers behind ``host`` are local."""
    if not enabled or not is_loopback(host):
        return None
    try:
        return ShmWriter(run, sender, session)
    except OSError:
        return None  # no tmpfs, or a directory someone else owns: inline frames still work
