"""Placeholders that import fine and fail loudly when used."""

import enum
import importlib.abc
import importlib.machinery
import types


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Inert:
    """Stands for any torchvision attribute; calling it raises."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._qualname} was called, but torchvision here is the inert test "
            "shim from umbp_nvme/bench/sglang_shims (no image transforms in KV-cache tests)"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<inert torchvision shim {self._qualname}>"


def make_module_getattr(module_name: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return _Inert(f"{module_name}.{name}")

    return __getattr__


class ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Synthesises any ``torchvision.<sub>`` submodule as an inert package."""

    def __init__(self, root: str):
        self._prefix = root + "."

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self._prefix):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = make_module_getattr(spec.name)
        return module

    def exec_module(self, module):
        return None
