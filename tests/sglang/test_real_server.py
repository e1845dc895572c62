"""SGLang's real ``python -m sglang.launch_server``, started with the README's command (only the
model, the device and the store's directory swapped) and this store as L3 (issue 39).

One server fills the device and host pools past their size with distinct prompts; the first ones,
re-sent, can only come back from L3: each must be served from storage (``cached_tokens_details``)
with the greedy output of its first answer. Then the server is SIGKILLed while the next prompt is
being prefilled and backed up, restarted on the same store, and every prompt answered before the
kill must again be an L3 hit with the same output; ``umbp-nvme verify`` finds the store clean.
A second server (the same command, a 16 MiB store, with SGLang's ``--kv-events-config`` and this
backend's relay) checks that routers see every tier as it is (docs/fleet.md "The real server").

CPU only: a tiny Llama of dummy weights and the CPU test shims (umbp_nvme/bench/server_launch.py).
Skips without the server's dependencies (tools/install_sglang_server.sh), fails for want of them
when ``CI=true``. About 2-4 minutes on a 2-core machine, and 75-80 s more for the events.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from support import real_server as R

R.require_server()

from umbp_nvme.bench import server_client as client  # noqa: E402
from umbp_nvme.bench import server_launch as launch  # noqa: E402
from umbp_nvme.bench.server_workload import l3_servable, make_workload  # noqa: E402

pytestmark = [pytest.mark.real_server, pytest.mark.timeout(900)]

PAGE = 64
PROMPT_TOKENS = 1024  # 16 pages; a re-sent one is served 15 pages (the last is recomputed)
FILL = 8  # 8 x 1,024 tokens overflow the 2,048-token device pool and its 2x host pool
RESEND = 2
NEW_TOKENS = 8
# the device: CPU, and a device pool small enough that FILL prompts overflow it and the host
DEVICE = [f if f != "8192" else "2048" for f in launch.CPU_FLAGS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    ext = str(tmp_path_factory.mktemp("torch_extensions"))
    e = launch.server_env(ext_dir=ext)
    launch.warm_page_hash(e)  # before the start: a build during serving turns L3 hits into recomputes
    return e


class Server:
    def __init__(self, args, env, log):
        self.port = _free_port()
        self.args, self.env, self.log = args + DEVICE + ["--port", str(self.port)], env, log

    def __enter__(self):
        self.proc = launch.start(self.args, self.env, self.log)
        client.wait_ready(self.port, self.proc, self.log, 400)
        return self

    def ask(self, ids):
        return client.generate(self.port, ids, NEW_TOKENS)

    def __exit__(self, *exc):
        launch.stop(self.proc)


def _l3_served(answer) -> bool:
    return answer["storage_tokens"] >= l3_servable(PROMPT_TOKENS, PAGE)


def _wait_backups(port, timeout_s=60.0):
    last, t0 = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        now = client.metrics(port)["umbp_puts"]
        if now == last and now > 0:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError(f"the store's puts kept growing for {timeout_s} s")


def _our_counters_caught_up(port, name, timeout_s=20.0) -> dict:
    """/metrics once ``name`` is > 0: our families are copied into SGLang's multiprocess files every
    second by a thread whose stats call gives up after 2 s on a busy store loop (metrics.py), so on a
    loaded machine they trail SGLang's own counters by a refresh or a few (one CI run read 0)."""
    t0 = time.monotonic()
    while True:
        m = client.metrics(port)
        if m[name] > 0 or time.monotonic() - t0 > timeout_s:
            return m
        time.sleep(0.5)


def _ask_ignoring_the_kill(srv, ids):
    try:
        srv.ask(ids)
    except Exception:
        pass  # the server is killed under it


def test_readme_command_is_what_this_test_runs(tmp_path):
    args = R.readme_args_for(str(tmp_path / "model"), str(tmp_path / "store"), "1GiB")
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["module_path"] == "umbp_nvme.sglang_backend" and extra["class_name"] == "UMBPNvmeStore"
    assert extra["ssd_storage_dir"] == str(tmp_path / "store")
    for flag in ("--enable-hierarchical-cache", "--enable-metrics", "--enable-cache-report"):
        assert flag in args


def test_resent_prompts_come_from_l3_and_survive_sigkill(tmp_path, env):
    model = launch.write_model_dir(str(tmp_path / "model"))
    store = str(tmp_path / "store")
    args = R.readme_args_for(model, store, "1GiB")
    requests = make_workload(seed=39, prompt_tokens=PROMPT_TOKENS, fill=FILL + 1, resend=RESEND, fresh=0)
    fills = [r["ids"] for r in requests if r["phase"] == "fill"]

    with Server(args, env, str(tmp_path / "server1.log")) as srv:
        first = [srv.ask(ids) for ids in fills[:FILL]]
        assert all(len(a["output_ids"]) == NEW_TOKENS for a in first)
        assert len({tuple(a["output_ids"]) for a in first}) > 1, "every prompt got the same answer: outputs prove nothing"
        for i in range(RESEND):
            again = srv.ask(fills[i])
            assert _l3_served(again), (i, again)
            assert again["storage_backend"] and again["output_ids"] == first[i]["output_ids"], (i, again)
        m = client.metrics(srv.port)
        assert m["storage_prefetch_hit_tokens"] >= RESEND * (PROMPT_TOKENS - PAGE)
        m = _our_counters_caught_up(srv.port, "umbp_hits")  # the store's counters reach /metrics by a refresh thread
        assert m["umbp_hits"] > 0 and m["umbp_gets"] >= m["umbp_hits"]
        _wait_backups(srv.port)
        inflight = threading.Thread(target=_ask_ignoring_the_kill, args=(srv, fills[FILL]), daemon=True)
        inflight.start()
        time.sleep(0.3)  # the next prompt is being prefilled and backed up
        launch.stop(srv.proc, sig=9)  # the whole process group at once, as a crash
        inflight.join(60)

    with Server(args, env, str(tmp_path / "server2.log")) as srv:
        for i in range(FILL):
            again = srv.ask(fills[i])
            assert _l3_served(again), (i, again)
            assert again["output_ids"] == first[i]["output_ids"], (i, again["output_ids"], first[i]["output_ids"])

    v = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", "verify", "--store", store], capture_output=True, text=True,
                       env=launch.server_env(ext_dir=env["TORCH_EXTENSIONS_DIR"], cpu_shims=False), timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr


def _dynamo_python() -> str:
    """Dynamo's indexer when it is installed (.ci/run installs it; tools/install_dynamo.sh), else ''."""
    import os

    from umbp_nvme.bench.fleet_dynamo import available

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    py = os.environ.get("UMBP_DYNAMO_PYTHON") or os.path.join(root, ".venv-dynamo", "bin", "python")
    return "" if available(py) else py


EVENT_FILL = 3  # 3 x 16 pages of 512 KiB overflow a 16 MiB store (DISK evictions) and the 32-page device pool


def test_the_real_servers_kv_events_reach_routers_with_tokens_and_removals(tmp_path, env):
    """The scheduler's own KV events (--kv-events-config) relayed with ours (relay mode): a
    subscriber on our endpoint (and Dynamo's indexer, when installed) ends with exactly what each
    tier holds: GPU and CPU_PINNED as the scheduler's own stream says, DISK as the store's index
    says, after evictions from a small store and after SGLang's /flush_cache (whose
    AllBlocksCleared wipes every tier of a router: the DISK pages must be announced again).
    DISK pages carry the prompt's token ids."""
    from umbp_nvme.bench import server_events as E

    ports = E.Ports(0, [_free_port() for _ in range(5)])
    model = launch.write_model_dir(str(tmp_path / "model"))
    store = str(tmp_path / "store")
    args = R.readme_args_for(model, store, "16MiB")
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    extra.update(E.extra_config(ports), ssd_segment_size_bytes="4MiB")
    args = R.swap(args, "--hicache-storage-backend-extra-config", json.dumps(extra)) + E.server_flags(ports)
    args.append("--skip-server-warmup")  # its request would only cost time here
    fills = [r["ids"] for r in make_workload(seed=40, prompt_tokens=PROMPT_TOKENS, fill=EVENT_FILL, resend=1, fresh=0)
             if r["phase"] == "fill"]
    watch = E.Watch(ports, str(tmp_path), _dynamo_python())
    try:
        with Server(args, env, str(tmp_path / "server.log")) as srv:
            watch.attach()
            for ids in fills:
                srv.ask(ids)
            _wait_backups(srv.port)
            rows = watch.checkpoint("fill", store)
            assert all(r["ours_phantom"] == r["ours_missing"] == r.get("dynamo_phantom", 0) == r.get("dynamo_missing", 0) == 0
                       for r in rows), json.dumps(rows)
            disk = {r["tier"]: r for r in rows}["DISK"]
            assert 0 < disk["held"] < EVENT_FILL * PROMPT_TOKENS // PAGE, rows  # some pages evicted, some held
            assert watch.ours.stats["removed_DISK"] > 0 and watch.ours.stats["removed_GPU"] > 0, watch.ours.stats
            last = E.prompt_hashes(fills[-1], PAGE)
            on_disk = [i for i, h in enumerate(last) if h in watch.ours.tiers["DISK"]]
            assert on_disk, "the last prompt has no page on DISK"
            for i in on_disk:  # the engine's token ids of that very page
                assert watch.ours.disk_tokens[last[i]] == tuple(fills[-1][i * PAGE : (i + 1) * PAGE]), i

            client.flush_cache(srv.port)
            rows = watch.checkpoint("flush_cache", store)
            assert all(r["ours_phantom"] == r["ours_missing"] == r.get("dynamo_phantom", 0) == r.get("dynamo_missing", 0) == 0
                       for r in rows), json.dumps(rows)
            by = {r["tier"]: r for r in rows}
            assert by["GPU"]["held"] == by["CPU_PINNED"]["held"] == 0 and by["DISK"]["ours_announced"] == disk["held"], rows
            assert watch.ours.stats["cleared"] >= 1
            if watch.indexer is not None:  # Dynamo matches the prompt's DISK prefix, and nothing on GPU
                q = watch.query("flush_cache", fills[-1], PAGE)["dynamo"]
                assert q["gpu"] == 0 and q["disk"] == PAGE * _prefix(on_disk) > 0, q
    finally:
        watch.close()


def _prefix(indices: list[int]) -> int:
    n = 0
    while n in indices:
        n += 1
    return n
