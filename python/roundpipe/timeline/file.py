"""The file a trace streams into: a Chrome trace JSON object that is complete after every write.

Layout: ``{"traceEvents":[`` then the events, comma-separated, then the tail
``],"displayTimeUnit":"ms","otherData":{...}}``. Each write lays the new events over the old tail
and a new tail after them, in one ``pwrite``, so the file on disk parses as a whole trace after
every write: a process that dies between writes leaves the events written so far. Until
:meth:`TraceFile.finish` the tail's ``otherData.cut_short`` says that the recording did not end;
``finish`` writes the final tail, with a ``cut_short`` reason only when the caller gives one.

The file is locked (``flock``) while it is written, so that a second process does not write into
the same file (:class:`TraceFileBusy`).
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Final

#: ``otherData.cut_short`` of a file whose recording has not ended (yet, or ever).
UNFINISHED: Final[str] = "the recording did not end: the process stopped before the trace closed"
_HEADER: Final[bytes] = b'{"traceEvents":['


class TraceFileBusy(BlockingIOError):
    """Another process is writing a trace to the same file."""


class TraceFile:
    """An open trace file that events are appended to; thread-safe.

    Raises (from the constructor):
        OSError: ``path`` cannot be opened for writing (a missing folder, a folder, no permission).
        TraceFileBusy: another process is writing a trace to ``path``.
    """

    def __init__(self, path: str, other_data: Mapping[str, Any]) -> None:
        self.path = path
        self._other_data = dict(other_data)
        try:
            # No O_TRUNC: a file another process is writing is only emptied once it is ours.
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as error:
            raise _naming(path, error) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise TraceFileBusy(
                f"another process is writing a trace to {path}; give each process its own path"
            ) from None
        self._lock = threading.Lock()
        self._end = len(_HEADER)  # where the next event goes: the tail starts there
        self._events = 0
        tail = self._tail(UNFINISHED)
        try:
            if stat.S_ISREG(os.fstat(self._fd).st_mode):  # a device (/dev/null) has no length
                os.ftruncate(self._fd, 0)
            self._pwrite(_HEADER + tail, 0)
        except OSError:
            # Closed, and its lock with it: a later trace to the same path is not refused as
            # "another process is writing".
            os.close(self._fd)
            self._fd = None
            raise
        self._tail_bytes = len(tail)

    def append(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Write ``events`` (Chrome trace event objects) after those already written.

        Raises:
            OSError: the write failed (a full disk, say); the file keeps what it had before.
        """
        with self._lock:
            self._write_locked(events, UNFINISHED)

    def finish(self, cut_short: str | None) -> None:
        """Write the final tail and close; later calls do nothing.

        Args:
            cut_short: why the trace ends early (written as ``otherData.cut_short``), or None.

        Raises:
            OSError: the write failed; the file is closed all the same.
        """
        with self._lock:
            if self._fd is None:
                return
            try:
                self._write_locked([], cut_short)
            finally:
                os.close(self._fd)
                self._fd = None

    def close_unfinished(self) -> None:
        """Close without writing more; the file keeps what was written. For a forked child (the
        parent owns the file; the lock may have been held by a parent's thread that the child
        lacks) and after a write error."""
        self._lock = threading.Lock()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write_locked(self, events: Sequence[Mapping[str, Any]], cut_short: str | None) -> None:
        if self._fd is None:
            raise ValueError(f"the trace file {self.path} is closed")
        # An args value JSON cannot hold is written as its str(): the writer thread has nobody
        # to raise to.
        body = json.dumps(events, separators=(",", ":"), default=str).encode()[1:-1]
        if body and self._events:
            body = b"," + body
        tail = self._tail(cut_short)
        # Spaces (JSON whitespace) pad a shorter tail over the old one: no truncation, so the
        # file never ends with the old tail's leftovers.
        tail += b" " * max(0, self._tail_bytes - len(body) - len(tail))
        self._pwrite(body + tail, self._end)
        self._end += len(body)
        self._tail_bytes = len(tail)
        self._events += len(events)

    def _tail(self, cut_short: str | None) -> bytes:
        other = dict(self._other_data)
        if cut_short is not None:
            other["cut_short"] = cut_short
        return (
            b'],"displayTimeUnit":"ms","otherData":'
            + json.dumps(other, separators=(",", ":")).encode()
            + b"}"
        )

    def _pwrite(self, data: bytes, offset: int) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                written = os.pwrite(self._fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as error:  # a full disk, say: the error names the trace's path
            raise _naming(self.path, error) from None


def _naming(path: str, error: OSError) -> OSError:
    """``error`` (of the same type, so ``FileNotFoundError`` stays one) with a message naming
    the trace's ``path`` and what to do."""
    return type(error)(
        error.errno,
        f"cannot write a trace to {path}: {error.strerror}; give the path of a file in an "
        "existing folder that you can write to, on a disk with room",
    )


__all__ = ["UNFINISHED", "TraceFile", "TraceFileBusy"]
