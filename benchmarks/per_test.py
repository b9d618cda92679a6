"""The cost of one boxed test, wall and CPU, beside pytest-forked and pytest-isolate.

Suites: ``--tests`` trivial tests (``def test_i(): pass``; in one module unless ``--per-module``)
and as many tests that each take ``boxlite_sandbox`` and run one ``execute_command("true")``.

Rows (interleaved rounds; see ``_rows``): plain pytest; plain with ``-p no:boxlite`` (what having
the plugin installed costs a run that boxes nothing; these two run five times a round); ``--boxlite``; ``--boxlite
--boxlite-scope=module``; ``boxlite_sandbox`` + one command; ``--boxlite --boxlite-side-effects=report``
against ``--boxlite`` (what listing each test's side effects adds); pytest-forked ``--forked`` and
pytest-isolate ``--isolate``, each against a plain run of their own pytest 8 environment (see
``_peers``); and, in ``per-test`` only, ``python -m pytest <nodeid>`` once per test (the
subprocess-per-test baseline: the mean of ``--subprocess-tests`` invocations, scaled).

``per-test`` compares each row's wall overhead per test with pytest-forked's; ``cpu`` compares the
CPU per test (``--cpu-meter``: by default a cgroup per run, which counts every process of the run,
host and boxes, and nothing else, so it holds on a busy machine; where no cgroup can be made, or
with ``--cpu-meter proc-stat``, the machine's busy CPU from ``/proc/stat``, a quiet machine's
figure; the table says which) and then runs the ``real-suites`` table (not under ``--quick``), so
one command prints the CPU per test of the trivial suite and of real projects' suites side by side.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

from benchmarks import _rows, _suites
from benchmarks._bench import (
    RunFailed,
    Table,
    Workdir,
    cpu_meter_option,
    div,
    fmt_delta,
    fmt_ratio,
    log,
    machine_header,
    option,
    positive,
    seconds,
    use_cpu_meter,
)
from benchmarks._peers import ISOLATE_ARGS, peers
from benchmarks._rows import Row

#: Targets, printed with ``holds`` / ``DOES NOT HOLD``.
TARGET_CPU_VS_FORKED = 1.2  # CPU per boxed test <= 1.2x pytest-forked's
TARGET_SIDE_EFFECTS = 0.001  # --boxlite-side-effects=report adds <= 1 ms of CPU per test that writes nothing
TARGET_PLUGIN_OFF = 0.025  # the plugin installed costs a run that boxes nothing <= 25 ms
TARGET_WALL_VS_FORKED = 2.0  # --boxlite wall overhead <= 2x pytest-forked's
TARGET_MODULE = 0.005  # --boxlite-scope=module <= 5 ms per test
TARGET_SANDBOX = 0.015  # boxlite_sandbox + one command <= 15 ms per test (p50)
TARGET_VS_SUBPROCESS = 5.0  # >= 5x cheaper than python -m pytest <nodeid> per test


def add_common(p: argparse.ArgumentParser) -> None:
    option(p, "--tests", 200, 20, help="trivial tests, and boxlite_sandbox tests")
    option(p, "--per-module", 0, 0, type=int, help="tests per module (0: all in one module)")
    option(p, "--rounds", 3, 1, help="interleaved rounds")
    option(p, "--timeout", 600.0, 300.0, type=seconds, help="bound on each pytest run, seconds")
    p.add_argument("--no-peers", action="store_true", help="skip the pytest-forked and pytest-isolate rows")
    p.add_argument("--retry-isolate", action="store_true", help="try pip install pytest-isolate again")
    cpu_meter_option(p)


def add_per_test(p: argparse.ArgumentParser) -> None:
    add_common(p)
    option(p, "--subprocess-tests", 40, 5, help="invocations of the python -m pytest <nodeid> row")


def add_cpu(p: argparse.ArgumentParser) -> None:
    from benchmarks import real_suites

    add_common(p)
    p.add_argument("--no-real-suites", action="store_true", help="only the trivial suite (as --quick does)")
    option(p, "--floor-reps", 30, 10, help="repetitions of each floor step (profile-fork's floor)")
    p.add_argument("--no-floor", action="store_true", help="skip the floor lines")
    real_suites.add_suite_options(p)


def floor_lines(f: dict[str, Any], reps: int, boxed: float | None) -> list[str]:
    """The floor (profile-fork's floor steps ``f``, measured in this interpreter), against the
    --boxlite row's CPU per test ``boxed``: what a box as --boxlite makes it costs at least, and
    how much of that is the one fork pytest-forked pays too."""
    from benchmarks import fork_profile

    cpu = {s["step"].strip(): s["cpu_p50"] for s in f["steps"] if "cpu_p50" in s}
    bound = fork_profile.isolation_floor(f["steps"])
    fork = cpu.get("fork + _exit + wait (warm interpreter)")
    forked = cpu.get("fork + runtest protocol of a trivial test (pytest-forked)")
    if bound is None or fork is None or not forked:
        return ["floor: not measured here (a floor step is missing)"]
    pid1 = "native" if "+ pid 1 (native boxinit) forks the test process" in cpu else "Python"
    lines = [
        f"floor (each step alone, this interpreter forked, RSS {f['rss_kib'] / 1024:.0f} MiB, n={reps}): "
        f"pytest-forked's fork + runtest {forked * 1e3:.2f} ms CPU; with new namespaces and the {pid1} pid 1 "
        f"(no mount, no message) {bound[0] * 1e3:.2f} ms, {bound[1]:.2f}x pytest-forked's; of either, the one "
        f"fork pytest-forked pays too: {fork * 1e3:.2f} ms"
    ]
    if boxed is not None:
        lines.append(
            f"--boxlite's {fmt_delta(boxed)} per test is {fmt_delta(boxed - bound[0])} above that floor "
            "(mounts, messages, cells, the Python around the steps: profile-fork's phases)"
        )
    return lines


def rows(args: argparse.Namespace, python8: str | None, isolate_env: dict[str, str] | None) -> list[Row]:
    out = [
        # Its base: what having the plugin installed costs a run that boxes nothing.
        # Five runs a round each: the difference is tens of ms of a run's few hundred, on a shared machine.
        Row("plain", "plain", "trivial", base="plain-off", compare=False, repeat=5),
        Row("plain-off", "plain, plugin off (-p no:boxlite)", "trivial", ("-p", "no:boxlite"), repeat=5),
        # The same pair with no bytecode cache (NO_BYTECODE): every module is compiled at each start.
        Row(
            "plain-nobc",
            "plain, no bytecode cache",
            "trivial",
            env=NO_BYTECODE,
            base="plain-off-nobc",
            compare=False,
            repeat=5,
        ),
        Row(
            "plain-off-nobc",
            "plain, plugin off, no bytecode cache",
            "trivial",
            ("-p", "no:boxlite"),
            env=NO_BYTECODE,
            repeat=5,
        ),
        Row("boxed", "--boxlite", "trivial", ("--boxlite",), base="plain"),
        # The same with the Python pid 1 (a second copy of the warm interpreter per box), against
        # the native one that --boxlite runs where the package was built with a C compiler.
        Row(
            "boxed-py",
            "--boxlite, Python pid 1 (PYTEST_BOXLITE_NATIVE_INIT=0)",
            "trivial",
            ("--boxlite",),
            env={"PYTEST_BOXLITE_NATIVE_INIT": "0"},
            base="plain",
        ),
        Row(
            "module",
            "--boxlite --boxlite-scope=module",
            "trivial",
            ("--boxlite", "--boxlite-scope=module"),
            base="plain",
        ),
        Row("sandbox", "boxlite_sandbox + execute_command('true')", "sandbox", base="plain", boxed=True),
        # Against --boxlite itself: what listing each test's side effects adds (issue 43).
        Row(
            "side-effects",
            "--boxlite --boxlite-side-effects=report",
            "trivial",
            ("--boxlite", "--boxlite-side-effects=report"),
            base="boxed",
            compare=False,
        ),
    ]
    if python8 is not None:
        out += [
            Row("plain8", "plain (pytest 8 venv)", "trivial", python=python8),
            Row("forked", "pytest-forked --forked", "trivial", ("--forked",), python=python8, base="plain8"),
        ]
        if isolate_env is not None:
            out += [
                Row("plain8-iso", "plain (pytest 8 venv, pytest-isolate on the path)", "trivial", ISOLATE_ARGS,
                    python=python8, env=isolate_env),
                Row("isolate", "pytest-isolate --isolate", "trivial", (*ISOLATE_ARGS, "--isolate"), python=python8,
                    env=isolate_env, base="plain8-iso"),
            ]  # fmt: skip
    if getattr(args, "subprocess_tests", 0):
        out.append(
            Row("subprocess", "python -m pytest <nodeid>, once per test", "trivial", base="plain",
                each_test=min(args.subprocess_tests, args.tests))
        )  # fmt: skip
    return out


def measure(args: argparse.Namespace, work: Workdir) -> tuple[dict[str, dict[str, Any]], list[str]]:
    if args.no_peers:
        python8, isolate_env, notes = None, None, ["pytest-forked and pytest-isolate rows skipped (--no-peers)"]
    else:
        pe = peers(work.root, isolate=True, retry_isolate=args.retry_isolate, timeout=args.timeout)
        python8, isolate_env, notes = (str(pe.python8) if pe.python8 else None), pe.isolate_env, pe.notes
    suites = {
        "trivial": _suites.trivial(work.root / "trivial", args.tests, args.per_module or None),
        "sandbox": _suites.sandbox(work.root / "sandbox", args.tests),
    }
    res = _rows.measure(rows(args, python8, isolate_env), suites, work, rounds=args.rounds, timeout=args.timeout)
    return res, notes


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("holds" if ok else "DOES NOT HOLD")


#: A run with no bytecode cache to read or write: a fresh checkout in a shell that sets
#: PYTHONDONTWRITEBYTECODE=1 (``clean_env`` drops the caller's setting; these rows set it), where
#: every module is compiled at each start.  The prefix directory stays empty: nothing is written.
NO_BYTECODE = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONPYCACHEPREFIX": os.path.join(tempfile.gettempdir(), "boxlite-bench-no-pycache"),
}


def plugin_off_lines(res: dict[str, dict[str, Any]]) -> list[str]:
    """The plugin-off target, with bytecode caches and (where measured) without."""
    lines = [plugin_off_line(res)]
    if "plain-nobc" in res and "plain-off-nobc" in res:
        lines.append(plugin_off_line(res, "-nobc", ", no bytecode cache (PYTHONDONTWRITEBYTECODE=1, fresh checkout)"))
    return lines


def plugin_off_line(res: dict[str, dict[str, Any]], suffix: str = "", what: str = "") -> str:
    on, off = res["plain" + suffix], res["plain-off" + suffix]
    cost = on["wall"] - off["wall"]
    cpu = on["cpu"] - off["cpu"] if on["cpu"] is not None and off["cpu"] is not None else None
    return (
        f"target: the plugin installed costs a run that boxes nothing{what} {fmt_delta(cost)} of wall"
        + (f" ({fmt_delta(cpu)} of CPU)" if cpu is not None else "")
        + f", plain against -p no:boxlite (<= +{TARGET_PLUGIN_OFF * 1e3:.0f} ms: {_verdict(cost <= TARGET_PLUGIN_OFF)})"
    )


def targets_per_test(res: dict[str, dict[str, Any]]) -> list[str]:
    boxed, module, sandbox = res["boxed"], res["module"], res["sandbox"]
    lines = []
    forked = res.get("forked")
    if forked is not None:
        r = div(boxed["overhead"], forked["overhead"])
        lines.append(
            f"target: --boxlite wall overhead / pytest-forked's {fmt_ratio(r)} "
            f"(<= {TARGET_WALL_VS_FORKED:.0f}x: {_verdict(None if r is None else r <= TARGET_WALL_VS_FORKED)})"
        )
    lines.append(
        f"target: --boxlite-scope=module {fmt_delta(module['overhead'])} per test "
        f"(<= {TARGET_MODULE * 1e3:.0f} ms: {_verdict(module['overhead'] <= TARGET_MODULE)})"
    )
    p50 = sandbox["overhead_p50"]
    lines.append(
        f"target: boxlite_sandbox + one command p50 {fmt_delta(p50)} per test, wall {fmt_delta(sandbox['overhead'])} "
        f"(<= {TARGET_SANDBOX * 1e3:.0f} ms p50: {_verdict(None if p50 is None else p50 <= TARGET_SANDBOX)})"
    )
    sub = res.get("subprocess")
    if sub is not None:
        r = div(sub["overhead"], boxed["overhead"])
        lines.append(
            f"target: python -m pytest <nodeid> per test / --boxlite, wall overhead {fmt_ratio(r)} "
            f"(>= {TARGET_VS_SUBPROCESS:.0f}x: {_verdict(None if r is None else r >= TARGET_VS_SUBPROCESS)})"
        )
    lines += plugin_off_lines(res)
    return lines


def targets_cpu(res: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    forked = res.get("forked")
    for key in ("boxed", "boxed-py", "module", "sandbox"):
        r = res[key]
        ratio = div(r["overhead_cpu"], forked["overhead_cpu"]) if forked is not None else None
        line = f"CPU per test, {r['label']}: {fmt_delta(r['overhead_cpu'])}"
        if forked is not None:
            line += f", {fmt_ratio(ratio)} pytest-forked's {fmt_delta(forked['overhead_cpu'])}"
        if key == "boxed" and forked is not None:
            ok = None if ratio is None else ratio <= TARGET_CPU_VS_FORKED
            line += f" (target <= {TARGET_CPU_VS_FORKED}x: {_verdict(ok)})"
        lines.append(line)
    native, python = res["boxed"]["overhead_cpu"], res.get("boxed-py", {}).get("overhead_cpu")
    if native is not None and python is not None:
        from pytest_boxlite import guest

        lines.append(
            f"pid 1: {guest.pid1_line()}; the Python pid 1 costs {fmt_delta(python - native)} of CPU per test more"
        )
    iso = res.get("isolate")
    if iso is not None:
        lines.append(f"CPU per test, pytest-isolate: {fmt_delta(iso['overhead_cpu'])}")
    se = res.get("side-effects")
    if se is not None:
        cost = se["overhead_cpu"]
        ok = None if cost is None else cost <= TARGET_SIDE_EFFECTS
        lines.append(
            f"target: --boxlite-side-effects=report against off, CPU per test {fmt_delta(cost)} "
            f"(<= +{TARGET_SIDE_EFFECTS * 1e3:.0f} ms: {_verdict(ok)})"
        )
    lines += plugin_off_lines(res)
    cores = res["boxed"]["cores"]
    if cores:
        import os

        cpus = os.cpu_count() or 1
        lines.append(
            f"--boxlite alone keeps {cores:.2f} of {cpus} cores busy: on this machine no number of xdist "
            f"workers can make it more than {cpus / cores:.2f}x faster"
        )
    return lines


def run_per_test(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    meter = use_cpu_meter(args)
    with Workdir("per-test") as work:
        try:
            res, notes = measure(args, work)
        except RunFailed as exc:
            return _rows.failed(exc), {}
    out = [
        *machine_header(),
        f"per-test cost of a trivial test: {args.tests} tests, median of {args.rounds} interleaved round(s)",
        meter.describe(),
        *notes,
        "",
        *_rows.render(res, peer="forked" if "forked" in res else None, by="overhead"),
        "",
        *targets_per_test(res),
        "",
        *_rows.commands(res),
    ]
    print("\n".join(out), flush=True)
    return 0, {"rows": res, "notes": notes}


def run_cpu(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    meter = use_cpu_meter(args)
    with Workdir("cpu") as work:
        try:
            res, notes = measure(args, work)
        except RunFailed as exc:
            return _rows.failed(exc), {}
        floor: list[str] = []
        if not args.no_floor:
            from benchmarks import fork_profile

            f = fork_profile.floor(argparse.Namespace(tests=20, floor_reps=args.floor_reps), work.root)
            floor = ["", *floor_lines(f, args.floor_reps, res["boxed"]["overhead_cpu"])]
    out = [
        *machine_header(),
        f"CPU per test: {args.tests} trivial tests, median of {args.rounds} interleaved round(s)",
        meter.describe(),
        *notes,
        "",
        *_rows.render(res, peer="forked" if "forked" in res else None, by="overhead_cpu"),
        "",
        *targets_cpu(res),
        *floor,
        "",
        *_rows.commands(res),
    ]
    print("\n".join(out), flush=True)
    results: dict[str, Any] = {"rows": res, "notes": notes}
    if args.quick or args.no_real_suites:
        return 0, results
    from benchmarks import real_suites

    print("", flush=True)
    log("real suites")
    rc, results["real_suites"] = real_suites.run_suites(args, trivial=res)
    return rc, results


PER_TEST = Table(
    "per-test",
    "wall cost of a boxed trivial test beside pytest-forked, pytest-isolate, a process per test",
    __doc__ or "",
    add_per_test,
    run_per_test,
)
CPU = Table(
    "cpu",
    "CPU per boxed test beside pytest-forked and pytest-isolate, then the real suites",
    __doc__ or "",
    add_cpu,
    run_cpu,
)
__all__ = ["CPU", "PER_TEST", "positive"]
