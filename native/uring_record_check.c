/* records_name: whether each segment record names its row's object and the caller's key, in one pass.
 *
 * A writer keeps a 64-bit hash per key, not the key (store/keymap.py); a get's hit is confirmed by
 * the record beside the data (store/row_keys.py). In numpy that comparison encoded every key into
 * a fixed-width array and compared seven fields: ~150-250 us for 256 keys. Here each key is read
 * in place. The layout is records.RECORD_DTYPE's (256 bytes; tests/store/test_records_native.py
 * checks the offsets against it). GIL held: the keys must stay alive.
 */
#include "uring_internal.h"

#define REC_BYTES 256
#define REC_MAGIC_AT 4
#define REC_FLAGS_AT 6
#define REC_SEGMENT_AT 8
#define REC_OFFSET_AT 16
#define REC_GENERATION_AT 24
#define REC_KEY_LEN_AT 44
#define REC_KEY_AT 48
#define REC_KEY_INLINE 208
#define REC_MAGIC 0x5552
#define REC_VALID 1

static uint64_t rd(const unsigned char *p, int n) {
    uint64_t v = 0;
    memcpy(&v, p, n); /* little-endian fields on a little-endian host (x86-64, aarch64) */
    return v;
}

/* records_name(recs, keys, segs, offs, gens, out) -> undecided.
 * recs: m records back to back (bytes-like, m * 256 bytes); keys: list of m (str, bytes or
 * anything else: not a key); segs, offs, gens: 8-byte integer arrays of m, what the row says.
 * out (uint8, m): 1 the record is valid, names that segment, offset and generation and holds
 * exactly that key; 0 it does not; 2 undecided (a str that is not ASCII: the caller encodes it). */
PyObject *mod_records_name(PyObject *mod, PyObject *args) {
    PyObject *o_recs, *keys, *o_segs, *o_offs, *o_gens, *o_out;
    if (!PyArg_ParseTuple(args, "OOOOOO", &o_recs, &keys, &o_segs, &o_offs, &o_gens, &o_out)) return NULL;
    if (!PyList_CheckExact(keys)) {
        PyErr_Format(PyExc_TypeError, "keys must be a list, got %.100s", Py_TYPE(keys)->tp_name);
        return NULL;
    }
    Arr recs, segs, offs, gens, out;
    recs.held = segs.held = offs.held = gens.held = out.held = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(o_recs, &recs.view, PyBUF_C_CONTIGUOUS) < 0) goto done; /* any record dtype: its bytes */
    recs.held = 1;
    if (arr_get(o_segs, &segs, "segs", 8, "qlQL", 0, 0) < 0 || arr_get(o_offs, &offs, "offs", 8, "qlQL", 0, 0) < 0 ||
        arr_get(o_gens, &gens, "gens", 8, "qlQL", 0, 0) < 0 || arr_get(o_out, &out, "out", 1, "B?", 1, 0) < 0)
        goto done;
    Py_ssize_t m = PyList_GET_SIZE(keys);
    if (recs.view.len != m * REC_BYTES || arr_len(&segs) != m || arr_len(&offs) != m || arr_len(&gens) != m ||
        arr_len(&out) != m) {
        PyErr_Format(PyExc_ValueError,
                     "records_name: %zd keys need %zd record bytes and %zd entries per array; got %zd bytes, "
                     "segs %zd, offs %zd, gens %zd, out %zd",
                     m, m * REC_BYTES, m, recs.view.len, arr_len(&segs), arr_len(&offs), arr_len(&gens), arr_len(&out));
        goto done;
    }
    const unsigned char *base = recs.view.buf;
    const uint64_t *sg = segs.view.buf, *of = offs.view.buf, *ge = gens.view.buf;
    uint8_t *o = out.view.buf;
    Py_ssize_t undecided = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        const unsigned char *r = base + i * REC_BYTES;
        PyObject *k = PyList_GET_ITEM(keys, i);
        const char *kd = NULL;
        Py_ssize_t kl = 0;
        if (PyUnicode_CheckExact(k)) {
            if (!PyUnicode_IS_ASCII(k)) {
                o[i] = 2;
                undecided++;
                continue;
            }
            kd = (const char *)PyUnicode_1BYTE_DATA(k);
            kl = PyUnicode_GET_LENGTH(k);
        } else if (PyBytes_CheckExact(k)) {
            kd = PyBytes_AS_STRING(k);
            kl = PyBytes_GET_SIZE(k);
        }
        o[i] = kd != NULL && kl > 0 && kl <= REC_KEY_INLINE && rd(r + REC_MAGIC_AT, 2) == REC_MAGIC &&
               (rd(r + REC_FLAGS_AT, 2) & REC_VALID) && rd(r + REC_SEGMENT_AT, 4) == sg[i] &&
               rd(r + REC_OFFSET_AT, 8) == of[i] && rd(r + REC_GENERATION_AT, 8) == ge[i] &&
               rd(r + REC_KEY_LEN_AT, 2) == (uint64_t)kl && memcmp(r + REC_KEY_AT, kd, (size_t)kl) == 0;
    }
    ret = PyLong_FromSsize_t(undecided);
done:
    arr_release(&recs);
    arr_release(&segs);
    arr_release(&offs);
    arr_release(&gens);
    arr_release(&out);
    return ret;
}
