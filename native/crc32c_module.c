/* The Python face of CRC32C (crc32c.c): one buffer, a batch of ranges, the implementations. */
#include "uring_internal.h"

#define CRC_GIL_RELEASE_BYTES 8192

PyObject *mod_crc32c(PyObject *mod, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"data", "seed", "force_table", "impl", NULL};
    PyObject *data;
    unsigned long long seed = 0;
    int force_table = 0;
    const char *impl_name = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|Kpz", kwlist, &data, &seed, &force_table, &impl_name))
        return NULL;
    if (seed > 0xffffffffULL) {
        PyErr_Format(PyExc_ValueError, "seed must be a 32-bit CRC, got %llu", seed);
        return NULL;
    }
    int impl = force_table ? UMBP_CRC32C_TABLE : umbp_crc32c_impl();
    if (impl_name && !force_table) {
        impl = umbp_crc32c_impl_index(impl_name);
        if (impl < 0) {
            PyErr_Format(PyExc_ValueError,
                         "unknown crc32c implementation '%s' (table, sse42, pclmul, vpclmul256, vpclmul)", impl_name);
            return NULL;
        }
        if (!umbp_crc32c_impl_supported(impl)) {
            PyErr_Format(PyExc_ValueError, "crc32c implementation '%s' is not supported on this CPU/build", impl_name);
            return NULL;
        }
    }
    const void *p;
    size_t n;
    Py_buffer view;
    int held = 0;
    if (PyTuple_Check(data)) {
        unsigned long long addr;
        long long len;
        if (!PyArg_ParseTuple(data, "KL;crc32c takes a buffer or an (address, nbytes) pair", &addr, &len)) return NULL;
        if (len < 0 || (len > 0 && addr == 0)) {
            PyErr_Format(PyExc_ValueError, "(address, nbytes) = (0x%llx, %lld) is not a valid range", addr, len);
            return NULL;
        }
        p = (const void *)(uintptr_t)addr;
        n = (size_t)len;
    } else {
        if (PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        held = 1;
        p = view.buf;
        n = (size_t)view.len;
    }
    uint32_t crc;
    if (n >= CRC_GIL_RELEASE_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        crc = umbp_crc32c_with(impl, (uint32_t)seed, p, n);
        Py_END_ALLOW_THREADS
    } else {
        crc = umbp_crc32c_with(impl, (uint32_t)seed, p, n);
    }
    if (held) PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

/* crc32c_many(addrs uint64[], lengths int64[], out uint32[]): one call, GIL released, for a batch. */
PyObject *mod_crc32c_many(PyObject *mod, PyObject *args) {
    PyObject *o_a, *o_l, *o_o;
    if (!PyArg_ParseTuple(args, "OOO", &o_a, &o_l, &o_o)) return NULL;
    Arr a, l, o;
    a.held = l.held = o.held = 0;
    PyObject *ret = NULL;
    if (arr_get(o_a, &a, "addrs", 8, "LQ", 0, 0) < 0 || arr_get(o_l, &l, "lengths", 8, "lq", 0, 0) < 0 ||
        arr_get(o_o, &o, "out", 4, "I", 1, 0) < 0)
        goto done;
    Py_ssize_t n = arr_len(&a);
    if (arr_len(&l) != n || arr_len(&o) != n) {
        PyErr_Format(PyExc_ValueError, "addrs, lengths and out must be the same length (%zd, %zd, %zd)", n, arr_len(&l),
                     arr_len(&o));
        goto done;
    }
    const uint64_t *ap = a.view.buf;
    const int64_t *lp = l.view.buf;
    uint32_t *op = o.view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lp[i] < 0 || (lp[i] > 0 && ap[i] == 0)) {
            PyErr_Format(PyExc_ValueError, "entry %zd: (0x%llx, %lld) is not a valid range", i, (unsigned long long)ap[i],
                         (long long)lp[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) op[i] =
        umbp_crc32c(0, (const void *)(uintptr_t)ap[i], (size_t)lp[i], 0);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromSsize_t(n);
done:
    arr_release(&a);
    arr_release(&l);
    arr_release(&o);
    return ret;
}

/* crc32c_impl() -> name of the dispatched implementation; crc32c_impls() -> those this CPU supports. */
PyObject *mod_crc32c_impl(PyObject *mod, PyObject *unused) {
    return PyUnicode_FromString(umbp_crc32c_impl_name(umbp_crc32c_impl()));
}

PyObject *mod_crc32c_impls(PyObject *mod, PyObject *unused) {
    PyObject *t = PyList_New(0);
    for (int i = 0; t && i < UMBP_CRC32C_NIMPL; i++) {
        if (!umbp_crc32c_impl_supported(i)) continue;
        PyObject *name = PyUnicode_FromString(umbp_crc32c_impl_name(i));
        if (!name || PyList_Append(t, name) < 0) Py_CLEAR(t);
        Py_XDECREF(name);
    }
    if (!t) return NULL;
    PyObject *r = PyList_AsTuple(t);
    Py_DECREF(t);
    return r;
}
