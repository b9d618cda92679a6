"""``python -m pytest_boxlite``: doctor, ls, clean, shell."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

from pytest_boxlite import __version__, ledger
from pytest_boxlite._homefs import Refused, check_home
from pytest_boxlite._homefs import limits as homefs_limits
from pytest_boxlite._shown import shown
from pytest_boxlite.errors import BoxliteError
from pytest_boxlite.runtimes import choose, kinds, remote_boxes, remote_clean, remote_target
from pytest_boxlite.settings import OPTIONS_BY_NAME, default_home

#: What ``python -m pytest_boxlite --help`` says before its sub-commands (plain text: argparse
#: prints it as it is).
DESCRIPTION = "Look after pytest-boxlite's boxes on this machine (or on a --url server)."
EPILOG = """examples:
  python -m pytest_boxlite doctor          what this machine can run, and why
  python -m pytest_boxlite ls              boxes under the home, their owners, alive or dead
  python -m pytest_boxlite clean           remove what dead sessions left behind
  python -m pytest_boxlite shell NAME      a shell in a box kept by --boxlite-keep"""


def _home(args: argparse.Namespace) -> Path:
    return Path(args.home or os.environ.get(OPTIONS_BY_NAME["home"].env) or default_home()).expanduser()


def _home_source(args: argparse.Namespace) -> str:
    if args.home:
        return "--home"
    env = OPTIONS_BY_NAME["home"].env
    return f"env {env}" if os.environ.get(env) else "the default, ~/.cache/pytest-boxlite"


def _checked_home(args: argparse.Namespace) -> Path:
    """The home, once it is safe to use (ours, writable by no one else: see :mod:`._homefs`)."""
    return check_home(_home(args), source=_home_source(args))


def _home_state(home: Path) -> str:
    """``exists, writable`` / ``will be created`` / ``NOT writable (...)``, without touching anything."""
    try:
        return _home_state_of(home)
    except OSError as exc:
        return f"NOT usable by uid {os.getuid()}: {_os_problem(exc)}"


def _os_problem(exc: OSError) -> str:
    """``Permission denied: '<path>'``: what an ``OSError`` says, without a traceback."""
    what = exc.strerror or str(exc)
    return f"{what}: {exc.filename!r}" if exc.filename else what


def _home_state_of(home: Path) -> str:
    if home.exists():
        if not home.is_dir():
            return "NOT usable: exists and is not a directory"
        if not os.access(home, os.R_OK | os.X_OK):
            return f"exists, NOT readable by uid {os.getuid()}"
        return "exists, writable" if os.access(home, os.W_OK | os.X_OK) else "exists, NOT writable by this user"
    parent = home.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if os.access(parent, os.W_OK | os.X_OK):
        return "will be created"
    return f"NOT writable: it does not exist and {parent} is not writable by this user"


def cmd_doctor(args: argparse.Namespace) -> int:
    """Explain what this machine can run, and why: one plain fact per line."""
    home = _home(args)
    requested = os.environ.get(OPTIONS_BY_NAME["runtime"].env, "auto")
    print(f"pytest-boxlite {__version__}")
    print(
        f"platform:   {platform.system()} {platform.release()} {platform.machine()}, Python {platform.python_version()}"
        f", uid {os.getuid()}"
    )
    # Each runtime states its own facts (what this host lets it do, and why).
    for k in kinds():
        for label, fact in k.host_facts():
            print(f"{label + ':':<12}{fact}")
    try:
        c = choose(requested, _remote(args))
        print(f"runtime:    {c.kind} (asked: {requested}; {c.reason})")
    except BoxliteError as exc:
        print(f"runtime:    ERROR: {exc}")
    print(f"home:       {shown(home, line=True)} ({_home_state(home)})")
    try:
        check_home(home, source=_home_source(args))
        trust = "owned by this user, writable by no one else"
    except BoxliteError as exc:
        trust = f"REFUSED: {_s(exc)}"
    except OSError as exc:
        trust = f"not checked: {_s(_os_problem(exc))}"
    print(f"home trust: {trust}")
    for limit in homefs_limits():
        print(f"home trust: NOT held as designed: {limit}")
    print(f"images:     {_s(_image_store_line(home))}")
    if getattr(args, "selftest", False):
        # Boots one micro-VM and runs the contract's essentials in it (a KVM host only).
        from pytest_boxlite.runtimes import probe, vm_unavailable
        from pytest_boxlite.selftest import run_selftest

        found = probe()
        if not found.vm_ok:
            print(f"selftest:   not run: {_s(vm_unavailable(found.reason, 'the selftest boots one micro-VM'))}")
            return 1

        print("selftest:   booting one micro-VM ...")
        return run_selftest()
    return 0


def _image_store_line(home: Path) -> str:
    """Where the image store is and what it holds (``doctor``)."""
    from pytest_boxlite.images import store_dir, store_usage

    store = store_dir(home)
    try:
        if not store.is_dir():
            return f"{store} (empty: images are unpacked there on first use)"
        count, size = store_usage(store)
    except OSError as exc:
        return f"{store} (NOT readable by uid {os.getuid()}: {_os_problem(exc)})"
    return f"{store} ({count} image(s), {size / (1 << 20):.1f} MiB; clean --images empties it)"


def _list_images(home: Path) -> int:
    from pytest_boxlite.images import list_images, store_dir

    store = store_dir(home)
    images = list_images(store)
    print(f"image store {_s(store)}: {len(images)} image(s)")
    for im in images:
        refs = ", ".join(_s(r) for r in im.references) or "(no reference)"
        print(f"{_s(im.digest[:19])}  {im.size / (1 << 20):8.1f} MiB  {refs}")
    return 0


def _s(text: object) -> str:
    """``text`` as one line with every terminal control escaped (:func:`~._shown.shown`)."""
    return shown(text, line=True)


def _remote(args: argparse.Namespace) -> Any:
    """The ``--url`` server (or ``$PYTEST_BOXLITE_URL``), or None for this host's home."""
    url = args.url or os.environ.get(OPTIONS_BY_NAME["url"].env)
    cred = args.credential_file or os.environ.get(OPTIONS_BY_NAME["credential_file"].env)
    opt = OPTIONS_BY_NAME["max_boxes"]
    older = opt.older()
    raw = os.environ.get(opt.env) or (os.environ.get(older.env) if older is not None else None)
    try:
        max_boxes = int(opt.parse(raw or "2"))
    except ValueError:
        max_boxes = 2
    return remote_target(url, credential_file=cred, max_boxes=max_boxes)


def cmd_ls(args: argparse.Namespace) -> int:
    """List boxes under the home (or on the --url server), with their owner and state."""
    target = _remote(args)
    if target is not None:
        boxes = remote_boxes(target, _home(args))
        print(f"server {_s(target.display)}: {len(boxes)} box(es)")
        for rec, owner in boxes:
            print(f"{_s(rec.name):32} {_s(rec.state):10} owner={_s(owner or '(not ours)')}")
        return 0
    from pytest_boxlite.templates import list_templates

    home = _home(args)
    if not home.exists() and (args.home or os.environ.get(OPTIONS_BY_NAME["home"].env)):
        # A home named on purpose that is not there is a typo far more often than a clean machine.
        print(
            f"error: no boxlite home at {_s(home)} ({_home_source(args)}): nothing ever ran with it; check the path",
            file=sys.stderr,
        )
        return 2
    if not home.exists():
        print(f"no boxes (the home {_s(home)} does not exist yet: nothing has run with it)")
        return 0
    home = _checked_home(args)
    if getattr(args, "images", False):
        return _list_images(home)
    rows = ledger.scan(home)
    if not rows:
        print("no boxes")
    from pytest_boxlite import service_ledger

    services = service_ledger.read_all(home)  # the services running in boxes (service fixtures)
    for r in rows:
        # Every name read from the home is shown escaped: another user, or a project, may have put it there.
        owner = f"{_s(r.owner)} ({'alive' if r.owner_alive else 'dead'})" if r.owner else "(not ours)"
        flags = " kept" if r.kept else ""
        record = services.get(r.name)
        if record is not None and r.owner_alive:
            flags += " " + _s(service_ledger.describe(record))
        print(f"{_s(r.name):32} {_s(r.runtime):10} {'running' if r.running else 'stopped':8} owner={owner}{flags}")
    # The provisioned templates (--boxlite-setup): `clean --templates` removes exactly these.
    for line in list_templates(home):
        print(_s(line))
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    """Remove leftover boxes of dead sessions (and kept ones, or the ones named)."""
    home = _home(args)
    target = _remote(args)
    if target is not None:
        removed = remote_clean(target, home, list(args.names))
        names = ", ".join(_s(r) for r in removed)
        print(f"removed {len(removed)} box(es) on {_s(target.display)}" + (": " + names if removed else ""))
        return 0
    home = _checked_home(args)
    if args.templates:
        from pytest_boxlite.templates import drop_templates

        dropped = drop_templates(home)
        print(f"dropped {len(dropped)} template(s)" + (": " + ", ".join(_s(d) for d in dropped) if dropped else ""))
    if getattr(args, "images", False):
        from pytest_boxlite.images import drop_images, store_dir

        gone = drop_images(store_dir(home))
        print(
            f"dropped {len(gone)} image(s) from {store_dir(home)}"
            + (": " + ", ".join(_s(d[:19]) for d in gone) if gone else "")
        )
    if args.names:
        for name in args.names:
            owner = ledger.owner_of(name)
            if owner is not None and ledger.owner_alive(home, owner):
                print(f"refusing to remove {_s(name)}: its session (owner {_s(owner)}) is alive", file=sys.stderr)
                return 1
            if not ledger.remove_named(home, name):
                print(f"no box named {_s(name)} under {_s(home)}", file=sys.stderr)
                return 1
            print(f"removed {_s(name)}")
        return 0
    removed = ledger.reconcile(home, include_kept=args.kept)
    from pytest_boxlite import service_ledger

    service_ledger.prune(home)  # the records of services whose session is dead
    print(f"removed {len(removed)} box(es)" + (": " + ", ".join(_s(r) for r in removed) if removed else ""))
    return 0


def cmd_shell(args: argparse.Namespace) -> int:
    """Open a shell (or run a command) in a running box, e.g. one kept after a failure."""
    if not args.name:
        print(
            "error: shell needs the name of a running box: python -m pytest_boxlite shell NAME [COMMAND ...] "
            "(python -m pytest_boxlite ls lists them; --boxlite-keep keeps a failed test's box)",
            file=sys.stderr,
        )
        return 2
    home = _checked_home(args)
    argv = args.command or ["/bin/sh", "-i"]
    for k in kinds():
        code = k.attach_existing(home, args.name, argv)
        if code is not None:
            return code
    print(f"no running box named {_s(args.name)} under {_s(home)} that a shell can reach", file=sys.stderr)
    return 1


def _where_options(parser: argparse.ArgumentParser, *, default: Any) -> None:
    """``--home``, ``--url``, ``--credential-file``: before the sub-command or after it."""
    parser.add_argument(
        "--home", default=default, help="boxlite home (default: $PYTEST_BOXLITE_HOME or ~/.cache/pytest-boxlite)"
    )
    parser.add_argument(
        "--url", default=default, help="a remote BoxLite server (default: $PYTEST_BOXLITE_URL); key: $BOXLITE_API_KEY"
    )
    parser.add_argument("--credential-file", default=default, help="file holding the --url server's API key")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_boxlite",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _where_options(parser, default=None)
    # The same options after the sub-command: SUPPRESS keeps a value given before it.
    where = argparse.ArgumentParser(add_help=False)
    _where_options(where, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="cmd", required=True)
    doctor = sub.add_parser("doctor", help=cmd_doctor.__doc__, parents=[where])
    doctor.add_argument(
        "--selftest", action="store_true", help="also boot one micro-VM and check the vm runtime end to end"
    )
    doctor.set_defaults(fn=cmd_doctor)
    ls = sub.add_parser("ls", help=cmd_ls.__doc__, parents=[where])
    ls.add_argument("--images", action="store_true", help="list the image store's images instead of boxes")
    ls.set_defaults(fn=cmd_ls)
    clean = sub.add_parser("clean", help=cmd_clean.__doc__, parents=[where])
    clean.add_argument("names", nargs="*", help="box names to remove (default: every leftover of a dead session)")
    clean.add_argument("--kept", action="store_true", help="also remove boxes kept for debugging")
    clean.add_argument("--templates", action="store_true", help="also drop provisioned templates (--boxlite-setup)")
    clean.add_argument("--images", action="store_true", help="also empty the image store (images are unpacked again)")
    clean.set_defaults(fn=cmd_clean)
    shell = sub.add_parser("shell", help=cmd_shell.__doc__, parents=[where])
    shell.add_argument("name", nargs="?", help="the box (python -m pytest_boxlite ls lists them)")
    shell.add_argument("command", nargs=argparse.REMAINDER, help="what to run (default: an interactive /bin/sh)")
    shell.set_defaults(fn=cmd_shell)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except BoxliteError as exc:
        print(f"error: {_s(exc)}", file=sys.stderr)
        return 1
    except Refused as exc:
        print(f"error: {args.cmd}: {_s(exc)}; nothing was done through it", file=sys.stderr)
        return 1
    except OSError as exc:
        # Mostly a home this user may not read (another user's): say so, not a traceback.
        home = _home(args)
        if not (isinstance(exc.filename, str) and exc.filename.startswith(str(home))):
            print(f"error: {args.cmd} failed: {_s(_os_problem(exc))}", file=sys.stderr)
            return 1
        hint = ""
        if isinstance(exc, PermissionError):
            hint = (
                f"; uid {os.getuid()} may not use it: run this as the user who owns it, or name a home "
                "of your own with --home (or PYTEST_BOXLITE_HOME)"
            )
        print(
            f"error: {args.cmd} could not use the boxlite home {_s(home)}: {_s(_os_problem(exc))}{hint}",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
