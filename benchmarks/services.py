"""Processes and published ports (issue 24): ``Sandbox.spawn``, ``wait_for_port``, ``publish``.

Measured in this process on namespace boxes (booted, and forked from a zygote as a session makes
them), one box per mode, nothing else running:

* start to ready: ``spawn`` of a small TCP server (Python, standard library only) +
  ``wait_for_port`` until it listens; p50 over ``--starts`` (the server is killed between);
* ``spawn(["true"])`` + ``wait()`` against ``run(["true"])``, interleaved, p50 of ``--runs``;
* throughput: ``--mib`` MiB sent by a host client to a sink server (the same script) through a
  published port, against the same sink run on the host over direct loopback; best of
  ``--rounds``, side by side;
* round trip: one byte to an echo server and back, p50 of ``--pings``, published against direct;
* the reverse way, a boxed test's: a client in the box streams to and pings the host's servers at
  their host addresses, made reachable in the box by :mod:`pytest_boxlite.reach`.

Goals (issue 24): start to ready p50 <= 150 ms; throughput >= 0.5x direct; round trip p50 <= 3x
direct; spawn + exit of ``true`` <= 1.5x ``run``.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._bench import Table, log, machine_header, option

#: The server: ``MODE PORT`` (``sink``: read to the end, answer the byte count; ``echo``).
SERVER = r"""
import socket, sys, threading
mode, port = sys.argv[1], int(sys.argv[2])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(16)
if port == 0:
    print(srv.getsockname()[1], flush=True)
def serve(c):
    with c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if mode == "sink":
            buf = bytearray(1 << 20)
            total = 0
            while True:
                n = c.recv_into(buf)
                if not n:
                    break
                total += n
            c.sendall(b"%d\n" % total)
        else:
            while True:
                data = c.recv(65536)
                if not data:
                    return
                c.sendall(data)
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--starts", 20, 5, help="server starts (spawn + wait_for_port) per mode")
    option(p, "--runs", 50, 10, help="spawn(['true']) and run(['true']) each, per mode")
    option(p, "--mib", 256, 32, help="MiB streamed per throughput round")
    option(p, "--rounds", 3, 1, help="throughput rounds (best kept)")
    option(p, "--pings", 2000, 200, help="one-byte round trips")


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def _stream(address: tuple[str, int], mib: int) -> float:
    """Seconds to send ``mib`` MiB to a sink and get its count back."""
    chunk = b"\0" * (1 << 20)
    with socket.create_connection(address, timeout=60) as conn:
        t0 = time.perf_counter()
        for _ in range(mib):
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while not answer.endswith(b"\n"):
            more = conn.recv(64)
            if not more:
                break
            answer += more
        elapsed = time.perf_counter() - t0
    if int(answer or b"0") != mib << 20:
        raise RuntimeError(f"the sink counted {answer!r}, not {mib << 20} bytes")
    return elapsed


def _pings(address: tuple[str, int], n: int) -> list[float]:
    out = []
    with socket.create_connection(address, timeout=60) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n + 20):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise RuntimeError("the echo server hung up")
            out.append(time.perf_counter() - t0)
    return out[20:]  # warm-up


def _host_server(mode: str) -> tuple[subprocess.Popen[bytes], tuple[str, int]]:
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", SERVER, mode, "0"], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    return proc, ("127.0.0.1", port)


#: In a box: the same stream and round trips as the host's, to host servers at their host
#: addresses, reached through :mod:`pytest_boxlite.reach` (a boxed test's way to a service).
BOX_CLIENT = r"""
import json, socket, sys, time
sink, echo, mib, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with socket.create_connection(("127.0.0.1", sink), timeout=60) as conn:
    block = b"\0" * (1 << 20)
    t0 = time.perf_counter()
    for _ in range(mib):
        conn.sendall(block)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(64)
    elapsed = time.perf_counter() - t0
out = []
with socket.create_connection(("127.0.0.1", echo), timeout=60) as conn:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(n + 20):
        t0 = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(1)
        out.append(time.perf_counter() - t0)
print(json.dumps({"stream": elapsed, "rtt": out[20:]}))
"""


def _reached(sb: Any, sink_at: tuple[str, int], echo_at: tuple[str, int], args: argparse.Namespace) -> dict[str, Any]:
    """The box's side: its client to the host's servers at their addresses (reach)."""
    import json

    from pytest_boxlite import reach

    t0 = time.perf_counter()
    reach.prepare_booted(sb.name, getattr(sb.handle, "agent_pid", None), [sink_at, echo_at])
    offered = time.perf_counter() - t0
    argv = [sys.executable, "-I", "-S", "-c", BOX_CLIENT, str(sink_at[1]), str(echo_at[1]), str(args.mib)]
    r = sb.run([*argv, str(args.pings)], timeout=600, check=True)
    got = json.loads(r.stdout)
    return {"reach_offer": offered, "stream_reached": [got["stream"]], "rtt_reached": got["rtt"]}


def measure_mode(sb: Any, args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    res: dict[str, Any] = {}
    starts = []
    for _ in range(args.starts):
        t0 = time.perf_counter()
        proc = sb.spawn([py, "-I", "-S", "-c", SERVER, "echo", "7000"])
        sb.wait_for_port(7000, timeout=30, process=proc)
        starts.append(time.perf_counter() - t0)
        proc.close()
    res["start_to_ready"] = starts
    spawn_true, run_true = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        with sb.spawn(["true"]) as proc:
            proc.wait(30)
        t1 = time.perf_counter()
        sb.run(["true"], check=True)
        t2 = time.perf_counter()
        spawn_true.append(t1 - t0)
        run_true.append(t2 - t1)
    res["spawn_true"], res["run_true"] = spawn_true, run_true
    sink = sb.spawn([py, "-I", "-S", "-c", SERVER, "sink", "7001"])
    echo = sb.spawn([py, "-I", "-S", "-c", SERVER, "echo", "7002"])
    sb.wait_for_port(7001, timeout=30, process=sink)
    sb.wait_for_port(7002, timeout=30, process=echo)
    sink_at, echo_at = sb.publish(7001), sb.publish(7002)
    hsink, hsink_at = _host_server("sink")
    hecho, hecho_at = _host_server("echo")
    try:
        published, direct = [], []
        for _ in range(args.rounds):
            direct.append(_stream(hsink_at, args.mib))
            published.append(_stream(sink_at, args.mib))
        res["stream_direct"], res["stream_published"] = direct, published
        res["rtt_direct"] = _pings(hecho_at, args.pings)
        res["rtt_published"] = _pings(echo_at, args.pings)
        res.update(_reached(sb, hsink_at, hecho_at, args))
    finally:
        for p in (hsink, hecho):
            p.kill()
            p.wait()
    return res


def render(args: argparse.Namespace, res: dict[str, Any]) -> list[str]:
    lines = []
    for mode, r in res.items():
        ready = statistics.median(r["start_to_ready"])
        st, rt = statistics.median(r["spawn_true"]), statistics.median(r["run_true"])
        mib = args.mib
        best_d, best_p = min(r["stream_direct"]), min(r["stream_published"])
        d_p50, p_p50 = statistics.median(r["rtt_direct"]), statistics.median(r["rtt_published"])
        lines += [
            f"{mode} box:",
            f"  start to ready (spawn + wait_for_port): p50 {ready * 1e3:.1f} ms, "
            f"p90 {_pct(r['start_to_ready'], 0.9) * 1e3:.1f} ms   (goal: p50 <= 150 ms)",
            f"  spawn(['true']) + wait: p50 {st * 1e3:.2f} ms; run(['true']): p50 {rt * 1e3:.2f} ms; "
            f"ratio {st / rt:.2f}x   (goal <= 1.5x)",
            f"  {mib} MiB streamed: direct loopback {mib / best_d:.0f} MiB/s, published {mib / best_p:.0f} MiB/s;"
            f" published/direct {best_d / best_p:.2f}   (goal >= 0.5)",
            f"  1-byte round trip: direct p50 {d_p50 * 1e6:.0f} us, published p50 {p_p50 * 1e6:.0f} us; "
            f"ratio {p_p50 / d_p50:.2f}x   (goal <= 3x)",
        ]
        if "rtt_reached" in r:
            r_p50, best_r = statistics.median(r["rtt_reached"]), min(r["stream_reached"])
            lines.append(
                f"  a box's client to a host service at its address (reach; offered in "
                f"{r['reach_offer'] * 1e3:.0f} ms): {mib / best_r:.0f} MiB/s, round trip p50 "
                f"{r_p50 * 1e6:.0f} us ({r_p50 / d_p50:.2f}x direct)"
            )
    return lines


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    import warnings

    from pytest_boxlite.runtimes.namespace import NamespaceRuntime
    from pytest_boxlite.sandbox import Sandbox
    from pytest_boxlite.spec import BoxSpec

    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pbx-services-") as home:
        rt = NamespaceRuntime(Path(home))
        try:
            for mode, fork in (("booted", False), ("forked", True)):
                rt.allow_forked_boxes(fork)
                h = rt.create_box(BoxSpec(), f"pbx-services{mode[0]}-1", timeout=60)
                sb = Sandbox(h)
                try:
                    log(f"services: {mode} box")
                    res[mode] = measure_mode(sb, args)
                finally:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # the servers are left running on purpose
                        sb.end()
                    h.destroy()
        finally:
            rt.close()
    print("\n".join([*machine_header(), "", *render(args, res)]), flush=True)
    return 0, res


SERVICES = Table("services", "spawn, wait_for_port and published ports: start to ready, throughput, round trip",
                 __doc__ or "", add_arguments, run)  # fmt: skip
