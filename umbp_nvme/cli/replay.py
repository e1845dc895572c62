"""``umbp-nvme warmup --replay``: warm a live SGLang server by sending it prompts.

Every prompt is POSTed to ``{server}/generate`` with ``max_new_tokens=1``; the server's own
cache (and so its storage backend) fills as it prefills them.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from .sources import SourceError
from .warmup import Progress


# --- replay against a live server ------------------------------------------------------------


@dataclass
class ReplaySummary:
    sent: int = 0
    ok: int = 0
    failed: int = 0  # every request without a valid reply, malformed ones included
    malformed: int = 0  # of which the server answered with something that is not a /generate reply
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    errors: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["seconds"] = round(self.seconds, 3)
        d["requests_per_s"] = round(self.sent / self.seconds, 2) if self.seconds > 0 else 0.0
        return d

    def table(self) -> str:
        d = self.as_dict()
        lines = [
            f"requests  {d['sent']} sent, {d['ok']} ok, {d['failed']} failed"
            + (f" ({d['malformed']} malformed replies)" if d["malformed"] else ""),
            f"tokens    {d['prompt_tokens']} prompt, {d['cached_tokens']} already cached",
            f"time      {d['seconds']:.2f} s, {d['requests_per_s']:.1f} requests/s",
        ]
        if d["interrupted"]:
            lines.append("interrupted: yes")
        lines += [f"  ! {e}" for e in d["errors"][:10]]
        return "\n".join(lines)


MAX_PROMPT_LINE_BYTES = 64 << 20  # a prompt of a million tokens is a few MiB of JSON


def load_prompts(path: str) -> list[dict]:
    """PROMPTS.jsonl: one JSON value per line: a string, or an object with "text" (or "prompt") or
    "input_ids"; an object's "sampling_params" are kept (max_new_tokens is forced to 1)."""
    out = []
    try:
        f = sys.stdin.buffer if path == "-" else open(path, "rb")
    except OSError as e:
        raise SourceError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    with f:
        # bounded lines: a device (/dev/zero) or a damaged file is an error, not all of memory
        for n, raw in enumerate(iter(lambda: f.readline(MAX_PROMPT_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_PROMPT_LINE_BYTES:
                raise SourceError(f"{path}:{n}: a line over {MAX_PROMPT_LINE_BYTES >> 20} MiB; each line must be one prompt")
            line = raw.strip()
            if not line:
                continue
            try:
                v = json.loads(line.decode("utf-8"))  # a UnicodeDecodeError is a ValueError
            except (ValueError, RecursionError) as e:
                raise SourceError(f"{path}:{n}: not valid JSON ({e}); each line must be one JSON value") from None
            if isinstance(v, str):
                body = {"text": v}
            elif isinstance(v, dict) and ("text" in v or "prompt" in v or "input_ids" in v):
                body = {k: v[k] for k in ("text", "input_ids", "lora_path", "image_data") if k in v}
                if "prompt" in v and "text" not in body:
                    body["text"] = v["prompt"]
                body["sampling_params"] = dict(v.get("sampling_params") or {})
            else:
                raise SourceError(f'{path}:{n}: expected a string or an object with "text", "prompt" or "input_ids"')
            sp = body.setdefault("sampling_params", {})
            sp["max_new_tokens"] = 1
            sp.setdefault("temperature", 0)
            out.append(body)
    return out


MAX_REPLY_BYTES = 16 << 20  # a /generate reply with max_new_tokens=1 is a few KiB
# --timeout: below 0.1 s no prefill answers in time; above a day the socket timeout overflows time_t
# (1e300 or inf was an OverflowError traceback from every worker)
TIMEOUT_S_MIN, TIMEOUT_S_MAX = 0.1, 86400.0
CONCURRENCY_MAX = 1024  # one thread per request in flight


class BadReply(ValueError):
    """The server answered 200 with something that is not a /generate reply."""


def _post(url: str, body: dict, timeout_s: float) -> bytes:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    deadline = time.monotonic() + timeout_s
    chunks, got = [], 0
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        while got <= MAX_REPLY_BYTES:  # never more: the rest is dropped with the connection
            # read1: what has arrived, so a server dripping bytes cannot stretch one request past
            # --timeout (the socket timeout alone restarts with every byte)
            c = resp.read1(min(1 << 20, MAX_REPLY_BYTES + 1 - got))
            if not c:
                break
            chunks.append(c)
            got += len(c)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the reply was not complete after {timeout_s:g} s")
    if got > MAX_REPLY_BYTES:
        raise BadReply(f"reply larger than {MAX_REPLY_BYTES >> 20} MiB")
    return b"".join(chunks)


def _token_count(meta: dict, name: str) -> int:
    v = meta.get(name, 0)
    if v is None:
        return 0
    if type(v) is not int or not 0 <= v < 1 << 53:  # bool, float (1e999 is inf), str, absurd: not a count
        raise BadReply(f"meta_info.{name} is {str(v)[:40]!r}, not a token count")
    return v


def parse_reply(raw: bytes) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a /generate reply; BadReply for anything else."""
    try:
        out = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        head = raw[:60].decode("utf-8", "backslashreplace")
        raise BadReply(f"reply is not JSON ({type(e).__name__}; starts {head!r})") from None
    if isinstance(out, list) and out:  # a batch reply: the first item
        out = out[0]
    if not isinstance(out, dict):
        raise BadReply(f"reply is a JSON {type(out).__name__}, not an object")
    meta = out.get("meta_info", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise BadReply(f"meta_info is a JSON {type(meta).__name__}, not an object")
    return _token_count(meta, "prompt_tokens"), _token_count(meta, "cached_tokens")


def replay(prompts_path: str, server: str, *, concurrency: int = 8, timeout_s: float = 600.0,
           progress: bool | None = None) -> ReplaySummary:
    """POST every prompt to {server}/generate with max_new_tokens=1, ``concurrency`` in flight."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= CONCURRENCY_MAX:
        raise ValueError(f"--concurrency must be 1..{CONCURRENCY_MAX}, got {concurrency!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not TIMEOUT_S_MIN <= timeout_s <= TIMEOUT_S_MAX:
        raise ValueError(f"--timeout must be between {TIMEOUT_S_MIN:g} and {TIMEOUT_S_MAX:g} seconds, got {timeout_s!r}")
    bodies = load_prompts(prompts_path)
    base = server.rstrip("/")
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    url = base + "/generate"
    summary = ReplaySummary()
    bar = Progress(len(bodies), unit="req", desc="replay", enabled=progress)
    t0 = time.perf_counter()
    lock = threading.Lock()
    stop = threading.Event()

    def one(i: int, body: dict) -> None:
        if stop.is_set():
            return
        # everything the server sends is parsed in here: no reply can end the run
        err = None
        malformed = False
        try:
            prompt_tokens, cached_tokens = parse_reply(_post(url, body, timeout_s))
        except urllib.error.HTTPError as e:
            err = f"prompt {i + 1}: {url} answered HTTP {e.code} {str(e.reason)[:200]}"
            e.close()
        except BadReply as e:
            malformed = True
            err = f"prompt {i + 1}: {url} sent a malformed reply: {e}"
        except TimeoutError as e:
            err = f"prompt {i + 1}: {url} timed out ({e or 'no answer'}); raise --timeout if the server is just slow"
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            err = f"prompt {i + 1}: cannot reach {url} ({reason}); is the server running and is --server right?"
        except (http.client.HTTPException, ValueError) as e:  # broken HTTP framing, bad headers
            malformed = True
            err = f"prompt {i + 1}: {url} broke the HTTP protocol ({type(e).__name__}: {str(e)[:200]})"
        with lock:
            summary.sent += 1
            if err is None:
                summary.ok += 1
                summary.prompt_tokens += prompt_tokens
                summary.cached_tokens += cached_tokens
            else:
                summary.failed += 1
                summary.malformed += malformed
                if len(summary.errors) < 20:
                    summary.errors.append(err)
        bar.update(1)

    ex = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="umbp-replay")
    futs = []
    try:
        futs = [ex.submit(one, i, b) for i, b in enumerate(bodies)]
        for f in futs:
            f.result()
    except KeyboardInterrupt:
        summary.interrupted = True
        stop.set()
        for f in futs:
            f.cancel()
    finally:
        ex.shutdown(wait=True)
        bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary
