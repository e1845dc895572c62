"""`umbp-nvme`: fill, move, check and inspect a store without writing Python (docs/cli.md).

Exit codes: 0 success; 1 the command ran but found or left problems (failed imports, bad
objects, missing keys); 2 it could not run (bad arguments, not a store, store locked by a
writer, namespace mismatch); 130 interrupted (a warm-up continues when run again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys

from ..keybytes import printable_key

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130

class CliError(Exception):
    """A message for the operator; exit code 2."""


def parse_size(text: str) -> int:
    """'4096', '64k', '512MiB', '1.5g' -> bytes (binary units: sizes.py)."""
    from ..sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:  # not a number: refused below like 0
        v = -1
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return v


def _read_keys(path: str) -> list[str]:
    """One key per line, as bytes decoded with keybytes (a key that is not UTF-8 is still a key)."""
    from ..keybytes import decode_key

    try:
        f = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise CliError(f"cannot read the keys file {path}: {e.strerror or e}") from None
    with f:
        keys = []
        for ln in iter(lambda: f.readline(1 << 16), b""):  # bounded: a device (/dev/zero) is no keys file
            if len(ln) >= 1 << 16:
                raise CliError(f"the keys file {path} has a line of 64 KiB or more; it must list one key per line")
            if ln.strip() and not ln.lstrip().startswith(b"#"):
                keys.append(decode_key(ln.strip()))
    if not keys:
        raise CliError(f"the keys file {path} lists no keys (one key per line)")
    return keys


def _load_config(args):
    """StoreConfig from UMBP_* env and --config (a writer without --capacity adopts the store's own)."""
    from ..config import load_config
    from .maintenance import read_manifest

    extra: dict = {}
    if getattr(args, "config", None):
        raw = args.config
        try:
            if os.path.isfile(raw):
                with open(raw, encoding="utf-8") as f:
                    raw = f.read()
            extra = json.loads(raw)
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise CliError(f"--config {args.config!r:.200} is neither a JSON object nor a JSON file ({e})") from None
        if not isinstance(extra, dict):
            raise CliError(f"--config must be a JSON object of extra_config keys, got {type(extra).__name__}")
    if getattr(args, "capacity", None):
        extra["ssd_capacity_bytes"] = args.capacity
    extra["ssd_storage_dir"] = args.store
    if "ssd_segment_size_bytes" not in extra:
        try:  # an existing store keeps its own segment size; validate the capacity against it
            extra["ssd_segment_size_bytes"] = int(read_manifest(args.store)["layout"]["segment_bytes"])
        except (OSError, KeyError, ValueError, TypeError):
            pass
    try:
        cfg = load_config(extra)
    except ValueError as e:
        raise CliError(str(e)) from None
    return cfg


def _writer_config(args):
    """_load_config for a command that opens the store as its writer (the open itself warns about a
    capacity the file system cannot hold: store/fs_room.py)."""
    return _load_config(args)


def _capacity_given(args) -> bool:
    return bool(getattr(args, "capacity", None) or "UMBP_SSD_CAPACITY" in os.environ
                or (getattr(args, "config", None) and "ssd_capacity_bytes" in (args.config or "")))


def _emit(args, data: dict, text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str) if getattr(args, "json", False) else text)


def _refuse_if_locked(store: str, what: str) -> None:
    from .maintenance import lock_holder

    pid = lock_holder(store)
    if pid is not None:
        raise CliError(
            f"{what} needs the store {store} to itself, but a writer (pid {pid}) holds it "
            f"({os.path.join(store, 'LOCK')}); stop that process (or the SGLang server using this directory) "
            "and run this again. Read-only commands (stats, verify without --repair, inspect, export) work meanwhile."
        )


def _bar(total: int, desc: str, enabled: bool | None = None):
    from .warmup import Progress

    return Progress(total, desc=desc, enabled=enabled)


# --- subcommands -----------------------------------------------------------------------------


def cmd_warmup(args) -> int:
    from .hicache_files import FileBackendLayout
    from .replay import replay
    from .warmup import BATCH_BYTES, import_sources

    if args.replay:
        if not args.server:
            raise CliError("--replay needs --server URL (the SGLang server whose cache to warm, e.g. http://127.0.0.1:30000)")
        if args.sources or args.store:
            raise CliError("--replay sends prompts to a server; it takes no --store or SOURCE arguments")
        try:  # --concurrency and --timeout are checked there (a library caller gets the same ValueError)
            s = replay(args.replay, args.server, concurrency=args.concurrency, timeout_s=args.timeout, progress=args.progress)
        except ValueError as e:
            raise CliError(str(e)) from None
        _emit(args, s.as_dict(), s.table())
        return EXIT_INTERRUPTED if s.interrupted else EXIT_OK if s.failed == 0 else EXIT_PROBLEMS
    if not args.store:
        raise CliError("warmup needs --store DIR (the store to fill) and at least one SOURCE")
    if not args.sources:
        raise CliError("warmup needs at least one SOURCE: a HiCacheFile directory, a store directory or an archive")
    layout = FileBackendLayout(
        model=args.model, tp_rank=args.tp_rank, tp_size=args.tp_size, pp_rank=args.pp_rank, pp_size=args.pp_size,
        is_mla=args.mla, split_factor=args.split_heads, attn_cp_rank=args.attn_cp_rank, attn_cp_size=args.attn_cp_size,
        dcp_rank=args.dcp_rank, dcp_size=args.dcp_size, logical_page_size=args.logical_page_size,
    )
    namespace = None
    if args.namespace:
        try:
            raw = args.namespace
            if os.path.isfile(raw):
                with open(raw, encoding="utf-8") as f:
                    raw = f.read()
            namespace = json.loads(raw)
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise CliError(f"--namespace {args.namespace!r:.200} is neither a JSON object nor a JSON file ({e})") from None
    if args.keys == "-" and "-" in args.sources:
        raise CliError("--keys - and the SOURCE - would both read stdin; give the keys as a file")
    if args.sources.count("-") > 1:
        raise CliError("stdin (-) can be given as a SOURCE once")
    cfg = _writer_config(args)
    keys = _read_keys(args.keys) if args.keys else None
    try:
        s = asyncio.run(
            import_sources(args.store, args.sources, cfg, layout=layout, page_bytes=args.page_bytes, namespace=namespace,
                           keys=keys, max_gbps=args.max_gbps, progress=args.progress,
                           batch_bytes=args.batch_size or BATCH_BYTES,
                           capacity_from_manifest=not _capacity_given(args))
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    _emit(args, s.as_dict(), s.table())
    return EXIT_INTERRUPTED if s.interrupted else EXIT_OK if s.ok else EXIT_PROBLEMS


def cmd_export(args) -> int:
    from .archive import export_store
    from .maintenance import StoreReader

    keys = _read_keys(args.keys) if args.keys else None
    with StoreReader(args.store) as r:
        total = int(r.scan()[1]["length"].sum()) if keys is None else None
    bar = _bar(total, "export", None if args.out != "-" else False)
    try:
        s = export_store(args.store, args.out, keys=keys, progress=bar.update)
    finally:
        bar.close()
    text = (f"exported {s['exported']} objects ({s['bytes'] / 1e9:.3f} GB) to {s['out']} in {s['seconds']:.2f} s"
            + (f"; {s['missing']} requested keys not in the store" if s["missing"] else "")
            + (f"; {s['failed']} objects failed their checksum and were left out" if s["failed"] else "")
            + "".join(f"\n  ! {e}" for e in s["errors"][:10]))
    if args.out == "-":
        print(text, file=sys.stderr)
    else:
        _emit(args, s, text)
    return EXIT_OK if not (s["failed"] or s["missing"]) else EXIT_PROBLEMS


def cmd_stats(args) -> int:
    from .drives import live_counters
    from .maintenance import store_stats

    cfg = _load_config(args)
    s = store_stats(args.store, cfg.ssd_capacity_bytes if _capacity_given(args) else None,
                    cfg.ssd_high_watermark, cfg.ssd_low_watermark)
    s["capacity_source"] = "configured" if _capacity_given(args) else "segment files on disk (pass --capacity for the server's)"
    s["counters"] = live_counters(args.store)
    if getattr(args, "prometheus", False):
        from ..metrics import available, store_on_disk_exposition

        if not available():
            raise CliError("--prometheus needs prometheus_client: pip install 'umbp_nvme[metrics]'")
        sys.stdout.write(store_on_disk_exposition(s, s["counters"]).decode())
        return EXIT_OK
    lines = [
        f"store        {s['store']}  (writer: {'pid ' + s['writer_pid'] if s['writer_pid'] else 'none'})",
        f"namespace    {json.dumps(s['namespace'], sort_keys=True)}",
        f"capacity     {s['capacity_bytes'] / 2**30:.2f} GiB ({s['capacity_source']}); segments of {s['segment_bytes'] / 2**20:.0f} MiB",
        f"used         {s['bytes_used'] / 2**30:.3f} GiB in slots ({(s['fill'] or 0) * 100:.1f} %), "
        f"{s['object_bytes'] / 2**30:.3f} GiB of objects; {s['disk_bytes'] / 2**30:.3f} GiB on disk",
        f"watermarks   high {s['high_watermark']} ({s['high_watermark_bytes'] / 2**30:.2f} GiB), "
        f"low {s['low_watermark']} ({s['low_watermark_bytes'] / 2**30:.2f} GiB)",
        f"objects      {s['objects']}",
    ]
    for pool, v in s["pools"].items():
        lines.append(f"  {pool:<20} {v['objects']:>10} objects {v['bytes'] / 2**20:>12.1f} MiB")
    if len(s["prefixes"]) > 1 or "(none)" not in s["prefixes"]:
        lines.append("key prefixes " + ", ".join(f"{printable_key(k)}: {v}" for k, v in s["prefixes"].items()))
    c = s["counters"]
    if c:
        lines.append("counters     " + ", ".join(f"{k} {c[k]}" for k in ("hits", "misses", "evictions", "puts", "gets") if k in c))
    else:
        lines.append("counters     none published (a running store keeps hit/miss/evict counters in its own process)")
    _emit(args, s, "\n".join(lines))
    return EXIT_OK


def cmd_doctor(args) -> int:
    from .doctor import format_text, report

    r = report(args.store, _load_config(args), probe=not args.no_probe)
    _emit(args, r, format_text(r))
    return EXIT_PROBLEMS if r["status"] == "fail" else EXIT_OK


def cmd_rebuild_index(args) -> int:
    from ..errors import StoreLockedError
    from .maintenance import rebuild_index_dir

    try:
        s = rebuild_index_dir(args.store)
    except StoreLockedError as e:
        raise CliError(f"verify --rebuild-index needs the store to itself: {e}") from None
    bad = s["bad_records"] + s["data_bad"]
    text = (f"rebuilt the index of {args.store} from {s['segments']} segments in {s['seconds']:.2f} s: "
            f"{s['records']} objects" + (f"; {bad} records failed their checks and were left out" if bad else "")
            + (f"; {s['long_keys']} objects with keys over 208 bytes cannot be rebuilt" if s["long_keys"] else ""))
    _emit(args, s, text)
    return EXIT_OK if not bad and not s["long_keys"] else EXIT_PROBLEMS


def cmd_verify(args) -> int:
    from .maintenance import StoreReader, verify_records

    if getattr(args, "rebuild_index", False):
        return cmd_rebuild_index(args)
    if args.repair:
        _refuse_if_locked(args.store, "verify --repair")
    with StoreReader(args.store) as r:
        total = int(r.scan()[1]["length"].sum())
    bar = _bar(total, "verify")
    try:
        s = verify_records(args.store, progress=bar.update)
    finally:
        bar.close()
    s["repaired"] = 0
    if s["bad"] and args.repair:
        s["repaired"] = _drop_keys(args, [b["key"] for b in s["bad"]])
    lines = [f"checked {s['checked']} objects ({s['bytes'] / 1e9:.3f} GB) in {args.store}: "
             + ("clean" if not s["bad"] else f"{len(s['bad'])} bad")]
    for b in s["bad"][:50]:
        lines.append(f"  {b['status']:<16} {printable_key(b['key'])}  (segment {b['segment']}, offset {b['offset']}, {b['length']} bytes)")
    if len(s["bad"]) > 50:
        lines.append(f"  ... and {len(s['bad']) - 50} more (use --json for all)")
    if s["bad"]:
        lines.append(f"dropped {s['repaired']} bad entries" if args.repair else "run again with --repair to drop them")
    _emit(args, s, "\n".join(lines))
    return EXIT_OK if not s["bad"] else EXIT_PROBLEMS


def _drop_keys(args, keys: list[str]) -> int:
    from ..store import PageStore

    cfg = _writer_config(args)

    async def run() -> int:
        store = await PageStore.open(args.store, cfg, capacity_from_manifest=not _capacity_given(args))
        try:
            return sum(await store.delete_many(keys))
        finally:
            await store.close()

    return asyncio.run(run())


def cmd_compact(args) -> int:
    from .maintenance import compact_dir
    from ..store import PageStore

    _refuse_if_locked(args.store, "compact")
    cfg = _writer_config(args)

    async def run() -> dict:
        # holds the writer lock while we work
        store = await PageStore.open(args.store, cfg, capacity_from_manifest=not _capacity_given(args))
        try:
            return compact_dir(store.path, interior=not args.tail_only)
        finally:
            await store.close()

    s = asyncio.run(run())
    text = (f"compacted {s['store']}: removed {len(s['segments_removed'])} empty segment files, punched "
            f"{s['ranges_punched']} free ranges; disk {s['disk_bytes_before'] / 2**20:.1f} MiB -> "
            f"{s['disk_bytes_after'] / 2**20:.1f} MiB (reclaimed {s['reclaimed_bytes'] / 2**20:.1f} MiB)"
            + "".join(f"\n  ! {e}" for e in s["errors"]))
    _emit(args, s, text)
    return EXIT_OK if not s["errors"] else EXIT_PROBLEMS


def cmd_inspect(args) -> int:
    from ..keybytes import key_error
    from .maintenance import inspect_keys

    for k in args.keys:  # argv bytes that are not UTF-8 arrive surrogate-escaped: legal keys
        why = key_error(k)
        if why is not None:
            raise CliError(f"key {printable_key(k)} cannot be a store key: {why}")
    rows = inspect_keys(args.store, args.keys)
    lines = []
    for r in rows:
        shown = printable_key(r["key"])
        if not r["found"]:
            lines.append(f"{shown}: not in the store")
        else:
            lines.append(f"{shown}: {r['status']}  pool {r['pool']}, {r['file']} offset {r['offset']}, "
                         f"{r['length']} bytes, crc32c {r['crc32c']}, generation {r['generation']}, depth {r['depth']}")
    _emit(args, {"store": os.path.abspath(args.store), "keys": rows}, "\n".join(lines))
    return EXIT_OK if all(r["found"] and r["status"] == "ok" for r in rows) else EXIT_PROBLEMS


def cmd_bench(args) -> int:
    from .. import bench

    rest = [a for a in args.rest if a != "--"]  # `--` was once needed before a benchmark's own options
    which = "engine" if not rest or rest[0].startswith("-") else rest.pop(0)
    if which not in bench.BENCHES:
        raise CliError(f"unknown benchmark {which!r}; expected one of: {', '.join(bench.BENCHES)} "
                       "(`umbp-nvme bench NAME --help` lists its options)")
    return bench.main([which] + rest)


def cmd_demo(args) -> int:
    from .demo import main as demo_main

    return demo_main(keep=args.keep)


# --- parser ----------------------------------------------------------------------------------

_EXAMPLES = {
    "warmup": """examples:
  # import this rank's pages from SGLang's file backend (one run per rank and store directory)
  umbp-nvme warmup --store /mnt/nvme/umbp --model meta-llama/Llama-3.1-8B-Instruct /tmp/hicache
  umbp-nvme warmup --store /mnt/nvme/umbp/tp1 --model m --tp-rank 1 --tp-size 2 /tmp/hicache
  # move a warm cache: from another store or an archive, throttled beside a live server
  umbp-nvme warmup --store /mnt/nvme/umbp --max-gbps 0.5 /mnt/old/umbp cache.umbparc
  # warm a running server by replaying prompts (max_new_tokens 1, 16 in flight)
  umbp-nvme warmup --replay prompts.jsonl --server http://127.0.0.1:30000 --concurrency 16
Interrupt with Ctrl-C and run the same command again: present keys are skipped.""",
    "export": """examples:
  umbp-nvme export --store /mnt/nvme/umbp --out cache.umbparc
  umbp-nvme export --store /mnt/nvme/umbp --out hot.umbparc --keys hot-keys.txt
  umbp-nvme export --store /mnt/nvme/umbp --out - | ssh node2 umbp-nvme warmup --store /mnt/nvme/umbp -""",
    "stats": """examples:
  umbp-nvme stats --store /mnt/nvme/umbp
  umbp-nvme stats --store /mnt/nvme/umbp --capacity 500g --json""",
    "doctor": """examples:
  umbp-nvme doctor --store /mnt/nvme/umbp
  umbp-nvme doctor --store /mnt/nvme/umbp --json --no-probe""",
    "verify": """examples:
  umbp-nvme verify --store /mnt/nvme/umbp            # exit 0 clean, 1 bad objects found
  umbp-nvme verify --store /mnt/nvme/umbp --repair   # drop them (needs the store to itself)""",
    "compact": """examples:
  umbp-nvme compact --store /mnt/nvme/umbp           # stop the server first
  umbp-nvme compact --store /mnt/nvme/umbp --tail-only""",
    "inspect": """examples:
  umbp-nvme inspect --store /mnt/nvme/umbp 3f2a..e1_0_k 3f2a..e1_0_v
  umbp-nvme inspect --store /mnt/nvme/umbp --json 3f2a..e1__k""",
    "bench": """examples:
  umbp-nvme bench engine --quick
  umbp-nvme bench store --quick --dir /mnt/nvme0/bench          # removes what it wrote unless --keep
  umbp-nvme bench store --roots /mnt/nvme0/b,/mnt/nvme1/b --stall 3
  umbp-nvme bench hicache --quick --plot hicache.png
  umbp-nvme bench scheduler --quick --baseline-src /path/to/other/checkout   # get_stats() on SGLang's scheduler thread
Every option after the benchmark's name goes to it: `umbp-nvme bench store --help` lists them.
Lines starting `bench target` compare with the goal the benchmark was written for; they are
not failures.""",
    "demo": """examples:
  umbp-nvme demo
  umbp-nvme demo --keep /tmp/umbp-demo   # keep the store to look at it with stats / inspect""",
}


def _docs(name: str) -> str:
    from .paths import docs_dir

    return os.path.join(docs_dir(), name)


def _sub(subs, name: str, help_: str, description: str):
    return subs.add_parser(name, help=help_, description=description, epilog=_EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)


def _store_arg(p, required: bool = True) -> None:
    p.add_argument("--store", required=required, metavar="DIR",
                   help="the store directory (ssd_storage_dir of one rank); several drives: D0,D1,... or a JSON list")


def _config_args(p) -> None:
    p.add_argument("--config", metavar="JSON|FILE", help="extra_config keys as in SGLang's --hicache-storage-backend-extra-config")
    p.add_argument("--capacity", type=parse_size, metavar="SIZE", help="ssd_capacity_bytes, e.g. 500g (default: UMBP_SSD_CAPACITY or 32g)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="umbp-nvme",
        description="Manage umbp_nvme KV-cache stores: warm up, export, check, inspect, benchmark.",
        epilog=f"Run `umbp-nvme demo` first; `umbp-nvme SUBCOMMAND --help` shows examples.\nDocs: {_docs('cli.md')}",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the docs path on one line
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    subs = p.add_subparsers(dest="command", metavar="SUBCOMMAND")

    w = _sub(subs, "warmup", "import pages into a store, or warm a live server from prompts",
             "Import pages into a store from SGLang file-backend directories, other stores or archives "
             "(deduplicated, CRC-checked, resumable), or with --replay send prompts to a running server.")
    _store_arg(w, required=False)
    w.add_argument("sources", nargs="*", metavar="SOURCE", help="HiCacheFile directory, store directory, or archive file ('-' = stdin)")
    w.add_argument("--max-gbps", type=_positive_float, metavar="GB/s", help="throttle the import (decimal GB per second)")
    w.add_argument("--keys", metavar="FILE", help="import only these keys (one per line)")
    w.add_argument("--batch-size", type=parse_size, default=None, metavar="SIZE",
                   help="bytes per put_many batch (default 32m); smaller batches stop sooner on Ctrl-C")
    w.add_argument("--namespace", metavar="JSON|FILE", help="namespace to create a new store with (model, dtype, layout, page bytes)")
    _config_args(w)
    g = w.add_argument_group("SGLang file backend (HiCacheFile) sources: the rank whose files to import")
    g.add_argument("--model", help="the server's --model-path (as HiCacheFile put it in file names)")
    g.add_argument("--tp-rank", type=int, default=0)
    g.add_argument("--tp-size", type=int, default=1)
    g.add_argument("--pp-rank", type=int, default=0)
    g.add_argument("--pp-size", type=int, default=1)
    g.add_argument("--mla", action="store_true", help="an MLA model (DeepSeek): one object per page, shared by TP ranks")
    g.add_argument("--split-heads", type=int, default=0, metavar="SF", help="tp_lcm_size // tp_size when heads are split (page_head)")
    g.add_argument("--attn-cp-rank", type=int, default=0)
    g.add_argument("--attn-cp-size", type=int, default=1)
    g.add_argument("--dcp-rank", type=int, default=0)
    g.add_argument("--dcp-size", type=int, default=1)
    g.add_argument("--logical-page-size", type=int, default=None)
    g.add_argument("--page-bytes", type=parse_size, metavar="SIZE",
                   help="bytes of one file (flat page); default: from the store's namespace, else the first file")
    r = w.add_argument_group("replay against a live server")
    r.add_argument("--replay", metavar="PROMPTS.jsonl", help="one prompt per line: a JSON string or {\"text\": ...}")
    r.add_argument("--server", metavar="URL", help="the SGLang server, e.g. http://127.0.0.1:30000")
    r.add_argument("--concurrency", type=int, default=8, metavar="N", help="requests in flight (default 8)")
    r.add_argument("--timeout", type=_positive_float, default=600.0, metavar="S", help="seconds per request (default 600)")
    _output_args(w)
    w.set_defaults(func=cmd_warmup)

    e = _sub(subs, "export", f"write a portable archive of a store ({_docs('archive.md')})",
             "Write the store's objects, CRC-checked, to a versioned archive that `warmup` imports on another node. "
             "Works while a server writes the store.")
    _store_arg(e)
    e.add_argument("--out", required=True, metavar="FILE", help="archive path ('-' = stdout)")
    e.add_argument("--keys", metavar="FILE", help="export only these keys (one per line)")
    _output_args(e, progress=False)
    e.set_defaults(func=cmd_export)

    s = _sub(subs, "stats", "capacity, usage, objects per pool, watermarks, counters",
             "Show what a store holds. Read-only: works while a server writes the store.")
    _store_arg(s)
    _config_args(s)
    _output_args(s, progress=False)
    s.add_argument("--prometheus", action="store_true", help="print the umbp_nvme_* metric families (text exposition)")
    s.set_defaults(func=cmd_stats)

    dr = _sub(subs, "doctor", "what the store will use on this machine and what the machine can do",
              "Check io_uring, the engine, O_DIRECT, RLIMIT_MEMLOCK, hugepages, file system, I/O scheduler and "
              "GDS, and measure the store against raw O_DIRECT (a few seconds, in a scratch directory beside it). "
              "Each finding comes with a fix. Exit 1 when a check fails.")
    _store_arg(dr)
    _config_args(dr)
    dr.add_argument("--no-probe", action="store_true", help="skip the measured read/write probe")
    _output_args(dr, progress=False)
    dr.set_defaults(func=cmd_doctor)

    v = _sub(subs, "verify", "check every object's CRC32C (exit 1 when any is bad)",
             "Read every object and check its CRC32C. Without --repair it is read-only and works beside a running server.")
    _store_arg(v)
    v.add_argument("--repair", action="store_true", help="drop the bad entries (needs the store to itself)")
    v.add_argument("--rebuild-index", action="store_true",
                   help="write a new index.lmdb from the records in the segments (needs the store to itself); "
                        "exit 1 when some records failed their checks")  # fmt: skip
    _config_args(v)
    _output_args(v, progress=False)
    v.set_defaults(func=cmd_verify)

    c = _sub(subs, "compact", "give free space in segment files back to the file system",
             "Delete segment files that hold nothing and punch holes in free slots (files keep their size). "
             "Needs the store to itself: refused while a writer holds it.")
    _store_arg(c)
    c.add_argument("--tail-only", action="store_true", help="only the free space at the end of each segment")
    _config_args(c)
    _output_args(c, progress=False)
    c.set_defaults(func=cmd_compact)

    i = _sub(subs, "inspect", "where keys live and whether they verify",
             "For each key: segment file, offset, length, CRC32C, generation, and whether its bytes verify. Read-only.")
    _store_arg(i)
    i.add_argument("keys", nargs="+", metavar="KEY", help="component keys, e.g. <hash>_0_k")
    _output_args(i, progress=False)
    i.set_defaults(func=cmd_inspect)

    b = _sub(subs, "bench", "run a benchmark (umbp_nvme.bench) and print its table",
             "umbp-nvme bench [engine|store|hicache|gds|mixed|trace|fleet|scheduler] [OPTIONS]: run umbp_nvme.bench.NAME (shipped with "
             "the package; default engine). Common options: --quick (small matrix), --dir DIR (store, hicache, mixed: --keep), --json PATH, "
             "--plot PNG (needs matplotlib).")
    b.set_defaults(func=cmd_bench)

    d = _sub(subs, "demo", "a short write/read round trip on a temporary store",
             "Write and read 2 x 128 HiCache-shaped pages on a temporary store, check every byte, print a table.")
    d.add_argument("--keep", metavar="DIR", help="use DIR instead of a temporary directory and keep it")
    d.set_defaults(func=cmd_demo)
    return p


def _output_args(p, progress: bool = True) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    if progress:
        p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar on stderr (default: when stderr is a terminal)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if at is not None and argv[at] == "bench" and not any(a in ("-h", "--help") for a in argv[at + 1 : at + 2]):
        argv, rest = argv[: at + 1], argv[at + 1 :]  # the benchmark parses its own options (its --help too)
    args = parser.parse_args(argv)
    args.rest = rest
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="umbp-nvme: %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    from .archive import ArchiveError
    from ..errors import StoreError
    from .maintenance import NotAStoreError
    from .sources import SourceError

    from .drives import roots_of, run_per_drive
    from .paths import expand_paths, not_a_store_hint, permission_message, store_path_error

    try:
        expand_paths(args)  # a quoted ~ is still the home directory
        roots = roots_of(args)  # several drives: each one's directory is a store (drives.py)
        why = store_path_error(args.store) if getattr(args, "store", None) else None
    except ValueError as e:
        print(f"umbp-nvme {args.command}: error: --store: {e}", file=sys.stderr)
        return EXIT_ERROR
    if why:
        print(f"umbp-nvme {args.command}: error: {why}", file=sys.stderr)
        return EXIT_ERROR
    try:
        if roots is not None:
            return run_per_drive(args, roots, (StoreError, NotAStoreError, ArchiveError, SourceError, OSError), CliError)
        return int(args.func(args) or 0)
    except CliError as e:
        print(f"umbp-nvme {args.command}: error: {e}", file=sys.stderr)
    except NotAStoreError as e:
        print(f"umbp-nvme {args.command}: error: {e}{not_a_store_hint(getattr(args, 'store', None))}", file=sys.stderr)
    except (StoreError, ArchiveError, SourceError) as e:
        print(f"umbp-nvme {args.command}: error: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"umbp-nvme {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of our stdout went away (`export --out - | head`)
        return EXIT_ERROR
    except PermissionError as e:
        print(f"umbp-nvme {args.command}: error: {permission_message(e, getattr(args, 'store', None))}", file=sys.stderr)
    except OSError as e:  # a path the operator gave: missing, a directory ...
        print(f"umbp-nvme {args.command}: error: {e}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
