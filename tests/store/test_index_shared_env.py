"""Handles of one index file in one process share its LMDB environment (index.py). A reader's
handle (an in-process MLA follower, a watch reopening after the writer replaced its file) must
open its databases while the writer's thread is inside a commit, and wait for it without
stopping the process: py-lmdb's ``open_db`` without a transaction begins a write transaction on a
writable environment *holding the GIL*, so it waited for LMDB's writer lock while the committing
thread, which holds that lock, waited for the GIL (a whole-process hang, seen in CI).

Each case runs in a child process: a deadlock holds the GIL, so only a process boundary can bound it.
"""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = r"""
import sys, threading, time
import numpy as np
from umbp_nvme.store.index import INDEX_FILE, REC_DTYPE, Index

path = sys.argv[1] + "/" + INDEX_FILE
mode = sys.argv[2]
rec = np.zeros(1, REC_DTYPE)
rec["length"], rec["depth"] = 4096, -1
w = Index(path, readonly=False, map_size=1 << 28, durable=False)
w.commit([(b"%064x_k" % i, rec.tobytes()) for i in range(100)])

inside, go = threading.Event(), threading.Event()

class Puts:  # the commit holds LMDB's writer lock while it draws these
    def __len__(self):
        return 100

    def __iter__(self):
        for i in range(100, 200):
            if i == 150:
                inside.set()
                go.wait()
            yield b"%064x_k" % i, rec.tobytes()

committer = threading.Thread(target=lambda: w.commit(Puts()))
committer.start()
inside.wait()
opened = []
def open_reader():
    opened.append(Index(path, readonly=mode == "reader", map_size=1 << 28, durable=False))
opener = threading.Thread(target=open_reader)
opener.start()
time.sleep(0.3)  # the opener reaches LMDB's writer lock (this thread could not run again if it held the GIL there)
go.set()
committer.join()
opener.join()
h = opened[0]
print("COUNT", h.count(), len([r for r in h.get_records([b"%064x_k" % i for i in range(200)]) if r is not None]))
h.close()
w.close()
"""


def _run(tmp_path, mode: str) -> str:
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path), mode], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_a_reader_handle_opens_while_the_writer_commits(tmp_path):
    # the reader's databases open after the commit, in its snapshot: all 200 keys
    assert _run(tmp_path, "reader").split() == ["COUNT", "200", "200"]


def test_a_second_writer_handle_opens_while_the_first_commits(tmp_path):
    assert _run(tmp_path, "writer").split() == ["COUNT", "200", "200"]
