"""The real-server test's gate (tests/support/real_server.py): without the server's dependencies it
skips with the reason, except in CI (``CI=true``), where the install is part of the run and a
missing one fails. And the README's launch command is read from the README itself."""

from __future__ import annotations

import json

import pytest

from support import real_server as R


def test_missing_dependency_skips_with_the_install_command(monkeypatch):
    monkeypatch.setattr(R, "SERVER_MODULES", ("json", "no_such_module_umbp_39"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_module_umbp_39 not installed.*install_sglang_server.sh"):
        R.require_server()


def test_missing_dependency_fails_in_ci(monkeypatch):
    monkeypatch.setattr(R, "SERVER_MODULES", ("no_such_module_umbp_39",))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true.*no_such_module_umbp_39"):
        R.require_server()


def test_nothing_missing_passes_the_gate(monkeypatch):
    monkeypatch.setattr(R, "SERVER_MODULES", ("json",))
    monkeypatch.setenv("CI", "true")
    R.require_server()


def test_readme_command_is_parsed_with_its_extra_config_as_one_argument(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("text\n```sh\npython -m sglang.launch_server --model-path M --page-size 64 \\\n"
                      "  --hicache-storage-backend-extra-config '{\"a\": 1,\n \"ssd_storage_dir\": \"/x\"}' \\\n"
                      "  --enable-metrics\n```\n")
    args = R.readme_launch_args(str(readme))
    assert args[:4] == ["--model-path", "M", "--page-size", "64"] and args[-1] == "--enable-metrics"
    assert json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1]) == {"a": 1, "ssd_storage_dir": "/x"}
    readme.write_text("no command here\n")
    with pytest.raises(AssertionError, match="expected one"):
        R.readme_launch_args(str(readme))
