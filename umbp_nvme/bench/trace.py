"""Trace benchmark: the prefix hit rate UMBPNvmeStore gives a serving trace, against LRU and a
clairvoyant policy on the same trace.

    umbp-nvme bench trace -- --trace FILE.jsonl [--capacity 1000,6000,20000] [--json PATH] [--plot PNG]
    python -m umbp_nvme.bench trace --synthetic 2000 --capacity 500,2000   (a generated multi-turn trace)

The trace is in Mooncake's FAST'25 format (bench/trace_file.py). Each capacity (in blocks; a
list runs a sweep) and each ``--extra-config`` (repeatable: one line per policy or knob) gets a
fresh store, and the trace is replayed through the real backend with SGLang's controller calls
(bench/trace_replay.py: hit query, prefetch into host slots with every byte checked, backup).
In the same run the in-memory simulator (bench/trace_sim.py) gives the infinite-capacity rate
and LRU's and the clairvoyant policy's rates at the store's *effective* capacity (the blocks it
really held on average once full), with the same host tier.

Columns: hit (block-weighted prefix hit rate), tok (token-weighted), vs_lru (hit / LRU's at the
effective capacity), w/hit (device bytes written per byte served as a hit: ours from the
store's counter, LRU's from the simulator), wrong (bytes that differed from the oracle: must be
0), req/s (replay throughput). One block is one page of 2 objects of ``--object-bytes``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from . import trace_file, trace_sim
from .common import parse_bytes, write_json

BENCH = "trace"
SEGMENT_PAGES = 128  # segment size in pages (at most): capacities land within a segment of what was asked


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench trace", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="a FAST'25-format trace (JSON lines)")
    src.add_argument("--synthetic", type=int, metavar="N", help="generate a multi-turn trace of N requests instead")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--capacity", default="6000", help="store capacity in blocks; a comma list runs a sweep (default 6000)")
    p.add_argument("--object-bytes", default="4k", help="bytes of each K and V object (a page is two; default 4k)")
    p.add_argument("--l2-blocks", type=int, default=0, help="an LRU host tier of N blocks in front of the store")
    p.add_argument("--prefix-keys", action="store_true",
                   help="pass prefix keys with every call, as SGLang does with hicache_storage_pass_prefix_keys")
    p.add_argument("--extra-config", action="append", default=None, metavar="JSON",
                   help="store settings for one system, e.g. '{\"eviction_policy\": \"lru\"}' (repeat to compare)")
    p.add_argument("--pool", default="auto", choices=("auto", "sglang", "standin"),
                   help="host pool: SGLang's (auto when sglang imports) or a stand-in of the same layout")
    p.add_argument("--dir", default=None, help="directory for the stores (default: a temporary one, removed)")
    p.add_argument("--quick", action="store_true", help="the first 1000 requests only")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--plot", help="write hit rate against capacity as a PNG (needs matplotlib)")
    cfg = p.parse_args(argv)
    if not cfg.trace and not cfg.synthetic:
        p.error("give --trace FILE.jsonl or --synthetic N")
    try:
        cfg.capacities = [int(c) for c in cfg.capacity.split(",") if c.strip()]
    except ValueError:
        p.error(f"--capacity {cfg.capacity!r}: expected block counts like 1000,6000,20000")
    if not cfg.capacities or min(cfg.capacities) < 1:
        p.error("--capacity: at least one positive block count")
    try:
        cfg.object_bytes = parse_bytes(cfg.object_bytes)
    except ValueError as e:
        p.error(f"--object-bytes: {e}")
    cfg.systems = []
    for text in cfg.extra_config or ["{}"]:
        try:
            extra = json.loads(text)
        except json.JSONDecodeError as e:
            p.error(f"--extra-config {text!r}: not JSON ({e.msg})")
        if not isinstance(extra, dict):
            p.error(f"--extra-config {text!r}: expected a JSON object")
        cfg.systems.append((label_of(extra), extra))
    if cfg.quick and cfg.limit is None:
        cfg.limit = 1000
    return cfg


def label_of(extra: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(extra.items())) or "default"


def store_extra(capacity_blocks: int, object_bytes: int, extra: dict) -> tuple[dict, int]:
    """The store settings for ``capacity_blocks`` pages of 2 objects, and the blocks that capacity holds."""
    from ..store.layout import record_slots
    from ..store.segments import size_classes
    import numpy as np

    slot = int(size_classes(np.asarray([object_bytes]))[0])
    seg_bytes = max(8, min(SEGMENT_PAGES, capacity_blocks // 8)) * 2 * slot  # >= 8 segments where it can
    per_seg = record_slots(seg_bytes, slot)
    segments = -(-2 * capacity_blocks // per_seg)
    base = {"ssd_capacity_bytes": segments * seg_bytes, "ssd_segment_size_bytes": seg_bytes,
            "ssd_durability_mode": "relaxed", "ssd_io_backend": "io_uring"}  # fmt: skip
    base.update(extra)
    return base, segments * per_seg // 2


def pool_kind(cfg) -> str:
    if cfg.pool != "auto":
        return cfg.pool
    from . import sglang_pools

    return "sglang" if sglang_pools.sglang_installed() and not os.environ.get("UMBP_BENCH_NO_SGLANG") else "standin"


def replay_one(cfg, trace, directory: str, capacity: int, extra: dict, kind: str, corrupt=None):
    from .trace_pool import open_backend
    from .trace_replay import Replayer

    settings, configured = store_extra(capacity, cfg.object_bytes, extra)
    shutil.rmtree(directory, ignore_errors=True)
    side = open_backend(kind, directory, Replayer.POOL_PAGES, cfg.object_bytes, settings)
    try:
        res = Replayer(side, cfg.object_bytes, l2_blocks=cfg.l2_blocks, corrupt=corrupt,
                       prefix_keys=cfg.prefix_keys).run(trace)
    finally:
        side.close()
        shutil.rmtree(directory, ignore_errors=True)
    return res, configured


def bench(cfg, trace, directory: str, notes: list[str], corrupt=None) -> list[dict]:
    kind = pool_kind(cfg)
    nxt = trace_sim.next_use(trace)
    inf = trace_sim.infinite(trace)
    rows = []
    for label, extra in cfg.systems:
        for cap in cfg.capacities:
            res, configured = replay_one(cfg, trace, os.path.join(directory, "store"), cap, extra, kind, corrupt)
            held = res.held_sum / res.held_samples / 2 if res.held_samples else configured
            eff = max(1, round(held))
            ref = trace_sim.reference(trace, eff, l2_blocks=cfg.l2_blocks, nxt=nxt)
            page_bytes = 2 * cfg.object_bytes
            written = res.store.get("bytes_written", 0)
            lru = ref["lru"]
            rows.append({
                "bench": BENCH, "system": label, "pool": kind, "capacity_blocks": cap, "configured_blocks": configured,
                "effective_blocks": round(held, 1), "fill": round(held / configured, 3), "requests": res.requests,
                "hit_rate": round(res.hit_rate, 4), "token_hit_rate": round(res.token_hit_rate, 4),
                "l2_hit_rate": round(res.l2_hit_blocks / max(1, res.total_blocks), 4),
                "lru_hit_rate": round(lru.hit_rate, 4), "clairvoyant_hit_rate": round(ref["clairvoyant"].hit_rate, 4),
                "infinite_hit_rate": round(inf.hit_rate, 4),
                "vs_lru": round(res.hit_rate / lru.hit_rate, 3) if lru.hit_rate else None,
                "written_per_hit": round(written / (res.hit_blocks * page_bytes), 3) if res.hit_blocks else None,
                "lru_written_per_hit": round(lru.written_per_hit, 3) if lru.hit_blocks else None,
                "wrong_bytes": res.wrong_bytes, "wrong_pages": res.wrong_pages, "get_missed": res.get_missed,
                "set_failed": res.set_failed, "declined": int(res.store.get("put_declined", 0)),
                "evictions": int(res.store.get("evictions", 0)), "requests_per_s": round(res.requests / res.seconds, 1),
                "object_bytes": cfg.object_bytes, "l2_blocks": cfg.l2_blocks, "prefix_keys": cfg.prefix_keys,
            })  # fmt: skip
            if res.set_failed:
                notes.append(f"{label} at {cap} blocks: batch_set_v1 answered False for {res.set_failed} pages")
    return rows


def print_table(rows: list[dict], file=None) -> None:
    head = ["system", "blocks", "held", "hit", "tok", "LRU", "clairv", "vs_lru", "w/hit", "LRU w/hit", "wrong", "req/s"]
    lines = [head]
    for r in rows:
        lines.append([r["system"], str(r["capacity_blocks"]), f"{r['effective_blocks']:.0f}", f"{r['hit_rate']:.3f}",
                      f"{r['token_hit_rate']:.3f}", f"{r['lru_hit_rate']:.3f}", f"{r['clairvoyant_hit_rate']:.3f}",
                      "-" if r["vs_lru"] is None else f"{r['vs_lru']:.2f}",
                      "-" if r["written_per_hit"] is None else f"{r['written_per_hit']:.2f}",
                      "-" if r["lru_written_per_hit"] is None else f"{r['lru_written_per_hit']:.2f}",
                      str(r["wrong_bytes"]), f"{r['requests_per_s']:.0f}"])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip(), file=file)


def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written to {path} (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    systems = sorted({r["system"] for r in rows})
    for s in systems:
        rs = sorted((r for r in rows if r["system"] == s), key=lambda r: r["effective_blocks"])
        ax.plot([r["effective_blocks"] for r in rs], [r["hit_rate"] for r in rs], marker="o", label=f"umbp_nvme ({s})")
    ref = sorted(rows, key=lambda r: r["effective_blocks"])
    for key, label, style in (("lru_hit_rate", "LRU (simulated)", "--"), ("clairvoyant_hit_rate", "clairvoyant", ":")):
        ax.plot([r["effective_blocks"] for r in ref], [r[key] for r in ref], style, marker=".", label=label)
    ax.axhline(rows[0]["infinite_hit_rate"], color="grey", lw=0.8, label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xlabel("blocks held (effective capacity)")
    ax.set_ylabel("prefix hit rate (block-weighted)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def load_trace(cfg, directory: str):
    if cfg.trace:
        return trace_file.load(cfg.trace, limit=cfg.limit)
    path = os.path.join(directory, f"synthetic-{cfg.synthetic}-{cfg.seed}.jsonl")
    trace_file.write(trace_file.synthetic(cfg.synthetic, seed=cfg.seed), path)
    return trace_file.load(path, limit=cfg.limit)


def main(argv=None, *, corrupt=None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    tmp = None
    directory = cfg.dir
    if directory is None:
        directory = tmp = tempfile.mkdtemp(prefix="umbp-bench-trace-")
    os.makedirs(directory, exist_ok=True)
    notes: list[str] = []
    try:
        try:
            trace = load_trace(cfg, directory)
        except (OSError, ValueError) as e:
            print(f"bench trace: {e}", file=sys.stderr)
            return 2
        name = os.path.basename(cfg.trace) if cfg.trace else f"synthetic({cfg.synthetic}, seed {cfg.seed})"
        print(f"trace {name}: {len(trace.reqs)} requests, {trace.total_blocks} blocks, {trace.n_blocks} distinct; "
              f"{cfg.object_bytes} B objects, host tier {cfg.l2_blocks} blocks")  # fmt: skip
        rows = bench(cfg, trace, directory, notes, corrupt=corrupt)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)
    print(f"infinite capacity: {rows[0]['infinite_hit_rate']:.3f}; pool: {rows[0]['pool']}")
    for note in notes:
        print("note:", note)
    wrong = sum(r["wrong_bytes"] for r in rows)
    if wrong:
        print(f"WRONG BYTES: {wrong} bytes read back differed from what was written")
    if cfg.json:
        write_json(rows, cfg.json)
        print(f"wrote {cfg.json}")
    if cfg.plot and plot(rows, cfg.plot, f"{name}, {cfg.object_bytes} B objects"):
        print(f"wrote {cfg.plot}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
