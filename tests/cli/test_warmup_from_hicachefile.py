"""Warm-up from a directory written by SGLang's own HiCacheFile, then batch_get_v1 through UMBPNvmeStore.

Needs the sglang==0.5.23 wheel (tools/install_sglang.sh); skipped cleanly without it.
"""

from __future__ import annotations

import json
import warnings

import pytest
from support import sglang_env as se

NS = se.require_sglang()

import umbp_nvme.cli.main as cli  # noqa: E402


def _hicache_file(directory: str, *, is_mla: bool):
    cfg = NS.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=is_mla,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=se.MODEL, extra_config=None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return NS.HiCacheFile(cfg, file_path=directory)


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_warmup_from_real_hicachefile_dir_then_batch_get_v1_returns_the_same_bytes(tmp_path, capsys, monkeypatch, kind, layout):
    monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    pages = 24
    make_pool = se.mla_pool if kind == "mla" else se.mha_pool
    src = make_pool(layout, pages=64)
    idx = src.alloc_pages(pages)
    written = se.fill_random(src.host, idx, seed=7)
    hashes = se.page_hashes(pages)
    file_dir = str(tmp_path / "hicache")
    hf = _hicache_file(file_dir, is_mla=kind == "mla")
    # what SGLang's legacy controller path hands HiCacheFile: one flat data page per page hash
    P = src.page_size
    values = [src.host.get_data_page(int(idx[i * P]), flat=True) for i in range(pages)]
    assert hf.batch_set(hashes, values)

    root = str(tmp_path / "nvme")
    argv = ["warmup", "--store", root, "--model", se.MODEL, "--capacity", "64m",
            "--config", '{"ssd_segment_size_bytes": 4194304, "ssd_durability_mode": "relaxed"}', "--json", file_dir]
    if kind == "mla":
        argv.insert(1, "--mla")
    rc = cli.main(argv)
    s = json.loads(capsys.readouterr().out)
    per_page = 1 if kind == "mla" else 2
    assert rc == 0, s
    assert s["imported"] == pages * per_page and s["failed"] == 0 and s["refused_files"] == 0

    dst = make_pool(layout, pages=64)
    backend = se.load_backend(se.storage_config(root, is_mla=kind == "mla", layout=layout), dst.host)
    try:
        assert backend.batch_exists(hashes) == pages
        didx = dst.alloc_pages(pages)
        se.zero_pages(dst.host, didx)
        assert backend.batch_get_v1(hashes, didx) == [True] * pages
        assert se.read_pages(dst.host, didx) == written
    finally:
        backend.close()
