"""A zygote clone's log: its agent's stderr as a pipe the host drains into ``box.log``, capped.

A box forked from a sandbox zygote (see :mod:`.zygote`) got an ``O_APPEND`` descriptor of its
host-side ``box.log`` as its agent's stderr: whatever held that descriptor in the box could grow a
file on the host's disk without bound.  Now the clone gets the write end of a pipe; the host's one
drainer thread for forked boxes' pipes (:class:`~pytest_boxlite.runtimes._forkcell.ForkLog`'s)
writes at most :data:`LOG_CAP` bytes of it to ``box.log``, then a note, and, once the pipe ends,
the last :data:`TAIL_KEPT` bytes (a crash's last words after a flood), as ``guest/attach.py`` does
for booted boxes.  No descriptor of a host file reaches the box.
"""

from __future__ import annotations

import os
from pathlib import Path

from pytest_boxlite.runtimes._forkcell import ForkLog

#: Bytes of the clone's stderr written to ``box.log`` (the cap of ``guest/attach.py``'s LOG_CAP).
LOG_CAP = 4 << 20
#: Of what came after the cap, the last bytes written when the pipe ends.
TAIL_KEPT = 4096
_CAP_NOTE = b"\n[pytest-boxlite: this log reached its cap of %d bytes; the rest is dropped]\n"


class CappedBoxLog(ForkLog):
    """The pipe a clone's agent writes its stderr to, drained into ``path`` up to ``cap`` bytes.

    Hand :attr:`write_end` to the clone, then call :meth:`handed_over`; the file is closed when
    every writer has closed the pipe (the clone's processes have ended).
    """

    def __init__(self, path: Path, cap: int = LOG_CAP) -> None:
        # Set before the base class registers the pipe with the drainer, which may call take() at once.
        self.cap = cap
        self.written = 0
        self.dropped = 0
        self._late = b""
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            super().__init__(path.parent.name, kept=TAIL_KEPT)
        except BaseException:
            os.close(self._fd)
            raise

    def keep(self, chunk: bytes) -> None:
        """A chunk of the pipe into the file, within the cap (the drainer's thread)."""
        room = self.cap - self.written
        if room > 0:
            self._write(chunk[:room])
            self.written += min(room, len(chunk))
            chunk = chunk[room:]
        if chunk:
            if not self.dropped:  # the first byte past the cap
                self._write(_CAP_NOTE % self.cap)
            self.dropped += len(chunk)
            self._late = (self._late + chunk)[-TAIL_KEPT:]

    def close(self) -> None:
        """The pipe ended: what came last after the cap, then the file is closed."""
        if self.dropped:
            self._write(b"\n[pytest-boxlite: %d bytes dropped; the last %d:]\n" % (self.dropped, len(self._late)))
            self._write(self._late)
        os.close(self._fd)
        super().close()

    def _write(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError:
            pass  # a full disk or a removed box: the pipe is drained all the same
