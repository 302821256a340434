"""Shared-memory segments for KV between nodes on one host (the shm backend's files).

A prefill node on the CPU keeps its whole KV page pool in one file under
/dev/shm (``Segment.create``); a decode node on the same host maps that file
read-only (``Segment.open``) and copies a request's pages straight from it into
its own: one memcpy end to end, no socket in between. The KV message carries
only offsets.

Memory. A segment is sparse: its size is the whole pool, but /dev/shm backs only the
ranges its owner ``reserve``s (``posix_fallocate``), and a process's RSS counts only
the pages it has touched. The prefill node's block allocator reserves its blocks as it
first hands them out (engine/block_allocator.py), so a node holds the KV it has used,
not the whole ``--kv-cache-memory-gb``, and a /dev/shm that fills up later is met by
a failed reservation (the pool stops growing there), never by a SIGBUS on a write. A
decode node maps a peer's segment without populating it and reads only the pages the
peer named, which the peer reserved before writing them.

Same host means the same kernel boot *and* the same /dev/shm mount (containers
on one machine share the boot id but may have private /dev/shm): ``host_id``
is both, and nodes declare it in Hello.

Cleanup. The owner unlinks its segment when it exits (``close``). A process
killed with SIGKILL cannot, so every segment's name carries its owner's pid and
process start time: ``sweep`` (run by every node at start, and by decode nodes
every ``SWEEP_INTERVAL_S``) unlinks the segments whose owner is gone. A mapping
held by a surviving decode node keeps the memory until it is unmapped (when its
sweep finds the owner gone); the file is gone from /dev/shm at once.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import warnings

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"
SWEEP_INTERVAL_S = 10.0
NAME_RE = re.compile(r"^pdserve-kv-(\d+)-(\d+)-[0-9a-f]{8}$")


class SegmentError(Exception):
    pass


def host_id() -> str:
    """Who shares this host's shared memory: boot id + /dev/shm's device and inode;
    "" where there is no /dev/shm (then no peer is ever same-host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which
    tells a live owner from a later process that reuses its pid; None if none runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(name: str) -> bool:
    m = NAME_RE.match(name)
    return m is not None and _start_time(int(m.group(1))) == m.group(2)


def sweep() -> list[str]:
    """Unlinks the segments of owners that are gone (killed before they could); returns
    their names. Segments of other users cannot be removed and are left alone."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if NAME_RE.match(n)]
    except OSError:
        return []
    removed = []
    for name in names:
        if _owner_alive(name):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d KV segment(s) of exited processes from %s: %s", len(removed),
                 SHM_DIR, ", ".join(removed[:4]))
    return removed


class Segment:
    """One file under /dev/shm mapped into this process; ``data`` is a uint8 tensor
    over the whole mapping."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, fd: int | None = None):
        self.name = name
        self._fd = fd  # the owner's, kept open for reserve
        self.size = len(mm)
        self.owner = owner
        self._mm = mm
        with warnings.catch_warnings():  # a read-only mapping: torch warns, we only read
            warnings.simplefilter("ignore", UserWarning)
            self.data = torch.frombuffer(mm, dtype=torch.uint8)
        self.view = memoryview(mm)  # for copies by slice assignment

    @classmethod
    def create(cls, nbytes: int) -> Segment:
        """A new zero-filled segment of this process, sparse (``reserve`` backs its
        ranges). Refused here, with the reason, when /dev/shm has less room free than the
        whole segment: a pool that could never grow to its size is not started."""
        pid = os.getpid()
        name = f"{PREFIX}{pid}-{_start_time(pid)}-{os.urandom(4).hex()}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            st = os.fstatvfs(fd)
            free = st.f_bavail * st.f_frsize
            if free < nbytes:
                raise OSError(f"{free / 2**20:.0f} MiB free there")
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise SegmentError(f"cannot make a {nbytes / 2**20:.0f} MiB KV segment in "
                               f"{SHM_DIR}: {exc}") from None
        return cls(name, mm, owner=True, fd=fd)

    @classmethod
    def open(cls, name: str) -> Segment:
        """Maps another process's segment read-only. Not populated: only the pages read
        are mapped, so a decode node holds the pages it copied, not the peer's pool."""
        if not NAME_RE.match(name):
            raise SegmentError(f"{name[:80]!r} is not a pdserve KV segment name")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        except OSError as exc:
            raise SegmentError(f"cannot open KV segment {name}: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise SegmentError(f"KV segment {name} is empty")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            raise SegmentError(f"cannot map KV segment {name}: {exc}") from None
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def reserve(self, offset: int, nbytes: int) -> None:
        """Backs bytes [offset, offset + nbytes) in /dev/shm (zeros where never written);
        OSError (ENOSPC) when /dev/shm has no room left for them. The owner's only."""
        if self._fd is None:
            raise SegmentError(f"KV segment {self.name} is not this process's to reserve")
        os.posix_fallocate(self._fd, offset, nbytes)

    def owner_alive(self) -> bool:
        return _owner_alive(self.name)

    def close(self) -> None:
        """Unmaps (once no tensor over it is left) and, for the owner, unlinks the file."""
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.data = None
        try:
            self.view.release()
            self._mm.close()
        except BufferError:
            pass  # tensors over it still live: the mapping goes when they do
