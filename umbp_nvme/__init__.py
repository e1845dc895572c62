"""umbp_nvme: an asyncio key -> object store for LLM KV-cache pages on local NVMe."""

import importlib
import importlib.abc
import importlib.util
import sys

# Modules that moved into umbp_nvme.store keep their old import paths: ``umbp_nvme.index`` is the
# very module object ``umbp_nvme.store.index`` (so monkeypatching either name patches both). A
# finder instead of shim files, so git sees the moves as renames and merges edits across them.
_MOVED = {
    "umbp_nvme.index": "umbp_nvme.store.index",
    "umbp_nvme.segments": "umbp_nvme.store.segments",
    "umbp_nvme.sync_store": "umbp_nvme.store.sync",
}


_OWN: dict = {}  # alias -> the moved module's own (spec, loader), between create and exec


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        _OWN[spec.name] = module.__spec__, module.__loader__
        return module

    def exec_module(self, module):
        # the import system stamped the alias's spec on the module: give it its own back
        module.__spec__, module.__loader__ = _OWN.pop(module.__spec__.name)


sys.meta_path.insert(0, _MovedModules())
