"""Kill an index rebuild at a chosen step (issue 34): a child process rebuilds, through a writer's
open (``StoreHooks.rebuild_step``) or ``umbp-nvme verify --rebuild-index`` (the ``step`` of
``maintenance.rebuild_index_dir``), and stops at the step named; the parent then sends the signal
(SIGKILL, or SIGINT: Ctrl-C) and reads what the child said.

Every step the child passes is printed (``step NAME``), so a test also sees the order, and a run
with no target shows the whole list. The store and the version model around it come from
support/version_crash.py (a layout whose killed put left records on disk that must never come
back) and support/versions.py. ``Follower`` is a read-only opener in its own process, asked for
its view of every key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import umbp_nvme

from .version_crash import Layout

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = os.path.dirname(os.path.dirname(os.path.abspath(umbp_nvme.__file__)))
HOLD_S = 120  # the child waits this long at its step: the parent signals it well before


def step_hook(target: str | None):
    """The child's hook: print each step; at ``target``, say so and wait for the parent's signal."""

    def step(name: str) -> None:
        print("step", name, flush=True)
        if name == target:
            print("at", name, flush=True)
            time.sleep(HOLD_S)

    return step


_PRELUDE = f"""
import sys
sys.path[:0] = [{PRODUCT!r}, {TESTS!r}]
import logging
logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # a rebuild logs ERROR lines by design
from support.rebuild_kills import step_hook
"""

_OPEN = _PRELUDE + """
import asyncio
from support.version_crash import Layout
from umbp_nvme.store import PageStore
from umbp_nvme.store.hooks import StoreHooks

async def main():
    st = await PageStore.open({path!r}, Layout(**{layout!r}).config(), hooks=StoreHooks(rebuild_step=step_hook({target!r})))
    print("opened", st.object_count(), flush=True)
    await st.close()

asyncio.run(main())
"""

_VERIFY = _PRELUDE + """
from umbp_nvme.cli import main as cli, maintenance

real = maintenance.rebuild_index_dir
maintenance.rebuild_index_dir = lambda path: real(path, step=step_hook({target!r}))  # the command looks it up per call
sys.exit(cli.main(["verify", "--store", {path!r}, "--rebuild-index"]))
"""


@dataclasses.dataclass
class ChildRun:
    steps: list[str]  # the steps the child passed, in order
    stopped_at: str | None  # the step it was signalled at (None: it ran to its end)
    returncode: int
    stdout: str
    stderr: str


def run_child(kind: str, path: str, c: Layout, target: str | None, sig: int = signal.SIGKILL) -> ChildRun:
    """Run the rebuild ``kind`` ("open" or "verify") on ``path`` in a child; signal it with ``sig``
    once it reached ``target`` (None: let it finish)."""
    code = (_OPEN if kind == "open" else _VERIFY).format(path=path, layout=dataclasses.asdict(c), target=target)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, at = [], None
    try:
        for line in p.stdout:  # readline, not communicate: it must act on the line as it comes
            lines.append(line)
            if line.startswith("at "):
                at = line.split()[1]
                p.send_signal(sig)
                break
        out = "".join(lines) + p.stdout.read()
        err = p.stderr.read()
        rc = p.wait(timeout=HOLD_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
    steps = [x.split()[1] for x in out.splitlines() if x.startswith("step ")]
    return ChildRun(steps, at, rc, out, err)


_FOLLOW = _PRELUDE + """
import asyncio, json
import numpy as np
from support.version_crash import Layout
from support.versions import version_in
from umbp_nvme.store import PageStore

async def main():
    c, keys = Layout(**{layout!r}), {keys!r}
    st = await PageStore.open({path!r}, c.config(), readonly=True)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "view":
        outs = [np.zeros(c.obj, np.uint8) for _ in keys]
        got = await st.get_many(keys, outs)
        vs = [version_in(k, o) if g else None for k, g, o in zip(keys, got, outs)]
        print(json.dumps([("x" if v is None else v) if g else None for g, v in zip(got, vs)]), flush=True)
    await st.close()

asyncio.run(main())
"""


class Follower:
    """A read-only opener in its own process (LMDB allows one handle per file and process, and a
    writer in this one): ``view()`` is each key's served version, None for a miss, "x" for bytes of
    no version of that key."""

    def __init__(self, path: str, c: Layout, keys: list[str]):
        code = _FOLLOW.format(path=path, layout=dataclasses.asdict(c), keys=keys)
        self.p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)  # fmt: skip
        if self.p.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the follower did not open: {self.p.stderr.read()[-2000:]}")

    def view(self) -> list:
        self.p.stdin.write("view\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the follower ended: {self.p.stderr.read()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(timeout=60)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
            self.p.stdout.close()
            self.p.stderr.close()
