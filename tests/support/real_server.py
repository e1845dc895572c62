"""Test support for tests/sglang/test_real_server.py: the README's launch command, and whether
SGLang's real HTTP server can start here (tools/install_sglang_server.sh installs what it needs)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
# what `python -m sglang.launch_server` imports beyond tools/install_sglang.sh's set
SERVER_MODULES = ("sglang", "fastapi", "uvicorn", "uvloop", "setproctitle", "interegular", "partial_json_parser",
                  "prometheus_client", "multipart", "einops", "xxhash", "zstandard", "openai", "xgrammar")


def readme_launch_args(path: str = README) -> list[str]:
    """The arguments of the README's ``python -m sglang.launch_server`` command (its ```sh block),
    the extra-config JSON as one argument."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    blocks = [b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "sglang.launch_server" in b]
    if len(blocks) != 1:
        raise AssertionError(f"README.md: expected one ```sh block with sglang.launch_server, found {len(blocks)}")
    words = shlex.split(blocks[0].replace("\\\n", " "))
    at = words.index("sglang.launch_server")
    if words[:at] != ["python", "-m"]:
        raise AssertionError(f"README.md: the command should start `python -m sglang.launch_server`, got {words[:at + 1]}")
    return words[at + 1:]


def swap(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (AssertionError when the flag is absent)."""
    out = list(args)
    i = out.index(flag)
    out[i + 1] = value
    return out


def readme_args_for(model_dir: str, store_dir: str, capacity: str) -> list[str]:
    """The README's command with the model and the store's directory / capacity swapped."""
    args = swap(readme_launch_args(), "--model-path", model_dir)
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    extra.update(ssd_storage_dir=store_dir, ssd_capacity_bytes=capacity)
    return swap(args, "--hicache-storage-backend-extra-config", json.dumps(extra))


def missing_server_modules() -> list[str]:
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None
            or (m == "sglang" and importlib.util.find_spec(m).origin is None)]


def require_server() -> None:
    """Skip the module without SGLang's server deps; in CI (``CI=true``) fail instead: CI installs
    them (.ci/run), so a missing one there is a broken install, not a reason to skip."""
    missing = missing_server_modules()
    if not missing:
        return
    why = (f"SGLang's HTTP server cannot start: {', '.join(missing)} not installed "
           "(tools/install_sglang.sh, then tools/install_sglang_server.sh)")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {why}", pytrace=False)
    pytest.skip(why, allow_module_level=True)
