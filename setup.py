# The C extension is declared here because setup.cfg cannot carry compiler flags portably.
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "umbp_nvme._uring",
            sources=["native/uring.c", "native/crc32c.c"],
            depends=["native/uring.h", "native/crc32c.h", "native/crc32c_consts.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
