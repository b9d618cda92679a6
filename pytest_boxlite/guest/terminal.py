"""Run a command on a new pseudo-terminal inside the box (``python -m pytest_boxlite shell``).

The user's terminal reaches the box as plain descriptors (the agent hands them to the command),
which is no controlling terminal there: an interactive shell had no job control, and Ctrl-C
reached nothing.  This script, run in the box as ``python -I -S terminal.py -- ARGV...`` with the
user's terminal as its stdin and stdout, starts ``ARGV`` on a pty of the box's own (its
controlling terminal, in a session of its own) and copies bytes both ways.  The user's terminal
is put in raw mode meanwhile, so Ctrl-C, Ctrl-Z and the rest reach the pty's line discipline,
which signals the foreground job in the box; its mode is restored when the command ends.  The
pty follows the terminal's size.  Standard library only; exits with the command's status.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pty
import select
import sys
import termios
import tty


def _write_all(fd: int, data: bytes) -> bool:
    while data:
        try:
            n = os.write(fd, data)
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return False
        data = data[n:]
    return True


def _size(fd: int) -> bytes | None:
    try:
        return fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
    except OSError:
        return None


def _copy(master: int, pid: int) -> int:
    """Copy the user's terminal to the pty and back until the command ends; its wait status.

    The command's end, not the pty's, ends the copy: a job it left in the background may hold
    the pty open (as on any terminal, closing the pty then hangs it up).
    """
    inputs = [master, 0]
    status = None  # the command's wait status, once it has ended
    size = _size(0)

    def ended() -> int:
        return status if status is not None else os.waitpid(pid, 0)[1]

    while True:
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
        # The user's terminal was resized (its SIGWINCH reaches the host's process, not this one):
        # the pty takes the new size, and the kernel tells the command.
        now = _size(0)
        if now is not None and now != size:
            size = now
            try:
                fcntl.ioctl(master, termios.TIOCSWINSZ, now)
            except OSError:
                pass
        try:
            ready, _, _ = select.select(inputs, [], [], 0.2 if status is None else 0.05)
        except InterruptedError:
            continue
        if status is not None and master not in ready:
            return status  # ended, and everything it wrote has been copied
        if master in ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the command and everything it started closed the pty
                data = b""
            if not data or not _write_all(1, data):
                return ended()
        if 0 in ready:
            try:
                data = os.read(0, 65536)
            except OSError:
                data = b""
            if not data:
                inputs.remove(0)  # the user's side is gone: let the command see the pty as it is
            elif not _write_all(master, data):
                return ended()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("terminal.py: no command\n")
        return 2
    size = _size(0)
    pid, master = pty.fork()
    if pid == 0:
        if size is not None:
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, size)
            except OSError:
                pass
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            sys.stderr.write("%s: %s\n" % (argv[0], exc.strerror))
        os._exit(127)
    try:
        saved = termios.tcgetattr(0)
        tty.setraw(0)
    except termios.error:
        saved = None
    try:
        status = _copy(master, pid)
    finally:
        if saved is not None:
            try:
                termios.tcsetattr(0, termios.TCSAFLUSH, saved)
            except termios.error:
                pass
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
