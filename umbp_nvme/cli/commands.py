"""What each store subcommand of `umbp-nvme` does (docs/cli.md): its config, its work, its output
and its exit code. main.py parses the arguments and calls one ``cmd_*`` here.

Exit codes: 0 success; 1 the command ran but found or left problems (failed imports, bad
objects, missing keys); 2 it could not run (bad arguments, not a store, store locked by a
writer, namespace mismatch); 130 interrupted (a warm-up continues when run again).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from ..keybytes import printable_key

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class CliError(Exception):
    """A message for the operator; exit code 2."""


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
    from ..errors import StoreLockedError

    try:
        s = asyncio.run(
            import_sources(args.store, args.sources, cfg, layout=layout, page_bytes=args.page_bytes, namespace=namespace,
                           keys=keys, max_gbps=args.max_gbps, progress=args.progress,
                           batch_bytes=args.batch_size or BATCH_BYTES,
                           capacity_from_manifest=not _capacity_given(args))
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    except StoreLockedError as e:  # the store's own text says "open it read-only": a warm-up writes
        raise CliError(
            f"warmup writes into {e.path or args.store}, but a writer (pid {e.holder or 'unknown'}) holds it; a "
            "store has one writer at a time. Stop that process (or the SGLang server using this directory) and run "
            "warmup again, or warm the running server instead: umbp-nvme warmup --replay PROMPTS.jsonl --server URL "
            "sends it prompts and it writes the pages itself") from None
    _emit(args, s.as_dict(), s.table())
    return EXIT_INTERRUPTED if s.interrupted else EXIT_OK if s.ok else EXIT_PROBLEMS


def cmd_export(args) -> int:
    from .export import export_store
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
    import dataclasses

    from ..doctor.report import format_text, report
    from ..errors import StoreError
    from ..store.layout import read_manifest_or_none, recorded_capacity_bytes

    cfg = _load_config(args)
    if _capacity_given(args):
        source = "given: --capacity, --config or UMBP_SSD_CAPACITY"
    else:  # the capacity the store runs with, as its writer recorded it
        try:
            recorded = recorded_capacity_bytes(read_manifest_or_none(args.store) or {})
        except (OSError, ValueError, StoreError):  # a damaged manifest: the report's other checks still run
            recorded = None
        if recorded:
            cfg = dataclasses.replace(cfg, ssd_capacity_bytes=recorded)
            source = "recorded in MANIFEST.json: the capacity its writer runs with"
        else:
            source = "not set: the default for a new store (--capacity or UMBP_SSD_CAPACITY sets it)"
    r = report(args.store, cfg, probe=not args.no_probe, capacity_source=source)
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
            + (f"; {s['long_keys']} objects with keys over 208 bytes cannot be rebuilt" if s["long_keys"] else "")
            + (f"; the old index was damaged: kept as {s['moved_aside']}" if s.get("moved_aside") else "")
            + ("; the old index (sound) was removed" if s.get("old_index_removed") else ""))
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
            if hasattr(store, "wait_loaded"):  # the index loaded before the files change under it
                await store.wait_loaded()
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
