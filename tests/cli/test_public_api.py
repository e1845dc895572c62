"""Issue 29: the package's top level is the API a newcomer imports, and importing it is free.

``import umbp_nvme`` must not import SGLang or torch (an SGLang image imports the package before
either is needed; the CLI starts through it), and every public method carries a docstring that
says what its bools mean and what raises.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
from conftest import ROOT

import umbp_nvme

ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _run(code: str, **env) -> str:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**ENV, **env})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_import_umbp_nvme_pulls_in_neither_sglang_nor_torch_nor_the_store():
    out = _run(
        "import sys, umbp_nvme\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'torch', 'numpy', 'lmdb'})\n"
        "print(heavy, 'umbp_nvme.store' in sys.modules)"
    )
    assert out == "[] False"


def test_the_top_level_names_are_the_classes_of_their_modules():
    from umbp_nvme import PageStore, StoreConfig, SyncPageStore, load_config
    from umbp_nvme.config import StoreConfig as C, load_config as L
    from umbp_nvme.store import PageStore as P
    from umbp_nvme.store.sync import SyncPageStore as S

    assert (PageStore, SyncPageStore, StoreConfig, load_config) == (P, S, C, L)


def test_every_name_in___all___resolves_and_an_unknown_name_is_an_attribute_error():
    for name in umbp_nvme.__all__:
        assert getattr(umbp_nvme, name) is not None, name
    assert set(umbp_nvme.__all__) <= set(dir(umbp_nvme))
    with pytest.raises(AttributeError, match="no attribute 'PageStor'"):
        umbp_nvme.PageStor  # noqa: B018


def test_the_sglang_backend_class_comes_on_first_use_only():
    out = _run(
        "import sys, umbp_nvme\n"
        "before = 'umbp_nvme.sglang.backend' in sys.modules\n"
        "cls = umbp_nvme.UMBPNvmeStore\n"
        "print(before, cls.__module__, cls.__name__)",
        UMBP_NVME_NO_SGLANG="1",
    )
    assert out == "False umbp_nvme.sglang.backend UMBPNvmeStore"


def test_the_module_path_sglang_configs_name_loads_the_backend_class():
    # SGLang's dynamic loader: import_module(module_path), then getattr(class_name)
    out = _run(
        "import importlib, umbp_nvme\n"
        "alias = importlib.import_module('umbp_nvme.sglang_backend')\n"
        "cls = getattr(alias, 'UMBPNvmeStore')\n"
        "print(cls is umbp_nvme.UMBPNvmeStore, cls.__module__, sorted(n for n in vars(alias) if not n.startswith('__')))",
        UMBP_NVME_NO_SGLANG="1",
    )
    assert out == "True umbp_nvme.sglang.backend ['UMBPNvmeStore']"


def test_the_key_scheme_imports_without_the_backend():
    out = _run(
        "import sys, umbp_nvme.sglang.keys\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'torch', 'lmdb'}),"
        " 'umbp_nvme.sglang.backend' in sys.modules, 'umbp_nvme.store' in sys.modules)"
    )
    assert out == "[] False False"


def _public_methods(cls):
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") and name not in ("__aenter__", "__enter__"):
            continue
        if callable(member) or isinstance(member, property):
            yield name, member


@pytest.mark.parametrize("cls_name", ["PageStore", "SyncPageStore"])
def test_every_public_method_has_a_docstring(cls_name):
    cls = getattr(umbp_nvme, cls_name)
    missing = [n for n, m in _public_methods(cls) if not (inspect.getdoc(m) or "").strip()]
    assert missing == []


@pytest.mark.parametrize("cls_name", ["PageStore", "SyncPageStore"])
@pytest.mark.parametrize("method", ["put_many", "get_many", "delete_many"])
def test_batch_calls_say_what_false_means_and_what_raises(cls_name, method):
    doc = inspect.getdoc(getattr(getattr(umbp_nvme, cls_name), method))
    assert "False" in doc and "Raises" in doc, doc
