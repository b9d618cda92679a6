"""The vocabulary of the boxed-test channel, shared by both ends.  Standard library only.

The host (:mod:`pytest_boxlite.remote`) and the guest (:mod:`pytest_boxlite.guest.session`,
:mod:`pytest_boxlite.guest.forks`) import this module, so both ends spell every message the same way.
Every message is a 2-tuple ``(name, fields)`` with ``fields`` a dict, as in pytest-xdist's
``sendcommand``/``sendevent``.  The warm interpreter's execnet channel carries control messages
only (as they are); a boxed test's messages travel on the socket of the fork that runs it (fresh
or in place), one JSON line ``[name, fields]`` each (tuples tagged, see :func:`tag`).

host -> warm interpreter (execnet channel)
    first message: a dict ``{"args", "cwd", "sys_path", "env", "resolved", "prefix", "xdist"}``
                                      (see ``WarmInterpreters.start`` in pytest_boxlite.remote)
    ``FORK {nodeid, token, sock, hostname, network, changes, in_place}``
                                      fork a box for ``nodeid`` (a fresh one; ``in_place``: a plain
                                      fork in this box) that connects to ``sock`` and runs each
                                      ``RUN`` sent on that stream (the first included)
    ``WAIT/POLL/KILL {pid}``          a forked box's exit status (``POLL`` does not wait)
    ``TEARDOWN_SHARED {keep, nodeid}`` tear down the fixtures this warm interpreter set up for its
                                      forked boxes (``FORK {shared: true}``) on the nodes whose ids
                                      are not in ``keep`` (the next item's chain; ``[]``: all), as
                                      pytest does after ``nodeid``; answered by
                                      ``SHARED_TORN_DOWN {report}``
    ``None``                          end the session
host -> forked box (its socket)
    ``RUN {nodeid, next, timeout}``   run one collected item; ``next`` is the item that follows in
                                      the same box (module fixtures stay up) or ``None``; ``timeout``:
                                      the seconds left of its bound (``LASTWORDS`` when they pass);
                                      ``changes`` (when asked): ``{files, ignore, usage}``, answered
                                      by ``CHANGES``
guest -> host (READY, FORKED, STATUS, SHARED_TORN_DOWN on the channel; the rest on a fork's socket)
    ``READY {pid, collected}``        the session is collected once, items are indexed by node id
    ``REPORT {data}``                 a serialized ``TestReport`` (``pytest_report_to_serializable``)
    ``WARNING {message, category, module, filename, lineno, line, nodeid}``
                                      a warning recorded while the test ran; ``line``: its source
                                      line as the box read it (the host reads no file a box names)
    ``EXIT {reason, returncode}``     the test called ``pytest.exit()``
    ``OUTPUT {stream, text}``         with ``-s``: what the test (and its subprocesses) printed, as it prints
    ``CACHE {values}``                what the test stored with ``config.cache.set`` (key -> JSON value)
    ``COVERAGE {arcs, files}``        the box's coverage data so far, when coverage runs in the box
                                      (file -> lines, or arcs as ``[a, b]`` pairs)
    ``FILES {files}``                 files the test wrote under :data:`WRITE_BACK` (relative path ->
                                      base64), e.g. the hypothesis example database
    ``CHANGES {files, processes, env, cwd, umask, usage, notes}``
                                      what the test left (RUN's ``changes`` asked): see
                                      :mod:`pytest_boxlite.guest.changes`; sent once, before ``DONE``
    ``ERROR {text}``                  the item could not run in the box (not collected there, ...)
    ``LASTWORDS {when, out, err, log}``
                                      the test's timeout passed: what pytest captured so far of the
                                      running phase (the host kills the box as before)
    ``DONE {}``                       end of one ``RUN`` (or of a forked box's stream)
    ``FORKED {pid, ended}`` / ``STATUS {code}``
                                      ``ended``: forked boxes reaped since the last FORK (pids)
    ``TOKEN {token}``                 first line of a forked box's stream: which request it answers
    ``SHARED_TORN_DOWN {report}``     the answer to ``TEARDOWN_SHARED``: a serialized teardown
                                      report of ``nodeid`` (its output and errors), or ``None`` if
                                      nothing was torn down
    ``DEBUG {op, ...}``               a forked box's debugger (``breakpoint()``, ``--pdb``), relayed
                                      to the host's terminal (:mod:`pytest_boxlite.guest.debugger`):
                                      ``enter {title}`` a session starts, ``sep {title}`` a separator
                                      line, ``out {text}`` what it prints, ``read {}`` it waits for a
                                      line, ``leave {}`` it continued
host -> forked box (its socket, during a run, one line per ``DEBUG read``)
    ``DEBUG {line}`` / ``DEBUG {eof: true}`` / ``DEBUG {interrupt: true}``
                                      the user's line, the end of the host's stdin, or Ctrl-C
"""

from typing import Any

RUN = "run"
FORK = "fork"
WAIT = "wait"
POLL = "poll"
KILL = "kill"
READY = "ready"
REPORT = "report"
WARNING = "warning"
EXIT = "exit"
CACHE = "cache"
OUTPUT = "output"
COVERAGE = "coverage"
FILES = "files"
ERROR = "error"
DONE = "done"
FORKED = "forked"
STATUS = "status"
TOKEN = "token"
TEARDOWN_SHARED = "shared"
SHARED_TORN_DOWN = "torndown"
LASTWORDS = "lastwords"
DEBUG = "debug"
CHANGES = "changes"

#: Messages a test may send while it runs (everything else ends or is foreign to a run).
RUN_MESSAGES = (REPORT, WARNING, EXIT, OUTPUT, CACHE, COVERAGE, FILES, ERROR, DONE, LASTWORDS, DEBUG, CHANGES)

#: Longest text the guest puts in one report field (a section, the failure's text).
FIELD_CAP = 1 << 20

#: Directories (relative to the invocation directory) whose new files a box hands back to the
#: host after each test: the hypothesis example database, so a failure found in a box replays.
WRITE_BACK = (".hypothesis/examples",)

#: At most this many files and bytes come back per test.
WRITE_BACK_FILES = 1000
WRITE_BACK_BYTES = 16 << 20

#: Longest text of one ``DEBUG out`` frame (the guest cuts what its debugger prints into such
#: pieces), and of one line of the user's that the host sends back.
DEBUG_TEXT_CAP = 1 << 16
#: What the host prints of one boxed test's debugger sessions together (each frame counts at
#: least :data:`DEBUG_FRAME_COST`): a box that prints on and on fails instead.
DEBUG_OUTPUT_CAP = 16 << 20
DEBUG_FRAME_COST = 80

#: Longest JSON line the host accepts from a forked box (a report with capped fields fits).
LINE_CAP = 16 << 20


def tag(obj: object) -> object:
    """JSON has no tuples, and pytest's reports need theirs back: mark them (undone by :func:`untag`)."""
    if isinstance(obj, tuple):
        return {"__tuple__": [tag(x) for x in obj]}
    if isinstance(obj, list):
        return [tag(x) for x in obj]
    if isinstance(obj, dict):
        return {k: tag(v) for k, v in obj.items()}
    return obj


def untag(obj: "dict[str, Any]") -> object:
    """``json.loads`` object hook: tuples tagged by :func:`tag` come back as tuples."""
    if len(obj) == 1 and "__tuple__" in obj:
        return tuple(obj["__tuple__"])
    return obj


def cap(text: str, what: str = "of this section") -> str:
    """``text`` cut to at most :data:`FIELD_CAP` characters, saying how much was cut.

    The note fits in the cap, so capping again (the host re-caps what a box sent) changes nothing.
    """
    if len(text) <= FIELD_CAP:
        return text
    keep = FIELD_CAP - 200
    note = "\n[pytest-boxlite: %d more characters %s were cut]\n" % (len(text) - keep, what[:100])
    return text[:keep] + note
