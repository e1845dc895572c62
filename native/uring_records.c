/* put_records: a put batch's index records, in one C pass.
 *
 * Each object of a put batch needs three records: its 48-byte LMDB value (store/index.py
 * REC_DTYPE), its sealed 256-byte record in the segment's record area (store/records.py
 * RECORD_DTYPE) and, for strict mode, that record as it reads once its data is synced (flag
 * CONFIRMED, sealed again). In numpy these took ~25 field passes, a fixed-width bytes array of
 * the keys and two CRC passes per batch: ~250 us for 256 objects. Here one loop writes all three.
 * The layouts are fixed here and checked against the numpy dtypes by tests/store/test_put_records.py.
 * Every input is checked before any output byte is written; the GIL is held (the keys are list items).
 */
#include "uring_internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "put_records writes the little-endian record layouts with host-order stores"
#endif

#define REC48 48
#define REC256 256
#define KEY_INLINE 208
#define R_VALID 1
#define R_CONFIRMED 2
#define R_KEY_TRUNC 4
#define RECORD_MAGIC 0x5552
#define FLAG_CRC_KEYCRC 3 /* index.FLAG_CRC | index.FLAG_KEYCRC */

static inline void put16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

static int want_len(const Arr *a, const char *name, Py_ssize_t n) {
    if (arr_len(a) != n) {
        PyErr_Format(PyExc_ValueError, "%s must hold %zd entries, got %zd", name, n, arr_len(a));
        return -1;
    }
    return 0;
}

/* put_records(keys, segs int64[], offs int64[], lens int64[], depths int32[], crcs uint32[], generation,
 *             out48 uint8[n*48], out256 uint8[n*256], conf256 uint8[n*256] | None) -> n */
PyObject *mod_put_records(PyObject *mod, PyObject *args) {
    PyObject *keys, *o_seg, *o_off, *o_len, *o_dep, *o_crc, *o_gen, *o_48, *o_256, *o_conf;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOO", &keys, &o_seg, &o_off, &o_len, &o_dep, &o_crc, &o_gen, &o_48, &o_256,
                          &o_conf))
        return NULL;
    if (!PyLong_Check(o_gen)) {
        PyErr_Format(PyExc_TypeError, "generation must be an int, got %.100s", Py_TYPE(o_gen)->tp_name);
        return NULL;
    }
    unsigned long long gen = PyLong_AsUnsignedLongLong(o_gen); /* OverflowError when negative or over 64 bits */
    if (gen == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(keys)) {
        PyErr_Format(PyExc_TypeError, "put_records takes a list of bytes keys, got %.100s", Py_TYPE(keys)->tp_name);
        return NULL;
    }
    Arr seg, off, len, dep, crc, r48, r256, conf;
    seg.held = off.held = len.held = dep.held = crc.held = r48.held = r256.held = conf.held = 0;
    PyObject *ret = NULL;
    if (arr_get(o_seg, &seg, "segs", 8, "qlQL", 0, 0) < 0 || arr_get(o_off, &off, "offs", 8, "qlQL", 0, 0) < 0 ||
        arr_get(o_len, &len, "lens", 8, "qlQL", 0, 0) < 0 || arr_get(o_dep, &dep, "depths", 4, "i", 0, 0) < 0 ||
        arr_get(o_crc, &crc, "crcs", 4, "I", 0, 0) < 0 || arr_get(o_48, &r48, "out48", 1, "B", 1, 0) < 0 ||
        arr_get(o_256, &r256, "out256", 1, "B", 1, 0) < 0 || arr_get(o_conf, &conf, "conf256", 1, "B", 1, 1) < 0)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (want_len(&seg, "segs", n) < 0 || want_len(&off, "offs", n) < 0 || want_len(&len, "lens", n) < 0 ||
        want_len(&dep, "depths", n) < 0 || want_len(&crc, "crcs", n) < 0 || want_len(&r48, "out48 (bytes)", n * REC48) < 0 ||
        want_len(&r256, "out256 (bytes)", n * REC256) < 0 ||
        (conf.held && want_len(&conf, "conf256 (bytes)", n * REC256) < 0))
        goto done;
    const int64_t *sp = seg.view.buf, *op = off.view.buf, *lp = len.view.buf;
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++) { /* everything checked before any record is written */
        if (!PyBytes_CheckExact(items[i])) {
            PyErr_Format(PyExc_TypeError, "key %zd must be bytes, got %.100s", i, Py_TYPE(items[i])->tp_name);
            goto done;
        }
        if (PyBytes_GET_SIZE(items[i]) == 0) {
            PyErr_Format(PyExc_ValueError, "key %zd is empty", i);
            goto done;
        }
        if (sp[i] < 0 || sp[i] > (int64_t)UINT32_MAX || lp[i] < 1 || lp[i] > (int64_t)UINT32_MAX || op[i] < 0) {
            PyErr_Format(PyExc_ValueError, "object %zd: segment %lld, length %lld, offset %lld out of range", i,
                         (long long)sp[i], (long long)lp[i], (long long)op[i]);
            goto done;
        }
    }
    const int32_t *dp = dep.view.buf;
    const uint32_t *cp = crc.view.buf;
    unsigned char *a = r48.view.buf, *b = r256.view.buf, *c = conf.held ? conf.view.buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const char *k = PyBytes_AS_STRING(items[i]);
        size_t klen = (size_t)PyBytes_GET_SIZE(items[i]);
        uint32_t kcrc = umbp_crc32c(0, k, klen, 0);
        unsigned char *x = a + i * REC48;
        put32(x, (uint32_t)sp[i]);
        put32(x + 4, (uint32_t)lp[i]);
        put64(x + 8, (uint64_t)op[i]);
        put64(x + 16, gen);
        put64(x + 24, gen); /* group: the put batch */
        put32(x + 32, cp[i]);
        put32(x + 36, (uint32_t)dp[i]);
        put32(x + 40, FLAG_CRC_KEYCRC);
        put32(x + 44, kcrc);
        unsigned char *r = b + i * REC256;
        size_t inl = klen > KEY_INLINE ? KEY_INLINE : klen;
        uint16_t flags = R_VALID | (klen > KEY_INLINE ? R_KEY_TRUNC : 0);
        put16(r + 4, RECORD_MAGIC);
        put16(r + 6, flags);
        put32(r + 8, (uint32_t)sp[i]);
        put32(r + 12, (uint32_t)lp[i]);
        put64(r + 16, (uint64_t)op[i]);
        put64(r + 24, gen);
        put32(r + 32, cp[i]);
        put32(r + 36, kcrc);
        put32(r + 40, (uint32_t)dp[i]);
        put16(r + 44, (uint16_t)(klen > 0xFFFF ? 0xFFFF : klen));
        put16(r + 46, 0);
        memcpy(r + 48, k, inl);
        memset(r + 48 + inl, 0, KEY_INLINE - inl);
        put32(r, umbp_crc32c(0, r + 4, REC256 - 4, 0));
        if (c) {
            unsigned char *q = c + i * REC256;
            memcpy(q, r, REC256);
            put16(q + 6, flags | R_CONFIRMED);
            put32(q, umbp_crc32c(0, q + 4, REC256 - 4, 0));
        }
    }
    ret = PyLong_FromSsize_t(n);
done:
    arr_release(&seg);
    arr_release(&off);
    arr_release(&len);
    arr_release(&dep);
    arr_release(&crc);
    arr_release(&r48);
    arr_release(&r256);
    arr_release(&conf);
    return ret;
}

/* place_records(area uint8[], slots int64[m], recs uint8[m*256], confirm, blocks_out int64[>= m]) -> k
 *
 * Copies record i into slot slots[i] of a segment's record area (record_areas.RecordAreas) and writes
 * the distinct 4 KiB blocks touched, ascending, to blocks_out[:k]. confirm=0 (a put batch's
 * records): every slot must lie in the area, checked before any copy. confirm=1 (confirmed
 * copies placed after their sync): a slot outside the area, or one that holds another generation
 * or is not valid-and-unconfirmed any more (cleared or reused since), is skipped. */
#define PER_BLOCK 16

PyObject *mod_place_records(PyObject *mod, PyObject *args) {
    PyObject *o_area, *o_slots, *o_recs, *o_out;
    int confirm;
    if (!PyArg_ParseTuple(args, "OOOpO", &o_area, &o_slots, &o_recs, &confirm, &o_out)) return NULL;
    Arr area, slots, recs, out;
    area.held = slots.held = recs.held = out.held = 0;
    PyObject *ret = NULL;
    unsigned char *mark = NULL;
    if (arr_get(o_area, &area, "area", 1, "B", 1, 0) < 0 || arr_get(o_slots, &slots, "slots", 8, "qlQL", 0, 0) < 0 ||
        arr_get(o_recs, &recs, "recs", 1, "B", 0, 0) < 0 || arr_get(o_out, &out, "blocks_out", 8, "ql", 1, 0) < 0)
        goto done;
    Py_ssize_t m = arr_len(&slots), n_slots = arr_len(&area) / REC256;
    if (arr_len(&area) % REC256) {
        PyErr_Format(PyExc_ValueError, "area must be whole %d-byte records, got %zd bytes", REC256, arr_len(&area));
        goto done;
    }
    if (want_len(&recs, "recs (bytes)", m * REC256) < 0) goto done;
    if (arr_len(&out) < m) {
        PyErr_Format(PyExc_ValueError, "blocks_out must hold at least %zd entries, got %zd", m, arr_len(&out));
        goto done;
    }
    const int64_t *sp = slots.view.buf;
    if (!confirm) {
        for (Py_ssize_t i = 0; i < m; i++) {
            if (sp[i] < 0 || sp[i] >= n_slots) {
                PyErr_Format(PyExc_ValueError, "slot %lld of record %zd is outside the area's %zd slots",
                             (long long)sp[i], i, n_slots);
                goto done;
            }
        }
    }
    Py_ssize_t n_blocks = (n_slots + PER_BLOCK - 1) / PER_BLOCK;
    mark = PyMem_Calloc((size_t)n_blocks + 1, 1);
    if (!mark) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *ap = area.view.buf;
    const unsigned char *rp = recs.view.buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t s = sp[i];
        if (s < 0 || s >= n_slots) continue; /* confirm mode only: checked above otherwise */
        unsigned char *dst = ap + s * REC256;
        const unsigned char *src = rp + i * REC256;
        if (confirm) {
            uint16_t have;
            memcpy(&have, dst + 6, 2);
            if (memcmp(dst + 24, src + 24, 8) != 0 || (have & (R_VALID | R_CONFIRMED)) != R_VALID) continue;
        }
        memcpy(dst, src, REC256);
        mark[s / PER_BLOCK] = 1;
    }
    int64_t *op = out.view.buf;
    Py_ssize_t k = 0;
    for (Py_ssize_t blk = 0; blk < n_blocks; blk++)
        if (mark[blk]) op[k++] = blk;
    ret = PyLong_FromSsize_t(k);
done:
    PyMem_Free(mark);
    arr_release(&area);
    arr_release(&slots);
    arr_release(&recs);
    arr_release(&out);
    return ret;
}

/* area_images(area uint8[] | None, blocks int64[k], out uint8[k*4096]) -> k
 *
 * The 4 KiB disk image of each record block of a segment's area: block b holds the area's records
 * 16b..16b+15; a block past the area's end (or of no area) is zeros, a partial last one
 * zero-padded. Replaces a numpy gather, a mask and a per-partial-block step per write. */
#define BLOCK_BYTES 4096

PyObject *mod_area_images(PyObject *mod, PyObject *args) {
    PyObject *o_area, *o_blocks, *o_out;
    if (!PyArg_ParseTuple(args, "OOO", &o_area, &o_blocks, &o_out)) return NULL;
    Arr area, blocks, out;
    area.held = blocks.held = out.held = 0;
    PyObject *ret = NULL;
    if (arr_get(o_area, &area, "area", 1, "B", 0, 1) < 0 || arr_get(o_blocks, &blocks, "blocks", 8, "qlQL", 0, 0) < 0 ||
        arr_get(o_out, &out, "out", 1, "B", 1, 0) < 0)
        goto done;
    Py_ssize_t k = arr_len(&blocks), have = area.held ? arr_len(&area) : 0;
    if (want_len(&out, "out (bytes)", k * BLOCK_BYTES) < 0) goto done;
    const int64_t *bp = blocks.view.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (bp[i] < 0 || bp[i] > PY_SSIZE_T_MAX / BLOCK_BYTES) {
            PyErr_Format(PyExc_ValueError, "block %lld out of range", (long long)bp[i]);
            goto done;
        }
    }
    const unsigned char *ap = area.held ? area.view.buf : NULL;
    unsigned char *op = out.view.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t start = (Py_ssize_t)bp[i] * BLOCK_BYTES, n = 0;
        if (start < have) n = have - start < BLOCK_BYTES ? have - start : BLOCK_BYTES;
        if (n) memcpy(op + i * BLOCK_BYTES, ap + start, (size_t)n);
        memset(op + i * BLOCK_BYTES + n, 0, (size_t)(BLOCK_BYTES - n));
    }
    ret = PyLong_FromSsize_t(k);
done:
    arr_release(&area);
    arr_release(&blocks);
    arr_release(&out);
    return ret;
}
