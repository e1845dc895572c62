"""NVIDIA Dynamo's standalone KV indexer, for `bench fleet`: started, fed our nodes, asked what it knows.

``python -m dynamo.indexer`` comes with the ``ai-dynamo-runtime`` wheel (tools/install_dynamo.sh
puts it in a venv of its own). It speaks HTTP only: ``/register`` starts a ZMQ SUB (and replay
DEALER) per worker, ``/dump`` lists the blocks it holds per worker and storage tier (as stored
events), ``/query`` matches a token sequence against them (prefix tokens per tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request

U64 = (1 << 64) - 1


def available(python: str) -> str | None:
    """None when ``python -m dynamo.indexer`` can run, else why not."""
    if not python:
        return "no --dynamo-python given"
    if not os.path.exists(python):
        return f"{python} does not exist"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('dynamo.indexer') is None)"
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python}: {e!r}"
    return None if r.returncode == 0 else f"dynamo.indexer is not importable by {python} (tools/install_dynamo.sh)"


class Indexer:
    def __init__(self, python: str, port: int, log_path: str, model: str, block_size: int):
        self.port, self.model, self.block_size = port, model, block_size
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([python, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
                                     stdout=self._log, stderr=subprocess.STDOUT)  # fmt: skip
        self.http("GET", "/workers", wait_s=60)

    def http(self, method: str, path: str, body=None, wait_s: float = 10.0):
        deadline = time.monotonic() + wait_s
        while True:
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})  # fmt: skip
            try:
                return json.loads(urllib.request.urlopen(req, timeout=10).read() or b"null")
            except (ConnectionError, urllib.error.URLError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str) -> None:
        self.http("POST", "/register", {"instance_id": instance_id, "endpoint": endpoint,
                                        "replay_endpoint": replay_endpoint, "model_name": self.model,
                                        "block_size": self.block_size})  # fmt: skip

    def unregister(self, instance_id: int) -> None:
        """Drop a worker and every block it had (what Dynamo's discovery does when a worker's lease ends)."""
        self.http("POST", "/unregister", {"instance_id": instance_id, "model_name": self.model})

    def blocks(self, tier: str = "disk") -> dict[int, set[int]]:
        """Worker -> the block hashes (u64) it holds in ``tier``, from /dump's stored events
        (applied in order, removed ones taken out)."""
        out: dict[int, set[int]] = {}
        for group in (self.http("GET", "/dump") or {}).values():
            for ev in group.get("events", ()):
                if ev.get("storage_tier") != tier:
                    continue
                held = out.setdefault(int(ev["worker_id"]), set())
                data = ev["event"]["data"]
                if "stored" in data:
                    held.update(int(b["block_hash"]) for b in data["stored"]["blocks"])
                elif "removed" in data:
                    held.difference_update(int(h) for h in data["removed"].get("block_hashes", ()))
                elif "cleared" in data or data == "cleared":
                    held.clear()
        return out

    def query(self, tokens: list[int]) -> dict:
        return self.http("POST", "/query", {"token_ids": tokens, "model_name": self.model})

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]
