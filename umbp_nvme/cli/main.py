"""`umbp-nvme`: fill, move, check and inspect a store without writing Python (docs/cli.md).

This module is the command line's grammar: the subcommands, their arguments and examples, and
``main`` (logging, the store path checks, several drives, errors to messages and exit codes).
What each store subcommand does is in commands.py (exit codes there).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys

from .. import __version__
from .commands import (
    EXIT_ERROR, EXIT_INTERRUPTED, CliError, cmd_compact, cmd_doctor, cmd_export, cmd_inspect, cmd_stats,
    cmd_verify, cmd_warmup,
)


def parse_size(text: str) -> int:
    """'4096', '64k', '512MiB', '1.5g' -> bytes (binary units: sizes.py)."""
    from ..sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_size(example: str, unset: str):
    """parse_size for an option where 0 bytes means nothing: refused, saying what leaving it out does
    (issue 35: --capacity 0 silently meant the 32 GiB default)."""

    def parse(text: str) -> int:
        n = parse_size(text)
        if n <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is 0 bytes; give a size above 0 (e.g. {example}), or leave the "
                                             f"option out: {unset}")
        return n

    return parse


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:  # not a number: refused below like 0
        v = -1
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return v


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
  umbp-nvme bench server --quick --crash --json server.json   # SGLang's real server: this store vs l2, none, file
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
    p.add_argument("--capacity", type=_positive_size("500g", "an existing store keeps the capacity it records, a new one gets "
                                                     "UMBP_SSD_CAPACITY or 32 GiB"), metavar="SIZE",
                   help="ssd_capacity_bytes of this store directory (one rank's), e.g. 500g (default: the capacity "
                        "the store records; a new store: UMBP_SSD_CAPACITY or 32g)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="umbp-nvme",
        description="Manage umbp_nvme KV-cache stores: warm up, export, check, inspect, benchmark.",
        epilog=f"Run `umbp-nvme demo` first; `umbp-nvme SUBCOMMAND --help` shows examples.\nDocs: {_docs('cli.md')}",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the docs path on one line
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    p.add_argument("--version", action="version", version=f"umbp-nvme {__version__} (Python {platform.python_version()})")
    subs = p.add_subparsers(dest="command", metavar="SUBCOMMAND")

    w = _sub(subs, "warmup", "import pages into a store, or warm a live server from prompts",
             "Import pages into a store from SGLang file-backend directories, other stores or archives "
             "(deduplicated, CRC-checked, resumable), or with --replay send prompts to a running server.")
    _store_arg(w, required=False)
    w.add_argument("sources", nargs="*", metavar="SOURCE", help="HiCacheFile directory, store directory, or archive file ('-' = stdin)")
    w.add_argument("--max-gbps", type=_positive_float, metavar="GB/s", help="throttle the import (decimal GB per second)")
    w.add_argument("--keys", metavar="FILE", help="import only these keys (one per line)")
    w.add_argument("--batch-size", type=_positive_size("8m", "32 MiB per batch"), default=None, metavar="SIZE",
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
    g.add_argument("--page-bytes", type=_positive_size("4m", "the page size comes from the store's namespace, else the first "
                                                       "file"), metavar="SIZE",
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
             "umbp-nvme bench [engine|store|hicache|gds|mixed|trace|fleet|scheduler|server] [OPTIONS]: run umbp_nvme.bench.NAME (shipped with "
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
