"""SGLang's real HTTP server with this store as L3, beside HiCache without L3, no HiCache, and
SGLang's ``file`` backend: what the L3 serves and what it costs the server (issue 39).

    umbp-nvme bench server [--rounds N] [--quick] [--busy-cores N] [--omp-wait-policy P]
                           [--crash] [--json PATH] [--plot PATH]

Installs nothing (tools/install_sglang.sh, then tools/install_sglang_server.sh). Each round starts
a fresh server per arm, the arms' order rotating between rounds, one server at a time:

  umbp  HiCache (device + 2x host) with this store as L3: the README's launch command
  l2    HiCache with host memory only
  none  no HiCache
  file  HiCache with SGLang's ``file`` backend as L3

on a tiny Llama of dummy weights (a model directory holding only config.json, generated), on CPU
with the test shims of umbp_nvme/bench/sglang_shims/cpu_server (server_launch.py). The workload
(server_workload.py) overflows the device and host pools, re-sends prompts (only L3 can serve
them), sends fresh ones of the same length in between, and one prompt changed in an early token.
Reported per arm and phase: TTFT and end-to-end medians, tokens served per tier
(``cached_tokens_details``), prefill tok/s, /metrics deltas (SGLang's storage hits, our store's
gets / hits / puts), and the scheduler's OpenMP worker thread's voluntary context switches.

``--busy-cores N`` keeps N cores busy with plain loops meanwhile. ``--omp-wait-policy`` sets
OMP_WAIT_POLICY in the servers' environment (never the store's doing; docs/sglang.md §11).
``--crash`` then SIGKILLs a umbp server mid-fill, restarts it on the same store, re-sends the
prompts answered before the kill (each must be an L3 hit with its first output) and runs
``umbp-nvme verify`` on the store. ``--json`` is rewritten after every round; a failed arm is
recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from . import server_client as client
from . import server_events as events_mod
from . import server_launch as launch
from .common import target_line
from .server_workload import PHASES, check_answers, make_workload, metrics_delta, summarize, verdicts

BENCH = "server"
ARMS = ("umbp", "l2", "none", "file")
PAGE_SIZE = 64
HICACHE_FLAGS = ["--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-write-policy", "write_through",
                 "--hicache-mem-layout", "page_first", "--hicache-io-backend", "kernel"]
REPORT_FLAGS = ["--enable-metrics", "--enable-cache-report"]


def arm_args(arm: str, *, model_dir: str, port: int, store_dir: str, capacity: str = "4GiB",
             events: events_mod.Ports | None = None) -> tuple[list[str], dict]:
    """sglang.launch_server's arguments for one arm, and the environment it adds; ``events``
    (umbp): the scheduler's KV events and the backend's relay of them (server_events.py)."""
    base = ["--model-path", model_dir, "--port", str(port), *launch.CPU_FLAGS, "--page-size", str(PAGE_SIZE)]
    if arm == "none":
        return base + REPORT_FLAGS, {}
    if arm == "l2":
        return base + HICACHE_FLAGS + REPORT_FLAGS, {}
    if arm == "file":
        return (base + HICACHE_FLAGS + ["--hicache-storage-backend", "file"] + REPORT_FLAGS,
                {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": store_dir})
    if arm == "umbp":
        more = events_mod.extra_config(events) if events else {}
        extra = json.dumps(launch.umbp_extra_config(store_dir, capacity, **more))
        flags = events_mod.server_flags(events) if events else []
        return (base + HICACHE_FLAGS + ["--hicache-storage-backend", "dynamic",
                                        "--hicache-storage-backend-extra-config", extra] + REPORT_FLAGS + flags, {})
    raise ValueError(f"unknown arm {arm!r}; expected one of {', '.join(ARMS)}")


class Server:
    """One server of one arm, started and always stopped (its whole process group)."""

    def __init__(self, cfg, arm: str, store_dir: str, log_path: str):
        self.cfg, self.arm, self.log_path = cfg, arm, log_path
        events = events_mod.Ports(cfg.port) if cfg.kv_events and arm == "umbp" else None
        self.args, extra_env = arm_args(arm, model_dir=cfg.model_dir, port=cfg.port, store_dir=store_dir, events=events)
        self.env = {**launch.server_env(ext_dir=cfg.ext_dir, omp_wait_policy=cfg.omp_policy_env), **extra_env}
        self.proc = None

    def __enter__(self):
        self.proc = launch.start(self.args, self.env, self.log_path, python=self.cfg.python)
        self.start_s = client.wait_ready(self.cfg.port, self.proc, self.log_path, self.cfg.start_timeout_s)
        return self

    def kill(self, sig: int) -> None:
        launch.stop(self.proc, sig)

    def __exit__(self, *exc):
        launch.stop(self.proc)


def send_all(cfg, requests: list[dict], records: list[dict]) -> None:
    for req in requests:
        rec = {"phase": req["phase"], "name": req["name"], "of": req["of"]}
        try:
            rec.update(client.generate(cfg.port, req["ids"], cfg.max_new_tokens))
        except Exception as e:  # one bad answer is recorded; the server's death ends the arm
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)


def warm(cfg) -> None:
    """One short request first: one-time costs (first forward, allocations) stay out of fill0."""
    client.generate(cfg.port, list(range(100, 100 + 2 * PAGE_SIZE)), 2)


def run_arm(cfg, arm: str, workload: list[dict], work: str, tag: str) -> dict:
    store_dir = os.path.join(work, f"{tag}-{arm}-store")
    out = {"arm": arm}
    watch = None
    try:
        if cfg.kv_events and arm == "umbp":  # inside: an indexer that fails to start fails this arm only
            watch = events_mod.Watch(events_mod.Ports(cfg.port), work, cfg.dynamo_python)
        with Server(cfg, arm, store_dir, os.path.join(work, f"{tag}-{arm}.log")) as srv:
            out["start_s"] = srv.start_s
            if watch:
                watch.attach()
            warm(cfg)
            before = client.metrics(cfg.port)
            records: list[dict] = []
            if watch:  # checkpoints between the phases (the pause lets backups finish: timings differ)
                fills = [r for r in workload if r["phase"] == "fill"]
                send_all(cfg, fills, records)
                _wait_backups_settle(cfg)
                watch.checkpoint("fill", store_dir)
                send_all(cfg, workload[len(fills):], records)
            else:
                send_all(cfg, workload, records)
            time.sleep(1.0)  # let write-through backups of the last prompts land in the counters
            out["metrics"] = metrics_delta(before, client.metrics(cfg.port))
            sched = client.scheduler_pid(srv.proc.pid)
            out["omp_worker"] = client.omp_worker(sched) if sched else None
            out["server_cpu"] = client.process_cpu(sched) if sched else None
            if watch:
                _events_after_workload(cfg, watch, workload, store_dir)
        out["summary"] = summarize(records)
        out["checks"] = check_answers(records, PAGE_SIZE)
        out["records"] = [{k: v for k, v in r.items() if k != "output_ids"} | {"output_head": r.get("output_ids", [])[:8]}
                          for r in records]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if watch:
            out["events"] = _events_result(watch)
        shutil.rmtree(store_dir, ignore_errors=True)
    return out


def _events_after_workload(cfg, watch, workload: list[dict], store_dir: str) -> None:
    """Checkpoints after the re-sends and after SGLang's /flush_cache (GPU and host emptied, L3
    kept), each with a query of the last re-sent prompt."""
    resent = [r for r in workload if r["phase"] == "resent"][-1]["ids"]
    _wait_backups_settle(cfg)
    watch.checkpoint("re-sends", store_dir)
    watch.query("re-sends", resent, PAGE_SIZE)
    client.flush_cache(cfg.port)
    watch.checkpoint("flush_cache", store_dir)
    watch.query("flush_cache", resent, PAGE_SIZE)


def _events_result(watch) -> dict:
    res = {"rows": watch.rows, "queries": watch.queries, "failures": events_mod.failures(watch.rows, watch.queries),
           "dynamo": watch.indexer is not None}  # fmt: skip
    watch.close()
    return res


def _wait_backups_settle(cfg, timeout_s: float = 30.0) -> None:
    """Until our store's puts stop growing (the write-through backups of answered prompts)."""
    last, t0 = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        now = client.metrics(cfg.port)["umbp_puts"]
        if now == last and now > 0:
            return
        last = now
        time.sleep(1.0)


def run_crash(cfg, workload: list[dict], work: str) -> dict:
    """SIGKILL a umbp server mid-fill, restart it on the same store, re-send, verify."""
    store_dir = os.path.join(work, "crash-store")
    fills = [r for r in workload if r["phase"] == "fill"]
    before_kill = fills[: cfg.crash_after]
    out = {"answered_before_kill": len(before_kill)}
    watch = None
    try:
        if cfg.kv_events:
            watch = events_mod.Watch(events_mod.Ports(cfg.port), work, cfg.dynamo_python)
        with Server(cfg, "umbp", store_dir, os.path.join(work, "crash-1.log")) as srv:
            if watch:
                watch.attach()
            warm(cfg)
            first: list[dict] = []
            send_all(cfg, before_kill, first)
            _wait_backups_settle(cfg)
            if watch:
                watch.checkpoint("before the kill", store_dir)
            inflight = threading.Thread(target=send_all, args=(cfg, [fills[cfg.crash_after]], []), daemon=True)
            inflight.start()
            time.sleep(cfg.kill_after_s)  # the next prompt is being prefilled and backed up
            srv.kill(9)
            inflight.join(30)
        if watch:
            watch.detach()
        with Server(cfg, "umbp", store_dir, os.path.join(work, "crash-2.log")) as srv:
            out["restart_s"] = srv.start_s
            if watch:
                watch.attach()
            again: list[dict] = []
            send_all(cfg, [dict(r, phase="resent", name=f"resent{i}", of=r["name"]) for i, r in enumerate(before_kill)], again)
            if watch:
                _wait_backups_settle(cfg)
                watch.checkpoint("crash+restart", store_dir)
                watch.query("crash+restart", before_kill[-1]["ids"], PAGE_SIZE)
        out["checks"] = check_answers(first + again, PAGE_SIZE)
        v = subprocess.run([cfg.python, "-m", "umbp_nvme.cli", "verify", "--store", store_dir], capture_output=True, text=True,
                           env=launch.server_env(ext_dir=cfg.ext_dir, cpu_shims=False), timeout=300)
        out["verify_rc"], out["verify_tail"] = v.returncode, (v.stdout + v.stderr)[-600:]
        c = out["checks"]
        out["ok"] = (c["resent"] == c["resent_l3"] == c["resent_identical"] == len(before_kill) and v.returncode == 0)
    except Exception as e:
        out["error"], out["ok"] = f"{type(e).__name__}: {e}", False
    finally:
        if watch:
            out["events"] = _events_result(watch)
            out["ok"] = out["ok"] and not out["events"]["failures"]
        shutil.rmtree(store_dir, ignore_errors=True)
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench server", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=0, help="rounds of the four arms (default 3, --quick 1)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}")
    p.add_argument("--quick", action="store_true", help="1 round, a smaller workload")
    p.add_argument("--busy-cores", type=int, default=0, help="keep N cores busy (plain loops) during the run")
    p.add_argument("--omp-wait-policy", default="default",
                   help="OMP_WAIT_POLICY for the servers: default (unset), PASSIVE, ACTIVE")
    p.add_argument("--crash", action="store_true", help="also: SIGKILL a umbp server mid-fill, restart, re-send, verify")
    p.add_argument("--kv-events", action="store_true",
                   help="umbp arm: the scheduler's KV events relayed with ours, checked per tier (server_events.py)")
    p.add_argument("--dynamo-python", metavar="PYTHON", default=os.environ.get("UMBP_DYNAMO_PYTHON", ""),
                   help="--kv-events: also NVIDIA Dynamo's indexer, run by this interpreter (tools/install_dynamo.sh); "
                        "default $UMBP_DYNAMO_PYTHON")
    p.add_argument("--fill", type=int, default=0, help="distinct prompts first (default 20, --quick 14)")
    p.add_argument("--resend", type=int, default=0, help="fill prompts re-sent (default 10, --quick 4)")
    p.add_argument("--fresh", type=int, default=0, help="fresh prompts between them (default 10, --quick 4)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--crash-after", type=int, default=6, help="--crash: prompts answered before the kill")
    p.add_argument("--kill-after-s", type=float, default=0.3, help="--crash: seconds into the next prompt")
    p.add_argument("--port", type=int, default=31457)
    p.add_argument("--python", default=sys.executable, help="the interpreter with sglang installed")
    p.add_argument("--ext-dir", help="TORCH_EXTENSIONS_DIR for the servers (default: private, in the work dir)")
    p.add_argument("--dir", help="work directory (default: a temp dir, removed unless --keep)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--json", help="write the results here (after every round)")
    p.add_argument("--plot", help="a PNG of TTFT per phase and arm (needs matplotlib)")
    cfg = p.parse_args(argv)
    cfg.rounds = cfg.rounds or (1 if cfg.quick else 3)
    cfg.fill = cfg.fill or (14 if cfg.quick else 20)
    cfg.resend = cfg.resend or (4 if cfg.quick else 10)
    cfg.fresh = cfg.fresh or (4 if cfg.quick else 10)
    cfg.arms = [a.strip() for a in cfg.arms.split(",") if a.strip()]
    for a in cfg.arms:
        if a not in ARMS:
            p.error(f"--arms: unknown arm {a!r}; expected some of {', '.join(ARMS)}")
    policy = cfg.omp_wait_policy.strip()
    if policy.upper() not in ("DEFAULT", "PASSIVE", "ACTIVE"):
        p.error(f"--omp-wait-policy: expected default, PASSIVE or ACTIVE, got {policy!r}")
    cfg.omp_policy_env = None if policy.upper() == "DEFAULT" else policy.upper()
    cfg.dynamo_note = None
    if cfg.kv_events and cfg.dynamo_python:
        from .fleet_dynamo import available

        cfg.dynamo_note = available(cfg.dynamo_python)
        cfg.dynamo_python = "" if cfg.dynamo_note else cfg.dynamo_python
    elif cfg.kv_events:
        cfg.dynamo_note = "no --dynamo-python (tools/install_dynamo.sh)"
    if cfg.crash_after >= cfg.fill:
        p.error(f"--crash-after ({cfg.crash_after}) must be below --fill ({cfg.fill})")
    return cfg


def print_events(title: str, ev: dict | None) -> None:
    if not ev:
        return
    print(f"{title}: KV events per tier (truth: GPU/CPU_PINNED = the scheduler's own stream, DISK = the store's index)"
          + ("" if ev["dynamo"] else "; Dynamo's indexer not run"))
    if ev["rows"]:
        events_mod.print_rows(ev["rows"], ev["queries"])
    for f in ev["failures"]:
        print(f"  FAILED: {f}")


def print_arm(rnd: int, res: dict) -> None:
    print_events(f"round {rnd} umbp", res.get("events"))
    if "error" in res:
        print(f"round {rnd} {res['arm']:5s} FAILED: {res['error'].splitlines()[0]}")
        return
    s, c, m, w = res["summary"], res["checks"], res["metrics"], res.get("omp_worker") or {}
    cpu = res.get("server_cpu") or {}
    cell = " ".join(f"{ph}={s[ph]['ttft_ms']:.0f}/{s[ph]['e2e_ms']:.0f}ms" for ph in PHASES if ph in s)
    print(f"round {rnd} {res['arm']:5s} TTFT/e2e {cell}; fresh prefill {s.get('fresh', {}).get('prefill_tok_s') or 0:.0f} tok/s; "
          f"re-sent L3 {c['resent_l3']}/{c['resent']} identical {c['resent_identical']}; "
          f"storage tokens {s.get('resent', {}).get('storage_tokens', 0)} (/metrics {m['storage_prefetch_hit_tokens']:.0f}); "
          f"store gets {m['umbp_gets']:.0f} hits {m['umbp_hits']:.0f} puts {m['umbp_puts']:.0f}; "
          f"OMP worker vcsw {w.get('vcsw', '-')}; server CPU {cpu.get('cpu_s', '-')} s, {cpu.get('rest_s', '-')} s "
          f"beside the forward pass; errors {c['errors']}")


def write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def plot(doc: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: --plot needs matplotlib (pip install matplotlib); no plot written")
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    phases = ["fresh", "resent", "changed"]
    for i, arm in enumerate(ARMS):
        vals = []
        for ph in phases:
            xs = [r["arms"][arm]["summary"][ph]["ttft_ms"] for r in doc["rounds"]
                  if ph in r["arms"].get(arm, {}).get("summary", {})]
            vals.append(statistics.median(xs) if xs else 0)
        ax.bar([j + i * 0.2 for j in range(len(phases))], vals, width=0.2, label=arm)
    ax.set_xticks([j + 0.3 for j in range(len(phases))], phases)
    ax.set_ylabel("TTFT ms (median of rounds)")
    ax.set_title(f"bench server: {doc['config']['prompt_tokens']}-token prompts, busy cores {doc['config']['busy_cores']}, "
                 f"OMP_WAIT_POLICY {doc['config']['omp_wait_policy']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop the servers and busy loops


def main(argv=None) -> int:
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `timeout` or a job runner: leave no server behind
    work = cfg.dir or tempfile.mkdtemp(prefix="umbp-bench-server-")
    os.makedirs(work, exist_ok=True)
    cfg.ext_dir = cfg.ext_dir or os.path.join(work, "torch_extensions")
    cfg.model_dir = launch.write_model_dir(os.path.join(work, "model"))
    doc = {"bench": BENCH, "config": {k: getattr(cfg, k) for k in (
        "rounds", "arms", "busy_cores", "omp_wait_policy", "fill", "resend", "fresh", "prompt_tokens",
        "max_new_tokens", "seed", "kv_events")} | {"loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "rounds": []}
    busy = client.start_busy(cfg.busy_cores)
    try:
        print(f"bench server: warming SGLang's page hash in {cfg.ext_dir}: "
              f"{launch.warm_page_hash(launch.server_env(ext_dir=cfg.ext_dir), cfg.python):.1f} s")
        if cfg.dynamo_note:
            print(f"note: --kv-events: Dynamo's indexer not run: {cfg.dynamo_note}")
        workload = make_workload(seed=cfg.seed, prompt_tokens=cfg.prompt_tokens, fill=cfg.fill,
                                 resend=cfg.resend, fresh=cfg.fresh)
        for rnd in range(cfg.rounds if cfg.arms else 0):  # --arms '' with --crash: the crash run alone
            order = cfg.arms[rnd % len(cfg.arms):] + cfg.arms[: rnd % len(cfg.arms)]
            entry = {"round": rnd, "order": order, "arms": {}}
            for arm in order:
                res = run_arm(cfg, arm, workload, work, f"r{rnd}")
                entry["arms"][arm] = res
                print_arm(rnd, res)
                sys.stdout.flush()
            doc["rounds"].append(entry)
            doc["verdicts"] = verdicts(doc["rounds"])
            if cfg.json:
                write_json(cfg.json, doc)
        if cfg.crash:
            doc["crash"] = run_crash(cfg, workload, work)
            cr = doc["crash"]
            print_events("crash", cr.get("events"))
            print(f"crash: {'OK' if cr['ok'] else 'FAILED'}: "
                  f"{json.dumps({k: v for k, v in cr.items() if k not in ('verify_tail', 'events')})}")
        doc["verdicts"] = verdicts(doc["rounds"])
        for v in doc["verdicts"]:
            val = v["value"] if not isinstance(v["value"], float) else f"{v['value']:.2f}"
            state = "" if v["met"] is None else (" met" if v["met"] else " NOT MET")
            print(target_line(f"{v['target']} = {val} (goal {v['goal']}, {v['rounds']} rounds){state}", "issue 39"))
        if cfg.json:
            write_json(cfg.json, doc)
            print(f"wrote {cfg.json}")
        if cfg.plot and plot(doc, cfg.plot):
            print(f"wrote {cfg.plot}")
    finally:
        client.stop_busy(busy)
        if not cfg.dir and not cfg.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = any("error" in a or a.get("events", {}).get("failures") for r in doc["rounds"] for a in r["arms"].values())
    return 1 if failed or not doc.get("crash", {"ok": True})["ok"] else 0
