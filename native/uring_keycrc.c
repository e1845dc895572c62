/* crc32c_each: the CRC32C of each bytes object of a list, in one C pass.
 *
 * A put batch's index records carry the CRC of each key (index.key_crcs). In numpy that took a
 * join, a length per key, a cumsum and an address array before the one crc32c_many call: ~40-70 us
 * for 256 short keys, more than the CRCs themselves. Here each key is read in place. The GIL is
 * held throughout: the keys are a few hundred bytes each, and the list's items must stay alive.
 */
#include "uring_internal.h"

PyObject *mod_crc32c_each(PyObject *mod, PyObject *args) {
    PyObject *seq, *o_out;
    if (!PyArg_ParseTuple(args, "OO", &seq, &o_out)) return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_Format(PyExc_TypeError, "crc32c_each takes a list or tuple of bytes, got %.100s", Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Arr o;
    o.held = 0;
    if (arr_get(o_out, &o, "out", 4, "I", 1, 0) < 0) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (arr_len(&o) != n) {
        PyErr_Format(PyExc_ValueError, "out must hold one entry per item (%zd), got %zd", n, arr_len(&o));
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {  /* every item checked before any CRC is written */
        if (!PyBytes_CheckExact(items[i])) {
            PyErr_Format(PyExc_TypeError, "item %zd must be bytes, got %.100s", i, Py_TYPE(items[i])->tp_name);
            goto done;
        }
    }
    uint32_t *op = o.view.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        op[i] = umbp_crc32c(0, PyBytes_AS_STRING(items[i]), (size_t)PyBytes_GET_SIZE(items[i]), 0);
    ret = PyLong_FromSsize_t(n);
done:
    arr_release(&o);
    return ret;
}
