"""``umbp-nvme CMD --store D0,D1,...``: the offline tools over a multi-drive store.

Each drive's directory is a complete store, so ``stats``, ``verify``, ``compact``, ``inspect``,
``export`` and ``doctor`` run once per drive and their outputs are combined: text under a
``== drive I: ROOT`` header each, ``--json`` as ``{"drives": [...]}``. A drive that fails (gone,
not a store) is reported and the others still run. ``export`` writes one archive per drive
(OUT.d0, OUT.d1, ...; ``warmup`` imports them all). ``stats`` ends with a per-drive table.
``warmup --store D0,D1`` needs nothing here: PageStore.open takes several roots.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os

PER_DRIVE = ("stats", "verify", "compact", "inspect", "export", "doctor")


def live_counters(store: str) -> dict | None:
    """Counters a running store published next to its data (STATS.json), if it does."""
    from ..store.layout import read_json_or_none

    c = read_json_or_none(os.path.join(store, "STATS.json"))  # never blocks on a FIFO; a non-object is none
    return c if isinstance(c, dict) else None


def roots_of(args) -> list[str] | None:
    """The roots when --store names several, else None (one store: the command runs as always)."""
    from ..config import parse_roots

    store = getattr(args, "store", None)
    if args.command not in PER_DRIVE or not store:
        return None
    roots = parse_roots(store)
    return roots if len(roots) > 1 else None


def run_per_drive(args, roots: list[str], errors: tuple, cli_error) -> int:
    if args.command == "stats" and getattr(args, "prometheus", False):
        return _stats_prometheus(roots, cli_error)
    from .export import is_pipe_or_device

    if args.command == "export" and (args.out == "-" or is_pipe_or_device(args.out)):  # not /dev/null.d0 beside it
        raise cli_error("export of several drives writes one archive per drive: give --out PATH of a new or "
                        f"regular file, not {args.out} (a pipe or device)")
    results = []
    for i, root in enumerate(roots):
        sub = copy.copy(args)
        sub.store = root
        if args.command == "export":
            sub.out = f"{args.out}.d{i}"
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                rc = int(args.func(sub) or 0)
            err = None
        except (cli_error, *errors) as e:  # this drive only: the others still run
            rc, err = 2, str(e)
        results.append((i, root, rc, out.getvalue(), err))
    if getattr(args, "json", False):
        drives = []
        for i, root, rc, text, err in results:
            try:
                body = json.loads(text) if text.strip() else {}
            except ValueError:
                body = {"output": text}
            drives.append({"drive": i, "root": root, "exit": rc, "error": err, **body})
            if args.command == "stats":
                from ..store.drive_set import recorded_health

                drives[-1]["recorded_health"] = recorded_health(root)
        doc = {"drives": drives}
        if args.command == "stats":
            doc.update(_totals(drives))
        print(json.dumps(doc, indent=2, sort_keys=True, default=str))
    else:
        for i, root, rc, text, err in results:
            print(f"== drive {i}: {root}")
            print(text.rstrip() if err is None else f"error: {err}")
        if args.command == "stats":
            print(stats_table(results))
    if args.command == "inspect":  # a key lives on one drive: fine when some drive has it, verified
        return _inspect_rc(roots, args.keys)
    return max(r[2] for r in results)


def _inspect_rc(roots: list[str], keys: list[str]) -> int:
    from .maintenance import inspect_keys

    ok = set()
    for root in roots:
        try:
            ok.update(r["key"] for r in inspect_keys(root, keys) if r["found"] and r["status"] == "ok")
        except Exception:  # noqa: BLE001 - that drive was reported above
            continue
    return 0 if all(k in ok for k in keys) else 1


def _totals(drives: list[dict]) -> dict:
    keys = ("objects", "bytes_used", "object_bytes", "disk_bytes", "capacity_bytes")
    return {k: sum(int(d.get(k) or 0) for d in drives) for k in keys}


def stats_table(results) -> str:
    """One line per drive: objects, bytes, capacity, fill, writer, live counters when published."""
    from ..store.drive_set import recorded_health

    rows = [("drive", "root", "state (last recorded)", "objects", "used GiB", "capacity GiB", "fill %", "writer",
             "errors", "read/write GB/s", "hits/misses")]  # fmt: skip
    for i, root, rc, text, err in results:
        if err is not None:
            rows.append((str(i), root, "error", *["-"] * 8))
            continue
        s = _stats_json(root)
        c = s.get("counters") or {}
        rec = recorded_health(root) or {}
        state = rec.get("state", "ok") + (f" ({rec['reason']})" if rec.get("reason") else "")
        rows.append((
            str(i), root, state, str(s.get("objects", "?")), f"{(s.get('bytes_used') or 0) / 2**30:.3f}",
            f"{(s.get('capacity_bytes') or 0) / 2**30:.2f}", f"{(s.get('fill') or 0) * 100:.1f}",
            f"pid {s['writer_pid']}" if s.get("writer_pid") else "none", str(rec.get("errors", "-")),
            f"{rec['read_gbps']:.3f}/{rec['write_gbps']:.3f}" if "read_gbps" in rec and "write_gbps" in rec else "-",
            f"{c['hits']}/{c['misses']}" if "hits" in c and "misses" in c else "-",
        ))  # fmt: skip
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _stats_prometheus(roots: list[str], cli_error) -> int:
    """One exposition for the whole store: the drives' gauges summed, and ``umbp_nvme_drive_*``
    per drive (its state as a running writer last recorded it; a drive that cannot be read: 0)."""
    import sys

    from ..metrics import FAMILIES, available, store_on_disk_exposition
    from ..store.drive_set import recorded_health

    if not available():
        raise cli_error("--prometheus needs prometheus_client: pip install 'umbp_nvme[metrics]'")
    summed = {k for _, kind, k, _ in FAMILIES if k and k != "high_watermark"}
    total: dict = {"drives": []}
    for i, root in enumerate(roots):
        s, c = _stats_json(root), live_counters(root) or {}
        row = {"drive": i, "path": root, "state": (recorded_health(root) or {}).get("state", "healthy") if s else "degraded"}
        for k in ("objects", "bytes_used", "capacity_bytes", "bytes_read", "bytes_written"):
            v = s.get(k, c.get(k))
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                row[k] = v
        total["drives"].append(row)
        for k, v in list(s.items()) + [(k, v) for k, v in c.items() if k not in s]:
            if k in summed and isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    sys.stdout.write(store_on_disk_exposition(total).decode())
    return 0


def _stats_json(root: str) -> dict:
    from .maintenance import store_stats

    try:
        return store_stats(root)
    except Exception:  # noqa: BLE001 - the table shows what it can
        return {}
