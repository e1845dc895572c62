"""The doctor's ``page_hash`` item: SGLang's page-hash extension built where the server will look
(TORCH_EXTENSIONS_DIR, else torch's default), or a warning with the command that builds it."""

from __future__ import annotations

import sys

from umbp_nvme.doctor.page_hash import EXTENSION, check_page_hash, extension_dirs


def _built(root):
    d = root / EXTENSION
    d.mkdir(parents=True)
    (d / f"{EXTENSION}.so").write_bytes(b"\x7fELF")
    return d


def test_built_in_torch_extensions_dir_is_ok(tmp_path):
    d = _built(tmp_path)
    findings = []
    item = check_page_hash(findings, {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, sglang_present=True)
    assert item["built"] is True and findings[0]["level"] == "ok" and str(d) in findings[0]["message"]


def test_not_built_warns_and_says_how_to_build_it_before_the_start(tmp_path):
    (tmp_path / EXTENSION).mkdir()  # a build directory without the library: an interrupted build
    findings = []
    item = check_page_hash(findings, {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, sglang_present=True)
    (f,) = findings
    assert item["built"] is False and f["level"] == "warn" and str(tmp_path / EXTENSION) in f["message"]
    assert "TORCH_EXTENSIONS_DIR" in f["fix"] and "get_hash_str" in f["fix"]


def test_default_root_is_torchs_cache_per_python_and_accelerator(tmp_path):
    pyver = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert extension_dirs(env) == [str(tmp_path / "torch_extensions" / f"{pyver}_<accelerator>" / EXTENSION)]
    _built(tmp_path / "torch_extensions" / f"{pyver}_cpu")
    findings = []
    assert check_page_hash(findings, env, sglang_present=True)["built"] is True


def test_without_sglang_it_is_only_information(tmp_path):
    findings = []
    check_page_hash(findings, {"TORCH_EXTENSIONS_DIR": str(tmp_path)}, sglang_present=False)
    assert findings[0]["level"] == "info" and "not installed" in findings[0]["message"]
