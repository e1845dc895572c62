/* pairs_into: a batch's (address, nbytes) buffers as two int64 arrays, in one C pass.
 *
 * The SGLang backend hands every put and get 256+ such tuples; numpy's np.array over them costs
 * ~1 us per tuple (it discovers the nested shape and type item by item). Only the plainest form is
 * taken here: a list or tuple of exact 2-tuples of exact ints (never bools, which are ints in
 * Python) that fit int64. Anything else answers False with the outputs unspecified, and the
 * caller takes its general path, which checks and explains each buffer. No policy here: the
 * range checks against registered memory stay in umbp_nvme/store/memory.py.
 */
#include "uring_internal.h"

PyObject *mod_pairs_into(PyObject *mod, PyObject *args) {
    PyObject *seq, *o_a, *o_n;
    if (!PyArg_ParseTuple(args, "OOO", &seq, &o_a, &o_n)) return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_FALSE;
    Arr a, n;
    a.held = n.held = 0;
    PyObject *ret = NULL;
    if (arr_get(o_a, &a, "addrs", 8, "lq", 1, 0) < 0 || arr_get(o_n, &n, "nbytes", 8, "lq", 1, 0) < 0) goto done;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (arr_len(&a) != len || arr_len(&n) != len) {
        PyErr_Format(PyExc_ValueError, "addrs and nbytes must hold one entry per buffer (%zd), got %zd and %zd", len,
                     arr_len(&a), arr_len(&n));
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t *ap = a.view.buf, *np_ = n.view.buf;
    ret = Py_True;
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *t = items[i];
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2) {
            ret = Py_False;
            break;
        }
        PyObject *x = PyTuple_GET_ITEM(t, 0), *y = PyTuple_GET_ITEM(t, 1);
        if (!PyLong_CheckExact(x) || !PyLong_CheckExact(y)) {
            ret = Py_False;
            break;
        }
        int ox = 0, oy = 0;
        long long vx = PyLong_AsLongLongAndOverflow(x, &ox), vy = PyLong_AsLongLongAndOverflow(y, &oy);
        if (ox || oy) {
            ret = Py_False;
            break;
        }
        ap[i] = vx;
        np_[i] = vy;
    }
    Py_INCREF(ret);
done:
    arr_release(&a);
    arr_release(&n);
    return ret;
}
