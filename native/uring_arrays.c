/* Array arguments: a buffer-protocol object checked for layout, item size and format. */
#include "uring_internal.h"

void arr_release(Arr *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

/* kinds: the struct-module format letters accepted for this element size */
int arr_get(PyObject *obj, Arr *a, const char *name, Py_ssize_t itemsize, const char *kinds, int writable,
            int optional) {
    a->held = 0;
    if (obj == NULL || obj == Py_None) {
        if (optional) return 0;
        PyErr_Format(PyExc_TypeError, "%s is required", name);
        return -1;
    }
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s array (format %s, %zd-byte items), got %.100s", name,
                     writable ? " writable" : "", kinds, itemsize, Py_TYPE(obj)->tp_name);
        return -1;
    }
    a->held = 1;
    const char *fmt = a->view.format ? a->view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (a->view.itemsize != itemsize || fmt[0] == 0 || fmt[1] != 0 || !strchr(kinds, fmt[0])) {
        PyErr_Format(PyExc_TypeError, "%s must have format %s with %zd-byte items, got format '%s' itemsize %zd", name,
                     kinds, itemsize, a->view.format ? a->view.format : "B", a->view.itemsize);
        arr_release(a);
        return -1;
    }
    return 0;
}
