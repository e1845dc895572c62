"""Old import path: ``umbp_nvme.sync_store`` is ``umbp_nvme.store.sync`` (the same module object, so
monkeypatching either name patches both)."""

import sys

from .store import sync as _module

sys.modules[__name__] = _module
