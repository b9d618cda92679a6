"""``python -m pytest_boxlite.boxproc``: run one command inside a box of its own.

Used for ``--boxlite-scope=worker``: an xdist worker (or, without ``-n``, the
whole session) is started as ``popen//python=<this command> -- python``, so
the worker process lives in a box.  This process owns the box: it takes an
owner lock, creates the box, hands its own stdin/stdout/stderr to the
command inside (binary-clean, no copying), and destroys the box when the
command ends.  If this process is killed, the box's watchdog ends the box
and the next session's reconciliation removes what is left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from pytest_boxlite import ledger
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.runtimes import LOCAL_KINDS, open_runtime
from pytest_boxlite.spec import DEFAULT_ENV_DENY, BoxSpec, worker_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytest_boxlite.boxproc")
    parser.add_argument("--home", required=True)
    parser.add_argument("--session", required=True, help="session id: the box's name carries it")
    parser.add_argument("--runtime", required=True, choices=LOCAL_KINDS)
    parser.add_argument("--image", required=True)
    parser.add_argument("--cpus", type=int)
    parser.add_argument("--memory", type=int)
    parser.add_argument("--network", action="store_true")
    parser.add_argument("--mount", action="append", default=[])
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE set in the box")
    parser.add_argument(
        "--env-deny", action="append", default=None, help="a pattern of host variables the box does not see"
    )
    parser.add_argument("--cwd")
    parser.add_argument("--boot-timeout", type=float, default=120.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    home = Path(args.home)
    owner = f"{args.session}-p{os.getpid()}"
    lock = ledger.OwnerLock(home, owner)
    lock.acquire()
    # SIGTERM/SIGHUP must run the cleanup below, not end this process on the spot.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    runtime = None
    box = None
    try:
        env = tuple((k, v) for k, _, v in (e.partition("=") for e in args.env))
        spec = BoxSpec(
            image=args.image,
            cpus=args.cpus,
            memory_mib=args.memory,
            network=args.network,
            env=env,
            mounts=tuple(args.mount),
            # The worker runs as the host user, as it would locally (root only where the host is root).
            user=f"{os.getuid()}:{os.getgid()}",
        )
        runtime = open_runtime(args.runtime, home, owner)
        box = runtime.create_box(spec, f"pbx-{owner}-1", timeout=args.boot_timeout)
        # The command inherits SIGINT from the terminal's process group; so do we: let the box handle it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        deny = DEFAULT_ENV_DENY if args.env_deny is None else tuple(p for p in args.env_deny if p)
        guest_env = worker_env(spec, deny)
        code = box.run_attached(command, cwd=args.cwd, env=guest_env)
        return 128 - code if code < 0 else code
    except BoxliteError as exc:
        print(f"pytest-boxlite: could not run the worker in a box: {exc}", file=sys.stderr)
        return 3
    finally:
        if box is not None:
            with contextlib.suppress(Exception):
                box.destroy()
        if runtime is not None:
            runtime.close()
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
