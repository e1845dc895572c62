"""CRC32C: every implementation (table, SSE4.2 3-way, PCLMULQDQ and AVX-512 VPCLMULQDQ folding) against the
table reference and published vectors, over every length 0..4096 at random alignments, seeds and chaining, a
few large sizes, and the dispatch (crc32c_impl, UMBP_CRC32C_IMPL)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from umbp_nvme import _uring  # required: a missing extension fails here (build it: python setup.py build_ext --inplace)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMPLS = ("table", "sse42", "pclmul", "vpclmul256", "vpclmul")  # dispatch order, lowest first
CPU_FLAG = {
    "sse42": "sse4_2",
    "pclmul": "pclmulqdq",
    "vpclmul256": "avx2+vpclmulqdq",
    "vpclmul": "avx512f+avx512vl+vpclmulqdq",
}


def _need(impl: str) -> None:
    if impl not in _uring.crc32c_impls():
        pytest.skip(f"this CPU (or build) lacks {CPU_FLAG.get(impl, impl)}: crc32c impl '{impl}' not available")


def _reference(data: bytes, crc: int = 0) -> int:
    """Bitwise CRC32C, reflected polynomial 0x82F63B78: the definition, independent of the C tables."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def _table(data, seed=0):
    return _uring.crc32c(data, seed=seed, impl="table")


# RFC 3720 (iSCSI) appendix B.4 and the common check value.
ISCSI_READ_PDU = bytes.fromhex(
    "01c00000000000000000000000000000" "14000000000004000000001400000018" "28000000000000000200000000000000"
)
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (ISCSI_READ_PDU, 0xD9963A56),
]


@pytest.fixture(scope="module")
def blob():
    # 4 MiB + 64 KiB of random bytes; slices at any offset give unaligned starts
    return np.random.default_rng(20261201).integers(0, 256, (4 << 20) + (64 << 10), dtype=np.uint8)


def test_constants_header_matches_its_generator():
    gen = os.path.join(ROOT, "native", "gen_crc32c_consts.py")
    out = subprocess.run([sys.executable, gen], capture_output=True, text=True, check=True).stdout
    with open(os.path.join(ROOT, "native", "crc32c_consts.h")) as f:
        assert f.read() == out, "native/crc32c_consts.h is stale: python3 native/gen_crc32c_consts.py > it"


def test_table_matches_bitwise_definition():
    rng = np.random.default_rng(3)
    for n in list(range(0, 70)) + [255, 256, 1000, 4099]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        seed = int(rng.integers(0, 1 << 32))
        assert _table(data) == _reference(data), n
        assert _table(data, seed) == _reference(data, seed), n


def test_dispatch_picks_the_best_supported_and_reports_it():
    impls = _uring.crc32c_impls()
    assert impls[0] == "table" and list(impls) == [i for i in IMPLS if i in impls]
    # the test environment may cap it through UMBP_CRC32C_IMPL; without a cap it is the best one
    cap = os.environ.get("UMBP_CRC32C_IMPL")
    expected = impls[-1] if cap not in IMPLS else [i for i in impls if IMPLS.index(i) <= IMPLS.index(cap)][-1]
    assert _uring.crc32c_impl() == expected
    assert _uring.probe()["crc32c"] == expected
    if "sse42" in impls:
        assert _uring.CRC32C_HW and _uring.probe()["sse42"]


def test_unknown_or_unsupported_impl_is_rejected():
    with pytest.raises(ValueError, match="unknown crc32c implementation"):
        _uring.crc32c(b"abc", impl="avx9000")
    missing = [i for i in IMPLS if i not in _uring.crc32c_impls()]
    for impl in missing:
        with pytest.raises(ValueError, match="not supported"):
            _uring.crc32c(b"abc", impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_published_vectors(impl):
    _need(impl)
    for data, want in VECTORS:
        assert _uring.crc32c(data, impl=impl) == want, (impl, data[:16])
        assert _reference(data) == want


@pytest.mark.parametrize("impl", IMPLS)
def test_every_length_0_to_4096_at_random_alignment(impl, blob):
    _need(impl)
    rng = np.random.default_rng(IMPLS.index(impl))
    base = blob.ctypes.data
    for n in range(0, 4097):
        off = int(rng.integers(0, 64))
        seed = int(rng.integers(0, 1 << 32)) if n & 1 else 0
        got = _uring.crc32c((base + off, n) if n else (0, 0), seed=seed, impl=impl)
        want = _uring.crc32c((base + off, n) if n else (0, 0), seed=seed, impl="table")
        assert got == want, (impl, n, off, seed)


@pytest.mark.parametrize("impl", IMPLS)
def test_chaining_through_seed(impl, blob):
    _need(impl)
    rng = np.random.default_rng(100 + IMPLS.index(impl))
    base = blob.ctypes.data
    for _ in range(400):
        n = int(rng.integers(0, 20000))
        cut = int(rng.integers(0, n + 1))
        off = int(rng.integers(0, 64))
        seed = int(rng.integers(0, 1 << 32))
        whole = _uring.crc32c((base + off, n), seed=seed, impl=impl)
        a = _uring.crc32c((base + off, cut), seed=seed, impl=impl)
        assert _uring.crc32c((base + off + cut, n - cut), seed=a, impl=impl) == whole, (n, cut, off)
        assert whole == _uring.crc32c((base + off, n), seed=seed, impl="table")


@pytest.mark.parametrize("impl", IMPLS)
def test_large_sizes_with_odd_tails(impl, blob):
    _need(impl)
    base = blob.ctypes.data
    for n in (1 << 20, (1 << 20) + 17, (4 << 20) - 1, 4 << 20, (4 << 20) + 63, (4 << 20) + 4095, (4 << 20) + 12345):
        for off in (0, 1, 31, 63):
            got = _uring.crc32c((base + off, n), impl=impl)
            assert got == _uring.crc32c((base + off, n), impl="table"), (impl, n, off)
    # buffer protocol path (GIL released) agrees with the address path
    assert _uring.crc32c(blob, impl=impl) == _uring.crc32c((base, blob.nbytes), impl="table")


@pytest.mark.parametrize("impl", IMPLS)
def test_buffers_ending_at_a_guard_page_around_the_prefetch_window(impl):
    """The folding loops prefetch 8 KiB ahead only while that stays inside the buffer, and never load past
    its end: a buffer that ends right before a PROT_NONE page checksums to the table's value (a stray load
    would be a SIGSEGV) at every length around the window's edges and at unaligned starts."""
    import mmap

    _need(impl)
    page = mmap.PAGESIZE
    span = 64 << 10
    m = mmap.mmap(-1, span + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        arr = np.frombuffer(m, np.uint8)
        arr[:span] = np.random.default_rng(14).integers(0, 256, span, dtype=np.uint8)
        base = arr.ctypes.data
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        assert libc.mprotect(base + span, page, 0) == 0, os.strerror(ctypes.get_errno())
        end = base + span
        lengths = sorted({8192 + 256 + d for d in range(-300, 300, 7)} | {16384, 16384 + 255, 32768 + 1, span - 63})  # + lead <= span
        checked = 0
        for n in lengths:
            for lead in (0, 1, 63):
                got = _uring.crc32c((end - n - lead, n), impl=impl)
                assert got == _uring.crc32c((end - n - lead, n), impl="table"), (impl, n, lead)
                checked += 1
        assert checked == 3 * len(lengths)
    finally:
        del arr
        m.close()


def _ran_python_during(call) -> bool:
    """Whether this thread ran Python code while ``call`` ran in another thread.

    The switch interval is set far beyond the test, so the interpreter never takes the GIL from a
    thread: this thread runs only while the other one has let the GIL go. It then sees ``inside``
    only if the other thread let it go inside ``call`` (its release around the C loop), never from
    a forced switch between setting the flag and the call. No timing is asserted."""
    import sys
    import threading

    inside, done = [False], threading.Event()

    def work():
        inside[0] = True
        call()
        inside[0] = False
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        t = threading.Thread(target=work)
        t.start()
        saw = False
        while not done.is_set() and not saw:
            saw = inside[0]
            done.wait(0.001)  # lets the GIL go, so the other thread can start and reach the call
        t.join()
    finally:
        sys.setswitchinterval(old)
    return saw


@pytest.mark.parametrize("api", ["crc32c", "crc32c_many"])
def test_gil_released_during_a_long_checksum(api):
    # 64 MiB through the table path takes tens of ms: a checksum holding the GIL that long stalls every
    # other thread (SGLang's). One try can miss only if this thread was not scheduled during a whole
    # checksum; a checksum that keeps the GIL is never seen, however many tries.
    data = np.zeros(64 << 20, dtype=np.uint8)
    if api == "crc32c":
        def call():
            _uring.crc32c(data, impl="table")
    else:
        n = 32  # the dispatched implementation: 2 GiB, tens of ms even at memory speed
        addrs = np.full(n, data.ctypes.data, dtype=np.uint64)
        lens, out = np.full(n, data.nbytes, dtype=np.int64), np.zeros(n, dtype=np.uint32)

        def call():
            _uring.crc32c_many(addrs, lens, out)
    assert any(_ran_python_during(call) for _ in range(5)), "no Python ran in another thread during a checksum"


_CAPPED = textwrap.dedent(
    """
    import json, numpy as np
    from umbp_nvme import _uring
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    lengths = np.array([0, 1, 63, 64, 255, 256, 4096, 65537, 1 << 20, 3 << 20], dtype=np.int64)
    addrs = np.full(len(lengths), data.ctypes.data, dtype=np.uint64)
    addrs[0] = 0
    out = np.zeros(len(lengths), dtype=np.uint32)
    _uring.crc32c_many(addrs, lengths, out)
    print(json.dumps({"impl": _uring.crc32c_impl(), "probe": _uring.probe()["crc32c"], "out": out.tolist(),
                      "one": _uring.crc32c(data)}))
    """
)


def _run_capped(cap: str) -> dict:
    import json

    env = dict(os.environ, UMBP_CRC32C_IMPL=cap, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _CAPPED], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_env_var_caps_the_dispatch_and_every_cap_agrees():
    impls = _uring.crc32c_impls()
    results = {cap: _run_capped(cap) for cap in IMPLS + ("bogus",)}
    for cap in IMPLS:
        want = [i for i in impls if IMPLS.index(i) <= IMPLS.index(cap)][-1]  # a cap above the CPU: best there is
        assert results[cap]["impl"] == want == results[cap]["probe"], cap
    assert results["bogus"]["impl"] == impls[-1]  # an unknown name is ignored
    assert len({(tuple(r["out"]), r["one"]) for r in results.values()}) == 1
