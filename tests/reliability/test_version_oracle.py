"""The version oracle itself (support/versions.py): it must tell every version apart and sort each
kind of mix-up into its own count, or the crash suite could pass on a store that serves them."""

from __future__ import annotations

import numpy as np

from support.host_pool import HostPool
from support.versions import (LOST, OK, RESURRECTED, STALE, WRONG, AckLog, Tally, VersionModel, fill_page, history,
                              page_versions, read_log, seal_after_kill, version_in, versioned)  # fmt: skip


def test_bytes_name_their_key_and_version():
    a, b = versioned("k", 1, 4096), versioned("k", 2, 4096)
    assert not np.array_equal(a[16:], b[16:])  # the body differs too, not only the header
    assert version_in("k", a) == 1 and version_in("k", b) == 2
    assert version_in("j", a) is None  # another key's bytes
    assert version_in("k", versioned("k", 1, 4096, comp=1)) is None  # another component's
    torn = a.copy()
    torn[2048:] = b[2048:]
    assert version_in("k", torn) is None
    assert version_in("k", np.zeros(4096, np.uint8)) is None


def test_pages_carry_one_version_per_component():
    pool = HostPool(page_num=2)
    try:
        fill_page(pool, 0, "p", 7)
        assert page_versions(pool, 0, "p") == [7, 7]
        assert page_versions(pool, 0, "q") == [None, None]
        pool.component_views(0)[1][:] = versioned("p", 6, pool.object_bytes, 1)
        assert page_versions(pool, 0, "p") == [7, 6]
    finally:
        pool.close()


def test_each_mix_up_has_its_verdict():
    m = VersionModel()
    m.begin_put("k", 1)
    m.put_acked("k", 1, wrote=True)
    m.begin_put("k", 2)
    m.put_acked("k", 2, wrote=True)
    assert [m.classify("k", [v]) for v in (2, 1, None)] == [OK, STALE, WRONG]
    assert m.classify("k", [2, 1]) == STALE  # a page mixing versions
    m.put_acked("k", 3, wrote=False)  # a dedup: the store kept 2
    assert m.classify("k", [2]) == OK and m.classify("k", [3]) == STALE
    m.begin_delete("k")
    m.delete_done("k")
    assert m.classify("k", [2]) == RESURRECTED and not m.must_exist("k")
    assert m.classify("never", [1]) == RESURRECTED  # a version nobody acknowledged


def test_a_kill_leaves_puts_and_deletes_in_doubt_until_the_next_ack():
    m = VersionModel()
    m.put_acked("a", 1, wrote=True)
    m.put_acked("b", 1, wrote=True)
    m.begin_put("a", 5)  # a was present: a dedup would keep 1, a write after a delete 5
    m.begin_delete("b")
    m.kill()
    assert m.allowed("a") == {1, 5} and m.must_exist("a")
    assert m.allowed("b") == {1} and not m.must_exist("b")  # its delete may have landed
    m.put_acked("a", 6, wrote=True)  # the next acknowledged write ends the doubt
    assert m.classify("a", [5]) == STALE and m.classify("a", [6]) == OK
    m.begin_clear()
    m.kill()
    assert not m.must_exist("a") and m.classify("a", [6]) == OK
    m.clear_done()
    assert m.classify("a", [6]) == RESURRECTED


def test_tally_counts_a_miss_as_lost_only_where_it_was_promised():
    m = VersionModel()
    m.put_acked("k", 1, wrote=True)
    t = Tally()
    assert t.check(m, "k", None, durable=False) == OK  # eviction may drop it
    assert t.check(m, "k", None, durable=True) == LOST
    assert t.check(m, "gone", None, durable=True) == OK
    assert t.check(m, "k", [1], durable=True) == OK
    assert t.figures() == dict(versions_checked=4, wrong_bytes=0, stale_served=0, resurrected=0, lost_acknowledged=1)


def test_the_ack_log_rebuilds_the_model_across_a_kill(tmp_path):
    p = str(tmp_path / "acks")
    log = AckLog(p)
    log.write(["?a 1", "?b 2", "+a 1", "+b 2", "="])
    log.write(["Db", "-b", "?b 3", "~a 4", "=", "r2", "Sa"])
    log.write(["?c 9"])
    log.close()
    with open(p, "a") as f:
        f.write("+c 9")  # torn: the kill cut this write
    seal_after_kill(p)
    st = read_log(p)
    m = st.model
    assert m.allowed("a") == {1} and m.must_exist("a")
    assert m.allowed("b") == {3} and not m.must_exist("b")  # deleted, then a put in flight
    assert m.allowed("c") == {9} and not m.must_exist("c")  # the torn ack does not count
    assert st.next_version == 10 and st.child.stale_served == 1 and st.child.versions_checked == 2
    assert open(p).read().endswith("?c 9\nk\n")


def test_a_mix_up_report_shows_the_keys_history(tmp_path):
    p = str(tmp_path / "acks")
    log = AckLog(p)
    log.write(["?k 1", "?j 2", "+k 1", "+j 2", "=", "Dk", "-k", "C", "c"])
    log.close()
    seal_after_kill(p)
    t = Tally()
    assert t.check(read_log(p).model, "k", [1], durable=True) == RESURRECTED and t.bad_keys == ["k"]
    assert history(p, "k") == ["?k 1", "+k 1", "Dk", "-k", "C", "c", "k"]
