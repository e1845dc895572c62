"""Start SGLang's real ``python -m sglang.launch_server`` on this machine, with this store as L3.

    python -m umbp_nvme.bench.server_launch [--cpu-shims] [--ext-dir DIR] -- SGLANG_ARGS...

Test support for ``umbp-nvme bench server`` and tests/sglang/test_real_server.py; installs
nothing (tools/install_sglang.sh then tools/install_sglang_server.sh). On a CPU-only machine the
server runs with umbp_nvme/bench/sglang_shims/cpu_server on its PYTHONPATH (what SGLang lacks on
CPU, applied in each of its processes) and a tiny Llama of dummy weights (``write_model_dir``).

Before the server starts, SGLang's page-hash extension (``get_hash_str``, JIT-built with g++ into
``TORCH_EXTENSIONS_DIR`` on first use) is built once in a private directory: a build during
serving takes 20-37 s here, HiCache's prefetch times out meanwhile and L3 hits silently become
recomputes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
SHIMS_DIR = os.path.join(BENCH_DIR, "sglang_shims")
CPU_SHIMS_DIR = os.path.join(SHIMS_DIR, "cpu_server")
SRC_ROOT = os.path.dirname(os.path.dirname(BENCH_DIR))  # holds umbp_nvme/

# A tiny Llama: 4 layers, KV pages of 64 tokens are 512 KiB (bf16), a 2,000-token prefill ~0.3 s.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
    "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}
# What a CPU-only machine needs beyond the README's command (the "device" part of it).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
             "--disable-cuda-graph", "--grammar-backend", "none", "--dtype", "bfloat16",
             "--load-format", "dummy", "--skip-tokenizer-init", "--max-total-tokens", "8192"]
WARM_PAGE_HASH = ("import warnings; warnings.filterwarnings('ignore'); "
                  "from sglang.srt.mem_cache.utils import get_hash_str; "
                  "assert len(get_hash_str(list(range(8)), None, page_size=4)) == 2")


def write_model_dir(directory: str, config: dict | None = None) -> str:
    """A model directory holding only ``config.json`` (``--load-format dummy`` needs no weights)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config or TINY_LLAMA, f, indent=1)
    return directory


def server_env(base: dict | None = None, *, ext_dir: str, cpu_shims: bool = True,
               omp_wait_policy: str | None = None) -> dict:
    """The server's environment: the shims (CPU), a private TORCH_EXTENSIONS_DIR, this checkout's
    umbp_nvme importable. ``omp_wait_policy`` sets OMP_WAIT_POLICY for the server alone (the
    user's choice, measured by bench server; the store never sets it)."""
    env = dict(os.environ if base is None else base)
    parts = [CPU_SHIMS_DIR, SHIMS_DIR] if cpu_shims else []
    parts += [SRC_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env["TORCH_EXTENSIONS_DIR"] = ext_dir
    if cpu_shims:
        env["UMBP_SGLANG_CPU_SHIMS"] = "1"
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it SGLang takes its CUDA path (and imports vllm)
    if omp_wait_policy:
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    else:
        env.pop("OMP_WAIT_POLICY", None)
    return env


def warm_page_hash(env: dict, python: str = sys.executable, timeout_s: float = 300) -> float:
    """Build (or load) SGLang's page-hash extension in env's TORCH_EXTENSIONS_DIR; seconds taken."""
    t0 = time.monotonic()
    r = subprocess.run([python, "-c", WARM_PAGE_HASH], env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"warming SGLang's page-hash extension failed (rc {r.returncode}): {r.stderr[-2000:]}")
    return time.monotonic() - t0


def umbp_extra_config(store_dir: str, capacity: str = "4GiB", **more) -> dict:
    """The README's extra-config for this store (its keys), at ``store_dir``."""
    cfg = {"backend_name": "umbp_nvme", "module_path": "umbp_nvme.sglang_backend",
           "class_name": "UMBPNvmeStore", "interface_v1": 1,
           "ssd_storage_dir": store_dir, "ssd_capacity_bytes": capacity, "ssd_durability_mode": "relaxed"}
    cfg.update(more)
    return cfg


def launch_argv(python: str, args: list[str]) -> list[str]:
    return [python, "-m", "sglang.launch_server", *args]


def start(args: list[str], env: dict, log_path: str, python: str = sys.executable) -> subprocess.Popen:
    """The server in a process group of its own (``stop`` kills every process it spawned)."""
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(launch_argv(python, args), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()


def stop(proc: subprocess.Popen, sig: int = 15, wait_s: float = 20.0) -> None:
    """Signal the server's whole process group; SIGKILL what is left after ``wait_s``."""
    import signal

    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        break
    # the group may outlive its leader (the scheduler process): make sure nothing stays
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m umbp_nvme.bench.server_launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-shims", action="store_true", help="apply the CPU test shims (a CPU-only machine)")
    p.add_argument("--ext-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "umbp-sglang-extensions"),
                   help="TORCH_EXTENSIONS_DIR for the server (the page hash is warmed there first)")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER, help="arguments for sglang.launch_server (after --)")
    a = p.parse_args(argv)
    rest = [x for x in a.sglang_args if x != "--"] if a.sglang_args[:1] == ["--"] else a.sglang_args
    env = server_env(ext_dir=a.ext_dir, cpu_shims=a.cpu_shims)
    print(f"server_launch: page hash ready in {warm_page_hash(env):.1f} s ({a.ext_dir})", file=sys.stderr)
    print("server_launch: " + shlex.join(launch_argv(sys.executable, rest)), file=sys.stderr)
    os.execvpe(sys.executable, launch_argv(sys.executable, rest), env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
