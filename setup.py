# The C extension is declared here because setup.cfg cannot carry compiler flags portably.
import glob
import os
import shlex
import shutil
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py


class BuildExt(build_ext):
    """Say in one line what to install when the compiler or the Python headers are missing
    (setuptools would fail deep inside with `No such file or directory: 'gcc'`)."""

    def run(self):
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "gcc")[0]
        headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        missing = [f"a C compiler ({cc} is not on PATH)"] if shutil.which(cc) is None else []
        if not os.path.exists(headers):
            missing.append(f"the Python headers ({headers} is missing)")
        if missing:
            raise SystemExit(
                f"umbp_nvme: building its C extension needs {' and '.join(missing)}: on Debian/Ubuntu "
                f"`apt-get install gcc python{sys.version_info[0]}.{sys.version_info[1]}-dev`, or install a prebuilt "
                "wheel instead (`make wheel` on a machine that has them, then `pip install --find-links dist umbp_nvme`)"
            )
        super().run()


class BuildPy(build_py):
    """Ship docs/ inside the package (umbp_nvme/docs), so an installed package has the docs
    its `--help` names, and the changelog beside them (LICENSE goes in as license_files)."""

    def run(self):
        super().run()
        here = os.path.dirname(os.path.abspath(__file__))
        out = os.path.join(self.build_lib, "umbp_nvme", "docs")
        os.makedirs(out, exist_ok=True)
        docs = glob.glob(os.path.join(here, "docs", "*.md")) + glob.glob(os.path.join(here, "docs", "*.png"))
        for f in docs + [os.path.join(here, "CHANGELOG.md")]:
            shutil.copy2(f, out)


setup(
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    ext_modules=[
        Extension(
            "umbp_nvme._uring",
            # one file per ring step, as liburing is split (native/uring_module.c says which holds what)
            sources=[
                "native/uring_module.c",
                "native/uring_setup.c",
                "native/uring_submit.c",
                "native/uring_reap.c",
                "native/uring_cancel.c",
                "native/uring_register.c",
                "native/uring_probe.c",
                "native/uring_arrays.c",
                "native/uring_pairs.c",
                "native/uring_keycrc.c",
                "native/uring_records.c",
                "native/uring_record_check.c",
                "native/crc32c_module.c",
                "native/crc32c.c",
            ],
            depends=["native/uring.h", "native/uring_internal.h", "native/crc32c.h", "native/crc32c_consts.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
        Extension(
            "umbp_nvme._keyindex",  # the writer's key -> row table (store/keymap.py)
            sources=["native/keyindex.c", "native/hashset.c"],
            depends=["native/keyhash.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
        Extension(
            "umbp_nvme._lmdbwalk",  # the index file's page walk before LMDB maps it (store/index_check.py)
            sources=["native/lmdbwalk.c", "native/crc32c.c"],  # crc32c: a hashed capture's key checksums
            depends=["native/keyhash.h", "native/crc32c.h", "native/crc32c_consts.h", "native/uring.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ],
)
