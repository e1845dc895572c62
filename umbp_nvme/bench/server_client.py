"""``bench server``'s side of a running SGLang server: requests, /metrics, and its processes.

Plain ``urllib`` (nothing to install). The scheduler process is found among the server's
process group by its title (``sglang::scheduler``, set by SGLang with setproctitle); its OpenMP
worker is its busiest thread other than the main one (torch's OpenMP team: the main thread runs
the forward pass, the worker spins or sleeps between parallel regions).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .server_workload import parse_answer, parse_metrics


class ServerDied(RuntimeError):
    pass


def generate(port: int, ids: list[int], max_new_tokens: int, timeout_s: float = 300.0) -> dict:
    """One streamed greedy ``/generate``; the parsed answer (server_workload.parse_answer)."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
    chunks = []
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunks.append((time.monotonic(), json.loads(line[5:])))
    return parse_answer(chunks, t0)


def metrics(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return parse_metrics(r.read().decode("utf-8", "replace"))


def flush_cache(port: int) -> str:
    """SGLang's ``/flush_cache``: the radix tree and the host pool emptied (refused while requests run)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/flush_cache", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode("utf-8", "replace")


def wait_ready(port: int, proc: subprocess.Popen, log_path: str, timeout_s: float) -> float:
    """Seconds until ``/health_generate`` answers; ServerDied (with the log's tail) if the server
    exits or does not come up in time."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise ServerDied(f"server exited with {proc.returncode} during start:\n{log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=10) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise ServerDied(f"server not ready after {timeout_s:.0f} s:\n{log_tail(log_path)}")


def log_tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 20000))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            stat = _read(f"/proc/{d}/stat")
            if stat:
                fields = stat[stat.rfind(")") + 2:].split()
                if len(fields) > 2 and int(fields[2]) == pgid:
                    out.append(int(d))
    return out


def scheduler_pid(pgid: int) -> int | None:
    for pid in group_pids(pgid):
        if "scheduler" in _read(f"/proc/{pid}/cmdline").replace("\0", " "):
            return pid
    return None


def _cpu_ticks(pid: int, tid: int) -> int:
    stat = _read(f"/proc/{pid}/task/{tid}/stat")
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def omp_worker(pid: int) -> dict | None:
    """The busiest non-main thread of ``pid``: tid, CPU seconds, voluntary / involuntary switches."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return None
    if not tids:
        return None
    tid = max(tids, key=lambda t: _cpu_ticks(pid, t))
    status = dict(line.split(":", 1) for line in _read(f"/proc/{pid}/task/{tid}/status").splitlines() if ":" in line)
    return {"tid": tid, "cpu_s": _cpu_ticks(pid, tid) / os.sysconf("SC_CLK_TCK"),
            "vcsw": int(status.get("voluntary_ctxt_switches", "0").strip() or 0),
            "nvcsw": int(status.get("nonvoluntary_ctxt_switches", "0").strip() or 0)}


def process_cpu(pid: int) -> dict | None:
    """CPU seconds of the whole process (exited threads included) and of all but its two busiest
    threads (the scheduler's main thread and its OpenMP worker do the forward pass; the rest are
    HiCache's and the L3 backend's threads)."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None
    if len(fields) <= 12:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    total = (int(fields[11]) + int(fields[12])) / hz
    busiest = sorted((_cpu_ticks(pid, t) for t in tids), reverse=True)[:2]
    return {"cpu_s": round(total, 2), "rest_s": round(total - sum(busiest) / hz, 2), "threads": len(tids)}


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep one core busy (a plain Python loop), each in its own group."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                             stdin=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, 9)
        except ProcessLookupError:
            pass
        p.wait()
