"""Security hygiene (``hygiene_run``): file modes, symlinks not followed, the writer lock against a
second process, a store directory owned by another user."""

from __future__ import annotations

import os
import subprocess as _subprocess
import sys

from .backends import find_store_dirs, make_backend
from .host_pool import HostPool, page_key

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> the checkout


def _mode(path: str) -> int:
    return os.lstat(path).st_mode & 0o777


def hygiene_run(root: str, log=None) -> dict:
    """Permissions, symlinks, the writer lock and foreign ownership. Returns findings and checks."""
    import pwd

    from umbp_nvme.errors import UnsafeStorePathError

    findings: list[str] = []
    checks = 0
    # 1. modes under a permissive umask, for the configured root and a per-rank subdirectory
    old = os.umask(0o022)
    try:
        for tp_size in (1, 2):
            d = os.path.join(root, f"modes-tp{tp_size}", "hicache")
            pool = HostPool(16)
            be = make_backend(d, pool, tp_size=tp_size)
            pool.fill(0, page_key(0))
            be.batch_set_v1([page_key(0)], pool.indices(0, 1))
            for sd in [d] + find_store_dirs(d):
                checks += 1
                if _mode(sd) & 0o077:
                    findings.append(f"store directory {sd} has mode {oct(_mode(sd))} (want 0700; tp_size={tp_size})")
                for f in os.listdir(sd):
                    p = os.path.join(sd, f)
                    if os.path.isfile(p):
                        checks += 1
                        if _mode(p) & 0o077:
                            findings.append(f"store file {p} has mode {oct(_mode(p))} (want 0600)")
            be.close()
            pool.close()
    finally:
        os.umask(old)
    # 2. symlinks inside the store directory are not followed
    outside = os.path.join(root, "outside")
    os.makedirs(outside, exist_ok=True)
    for name in ("seg-00000.dat", "MANIFEST.json", "index.lmdb", "LOCK"):
        d = os.path.join(root, "sym-" + name.split(".")[0].lower())
        os.makedirs(d, mode=0o700)
        target = os.path.join(outside, name + ".target")
        with open(target, "wb") as f:
            f.write(b"precious")
        os.symlink(target, os.path.join(d, name))
        pool = HostPool(16)
        checks += 1
        try:
            be = make_backend(d, pool)
            pool.fill(0, page_key(1))
            be.batch_set_v1([page_key(1)], pool.indices(0, 1))
            be.close()
        except (UnsafeStorePathError, OSError):
            pass
        except Exception as e:  # noqa: BLE001
            findings.append(f"symlinked {name}: unexpected {type(e).__name__}: {e}")
        pool.close()
        with open(target, "rb") as f:
            if f.read() != b"precious":
                findings.append(f"a write followed the symlink {name} out of the store directory")
        if os.path.getsize(target) != 8:
            findings.append(f"{target} changed size through a symlinked {name}")
    # the store directory itself (a per-rank subdirectory) as a symlink
    real = os.path.join(outside, "realdir")
    os.makedirs(real, mode=0o700)
    d = os.path.join(root, "symroot")
    os.makedirs(d, mode=0o700)
    os.symlink(real, os.path.join(d, "tp1"))
    pool = HostPool(16)
    checks += 1
    try:
        make_backend(d, pool, tp_rank=1, tp_size=2).close()
        findings.append("a symlinked per-rank store directory was used")
    except UnsafeStorePathError:
        pass
    except Exception as e:  # noqa: BLE001
        findings.append(f"symlinked store directory: {type(e).__name__}: {e}")
    pool.close()
    if os.listdir(real):
        findings.append(f"files were created through a symlinked store directory: {os.listdir(real)}")
    # 3. the lock file keeps a second writer (another process) out, with a clear message
    d = os.path.join(root, "locked")
    pool = HostPool(16)
    be = make_backend(d, pool)
    checks += 1
    r = _subprocess.run(
        [sys.executable, "-c",
         "import sys; from support.backends import make_backend; from support.host_pool import HostPool\n"
         "try:\n make_backend(sys.argv[1], HostPool(16)); print('OPENED')\n"
         "except Exception as e: print(type(e).__name__, e)", d],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, UMBP_NVME_NO_SGLANG="1", PYTHONPATH=os.pathsep.join((_REPO, os.path.join(_REPO, "tests")))),
    )
    msg = r.stdout.strip()
    if not msg.startswith("StoreLockedError") or str(os.getpid()) not in msg:
        findings.append(f"second writer: {msg[:200] or r.stderr[-200:]}")
    be.close()
    pool.close()
    # 4. a store directory owned by another user is refused with a clear message
    d = os.path.join(root, "foreign")
    os.makedirs(d, mode=0o700)
    checks += 1
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
        os.chown(d, nobody, nobody)
    except (KeyError, PermissionError) as e:
        findings.append(f"(skipped foreign-owner check: {e})")
    else:
        pool = HostPool(16)
        try:
            make_backend(d, pool).close()
            findings.append("a store directory owned by another user was opened")
        except UnsafeStorePathError as e:
            if "owned by" not in str(e):
                findings.append(f"foreign owner message unclear: {e}")
        except Exception as e:  # noqa: BLE001
            findings.append(f"foreign owner: {type(e).__name__}: {e}")
        pool.close()
    out = dict(checks=checks, findings=findings)
    if log:
        log(f"  hygiene: {checks} checks, {len(findings)} findings")
    return out
