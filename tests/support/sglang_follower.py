"""A TP-1 follower in a child process over the real sglang==0.5.23 wheel: it opens the shared
store read-only and answers line commands on stdin (used by the leader/follower and trust tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support import sglang_env as E

FOLLOWER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import sglang_env as E
    root = sys.argv[1]
    pool, mamba = E.mla_pool(), E.mamba_pool()
    cfg = E.storage_config(root, tp_rank=1, tp_size=2, is_mla=True)
    assert getattr(cfg, "is_storage_writer", False) is False  # before 0.5.23: no such property (TP rank 0 writes)
    backend = E.load_backend(cfg, pool.host, {{"mamba": mamba.host}})
    hashes = E.page_hashes(128, seed=60)
    idx = pool.alloc_pages(128)

    def say(*a):
        print(*a, flush=True)

    say("started", backend.batch_exists(hashes), backend.is_mla_follower)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "check":
            n, seed = int(cmd[1]), int(cmd[2])
            expected = E.fill_random(pool.host, idx[: n * E.PAGE_SIZE], seed)
            E.zero_pages(pool.host, idx[: n * E.PAGE_SIZE])
            hit = backend.batch_exists(hashes)
            got = backend.batch_get_v1(hashes[:n], idx[: n * E.PAGE_SIZE])
            same = E.read_pages(pool.host, idx[: n * E.PAGE_SIZE]) == expected
            # A follower never writes KV: batch_set_v1 is a successful no-op (one bool per page).
            fake = backend.batch_set_v1(["f" * 64] * 2, idx[: 2 * E.PAGE_SIZE])
            say("checked", hit, sum(got), same, fake, backend.batch_exists(["f" * 64]))
        elif cmd[0] == "mamba":
            # The follower's own TP-sharded state goes to its private store and reads back.
            m_idx = mamba.alloc_pages(4)
            data = E.fill_random(mamba.host, m_idx, 77)
            t = E.sglang_imports().PoolTransfer(name=E.sglang_imports().PoolName.MAMBA, host_indices=m_idx, keys=hashes[:4])
            ok_set = backend.batch_set_v2([t])["mamba"]
            E.zero_pages(mamba.host, m_idx)
            ok_get = backend.batch_get_v2([t])["mamba"]
            say("mamba", all(ok_set), all(ok_get), E.read_pages(mamba.host, m_idx) == data)
        elif cmd[0] == "quit":
            backend.close()
            say("bye")
            break
    """
)


class Follower:
    def __init__(self, root):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", FOLLOWER.format(tests=E.TESTS_DIR), root],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=E.subprocess_env(),
        )

    def read(self) -> list[str]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise AssertionError(f"follower died (rc={self.proc.returncode}):\n{self.proc.stderr.read()[-4000:]}")
        return line.split()

    def send(self, text: str) -> list[str]:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.send("quit")
            finally:
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
