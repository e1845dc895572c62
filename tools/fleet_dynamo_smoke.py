"""Dynamo's standalone KV indexer fed by one UMBPNvmeStore (DISK events, relayed engine events).

A smoke check by hand, not part of `make test` (ai-dynamo-runtime is a 75 MB wheel with its own
dependencies; install it in a separate venv)::

    python3.11 -m venv /tmp/dynvenv && /tmp/dynvenv/bin/pip install ai-dynamo-runtime==1.6.1
    PYTHONPATH=$PWD .venv/bin/python tools/fleet_dynamo_smoke.py /tmp/dynvenv/bin/python

It starts `python -m dynamo.indexer`, a stand-in engine (sglang's own ZmqEventPublisher) that
announces three GPU blocks with their tokens, and a backend that relays the engine's stream and
stores the same three pages; the engine then drops the GPU copies. Expected: /dump lists three
`disk` blocks, /query of the 12 tokens matches 12 on disk, and after one page is deleted, 8.
"""
import json, subprocess, sys, time, hashlib, socket, tempfile, urllib.request
import numpy as np
sys.path.insert(0, "tests")  # the stand-in host pool and config
from support.standin_pools import Config, FakeMHAPool, PAGE
from umbp_nvme.sglang.backend import UMBPNvmeStore, HiCacheStorageExtraInfo
from sglang.srt.disaggregation import kv_events as W
from sglang.srt.mem_cache.utils import hash_str_to_int64 as H

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
HP, E, P, R = port(), port(), port(), port()
d = tempfile.mkdtemp()
ix = subprocess.Popen([sys.argv[1] if len(sys.argv) > 1 else "python", "-m", "dynamo.indexer", "--port", str(HP), "--threads", "1"],
                      stdout=open(d + "/ix.log", "w"), stderr=subprocess.STDOUT)
def http(method, path, body=None):
    for _ in range(100):
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{HP}{path}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=10).read() or b"null")
        except (ConnectionError, urllib.error.URLError) as e:
            err = e; time.sleep(0.2)
    raise err
try:
    engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://*:{E}")
    cfg = Config(d + "/s")
    cfg.extra_config.update(kv_events_endpoint=f"tcp://*:{P}", kv_events_replay_endpoint=f"tcp://*:{R}",
                            kv_events_engine_endpoint=f"tcp://127.0.0.1:{E}")
    be = UMBPNvmeStore(cfg, {}); be.register_mem_pool_host(FakeMHAPool(pages=16, token_bytes=1024))
    print("workers", http("GET", "/workers"))
    print("register", http("POST", "/register", {"instance_id": 1, "endpoint": f"tcp://127.0.0.1:{P}",
          "replay_endpoint": f"tcp://127.0.0.1:{R}", "model_name": "m", "block_size": PAGE}))
    time.sleep(1.0)
    keys = [hashlib.sha256(f"d{i}".encode()).hexdigest() for i in range(3)]
    toks = list(range(1000, 1000 + 3 * PAGE))
    engine.publish(W.KVEventBatch(ts=time.time(), events=[W.BlockStored(block_hashes=[H(k) for k in keys],
        parent_block_hash=None, token_ids=toks, block_size=PAGE, lora_id=None, medium="GPU")]))
    time.sleep(0.5)
    print("put", be.batch_set_v1(keys, np.arange(3 * PAGE), HiCacheStorageExtraInfo(prefix_keys=[])))
    time.sleep(0.5)
    engine.publish(W.KVEventBatch(ts=time.time(), events=[W.BlockRemoved(block_hashes=[H(k) for k in keys], medium="GPU")]))
    time.sleep(1.0)
    print("stats", be.publisher.stats, be.publisher.relay.stats)
    dump = http("GET", "/dump")
    print("dump", json.dumps(dump)[:1500])
    print("query", http("POST", "/query", {"token_ids": toks, "model_name": "m"}))
    be.store.delete_many([keys[2] + be.v1_suffixes[0]])
    time.sleep(1.0)
    print("query after delete", http("POST", "/query", {"token_ids": toks, "model_name": "m"}))
    be.close(); engine.shutdown()
finally:
    ix.terminate(); ix.wait()
    print(open(d + "/ix.log").read()[-3000:])
