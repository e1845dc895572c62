"""Old import path: ``umbp_nvme.index`` is ``umbp_nvme.store.index`` (the same module object, so
monkeypatching either name patches both)."""

import sys

from .store import index as _module

sys.modules[__name__] = _module
