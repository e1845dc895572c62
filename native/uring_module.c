/* _uring: a small io_uring binding over the raw system calls (no liburing).
 *
 * The extension only moves descriptors: validate a batch, write SQEs, one io_uring_enter, copy
 * CQEs out. Policy (queueing beyond the ring, retries of short ops, futures) lives in
 * umbp_nvme/engine/uring.py. Every system call runs with the GIL released.
 *
 * One file per ring step, as liburing is laid out: uring_setup.c (setup, teardown),
 * uring_submit.c, uring_reap.c, uring_cancel.c, uring_register.c, uring_probe.c; batch helpers in
 * uring_pairs.c, uring_keycrc.c and uring_records.c (a put batch's records); shared pieces in
 * uring_internal.h and uring_arrays.c; crc32c_module.c over crc32c.c. This file is the module
 * glue: the Ring type's attributes and methods, the module's functions and constants.
 */
#include "uring_internal.h"

static PyObject *Ring_get_int(RingObject *self, void *which) {
    switch ((intptr_t)which) {
    case 0: return PyLong_FromUnsignedLong(self->sq_entries);
    case 1: return PyLong_FromUnsignedLong(self->cq_entries);
    case 2: return PyLong_FromLong(self->event_fd);
    case 3: return PyLong_FromUnsignedLong(self->features);
    case 4: return PyLong_FromUnsignedLong(self->setup_flags);
    case 5: return PyLong_FromUnsignedLong(self->inflight);
    case 6: return PyLong_FromUnsignedLong(self->closed ? 0 : sq_pending(self));
    case 7: return PyLong_FromUnsignedLong(self->nbufs);
    case 8: return PyLong_FromLong(self->ring_fd);
    case 9: return PyBool_FromLong(self->closed);
    case 10: return PyBool_FromLong(self->leaked);
    case 12: return PyLong_FromUnsignedLong(self->read_ioprio);
    case 13: return PyLong_FromUnsignedLong(self->write_ioprio);
    }
    Py_RETURN_NONE;
}

/* read_ioprio / write_ioprio: IOPRIO_PRIO_VALUE(class, level) for later read / write SQEs. The
 * kernel checks it per op (EPERM for RT without the capability, EINVAL for a bad class). */
static int Ring_set_ioprio(RingObject *self, PyObject *value, void *which) {
    if (!value) {
        PyErr_SetString(PyExc_AttributeError, "ioprio cannot be deleted");
        return -1;
    }
    long v = PyLong_AsLong(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > 0xFFFF) {
        PyErr_Format(PyExc_ValueError, "ioprio must be in [0, 65535] (IOPRIO_PRIO_VALUE(class, level)), got %ld", v);
        return -1;
    }
    if ((intptr_t)which == 12) self->read_ioprio = (uint16_t)v;
    else self->write_ioprio = (uint16_t)v;
    return 0;
}

static PyGetSetDef Ring_getset[] = {
    {"entries", (getter)Ring_get_int, NULL, "SQ entries (ops submittable at once)", (void *)0},
    {"cq_entries", (getter)Ring_get_int, NULL, "CQ entries (2x SQ)", (void *)1},
    {"eventfd", (getter)Ring_get_int, NULL, "non-blocking eventfd signalled on completions", (void *)2},
    {"features", (getter)Ring_get_int, NULL, "IORING_FEAT_* bits", (void *)3},
    {"setup_flags", (getter)Ring_get_int, NULL, "IORING_SETUP_* bits the kernel accepted", (void *)4},
    {"inflight", (getter)Ring_get_int, NULL, "ops queued whose completion is not reaped yet", (void *)5},
    {"sq_pending", (getter)Ring_get_int, NULL, "SQEs the kernel has not consumed yet (call flush())", (void *)6},
    {"nbufs", (getter)Ring_get_int, NULL, "registered buffers", (void *)7},
    {"fd", (getter)Ring_get_int, NULL, "the io_uring file descriptor", (void *)8},
    {"closed", (getter)Ring_get_int, NULL, NULL, (void *)9},
    {"leaked", (getter)Ring_get_int, NULL, "closed with ops still owned by the kernel", (void *)10},
    {"read_ioprio", (getter)Ring_get_int, (setter)Ring_set_ioprio, "ioprio of read SQEs (0 = task default)", (void *)12},
    {"write_ioprio", (getter)Ring_get_int, (setter)Ring_set_ioprio, "ioprio of write SQEs (0 = task default)", (void *)13},
    {NULL}};

static PyMethodDef Ring_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Ring_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(opcode, fds, offsets, addrs, lengths, buf_index, user_data, flags=None, async_min_bytes=0, enter=True) "
     "-> ops queued (as many as fit in the SQ and CQ; one io_uring_enter)"},
    {"check", (PyCFunction)(void (*)(void))Ring_check, METH_VARARGS | METH_KEYWORDS,
     "check(opcode, fds, offsets, addrs, lengths, buf_index=None, flags=None): submit()'s validation only"},
    {"flush", (PyCFunction)Ring_flush, METH_NOARGS, "submit SQEs left unconsumed; returns those still pending"},
    {"cancel", (PyCFunction)Ring_cancel, METH_O, "cancel(user_data: uint64[]) -> n: best-effort IORING_OP_ASYNC_CANCEL per op"},
    {"reap", (PyCFunction)Ring_reap, METH_VARARGS, "reap(out_user_data: uint64[], out_res: int32[]) -> n, non-blocking"},
    {"reap_batches", (PyCFunction)Ring_reap_batches, METH_O,
     "reap_batches(batches: dict) -> (n, [(batch, finished)], [(batch, index, res)] | None); non-blocking"},
    {"wait", (PyCFunction)(void (*)(void))Ring_wait, METH_VARARGS | METH_KEYWORDS,
     "wait(min_complete=1, timeout_s=None) -> CQEs ready (GIL released)"},
    {"register_buffers", (PyCFunction)Ring_register_buffers, METH_O, "register_buffers([(addr, nbytes), ...])"},
    {"unregister_buffers", (PyCFunction)Ring_unregister_buffers, METH_NOARGS, NULL},
    {"close", (PyCFunction)(void (*)(void))Ring_close, METH_VARARGS | METH_KEYWORDS,
     "close(timeout_s=5.0) -> True, or False when ops outlived the timeout and the ring was leaked"},
    {NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp_nvme._uring.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(entries=256): one io_uring with a 2x completion queue and a registered eventfd",
    .tp_new = Ring_new,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
};

static PyMethodDef module_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data | (address, nbytes), seed=0, force_table=False, impl=None) -> int; chainable via seed; GIL "
     "released; impl names one implementation (see crc32c_impls())"},
    {"pairs_into", (PyCFunction)mod_pairs_into, METH_VARARGS,
     "pairs_into(buffers, addrs int64[], nbytes int64[]) -> bool: (address, nbytes) tuples of ints as arrays; "
     "False (outputs unspecified) for anything else"},
    {"pairs_dst", (PyCFunction)mod_pairs_dst, METH_VARARGS,
     "pairs_dst(buffers, idx, lens, segs, starts, ends, direct, align, addr_min, out uint64[]) -> bool: a get's "
     "destinations, each a registered (address, nbytes) pair large enough and aligned where O_DIRECT needs it"},
    {"pairs_src", (PyCFunction)mod_pairs_src, METH_VARARGS,
     "pairs_src(buffers, starts, ends, addr_min, max_bytes, align, addrs uint64[], lens int64[]) -> 2 | 1 | 0: a "
     "put's sources as arrays (2: all aligned to align), 0 where one is not a registered pair of 2..max_bytes"},
    {"crc32c_many", (PyCFunction)mod_crc32c_many, METH_VARARGS,
     "crc32c_many(addrs uint64[], lengths int64[], out uint32[]) -> n; one CRC per range, GIL released"},
    {"records_name", (PyCFunction)mod_records_name, METH_VARARGS,
     "records_name(recs, keys, segs, offs, gens, out) -> undecided: out[i] = 1 where record i is valid and names "
     "that object and key i, 0 where not, 2 where key i is a non-ASCII str (the caller decides)"},
    {"crc32c_each", (PyCFunction)mod_crc32c_each, METH_VARARGS,
     "crc32c_each(list of bytes, out uint32[]) -> n; the CRC32C of each item, one C pass (index key CRCs)"},
    {"put_records", (PyCFunction)mod_put_records, METH_VARARGS,
     "put_records(keys list of bytes, segs int64[], offs int64[], lens int64[], depths int32[], crcs uint32[], "
     "generation, out48 uint8[], out256 uint8[], conf256 uint8[] | None) -> n; a put batch's LMDB values, sealed "
     "segment records and their confirmed copies in one pass"},
    {"place_records", (PyCFunction)mod_place_records, METH_VARARGS,
     "place_records(area uint8[], slots int64[], recs uint8[], confirm, blocks_out int64[]) -> k; records copied "
     "into their slots (confirm: only over the same generation, valid and unconfirmed), the blocks touched in "
     "blocks_out[:k]"},
    {"area_images", (PyCFunction)mod_area_images, METH_VARARGS,
     "area_images(area uint8[] | None, blocks int64[], out uint8[]) -> k; each record block's 4 KiB image "
     "(zeros past the area's end)"},
    {"crc32c_impl", (PyCFunction)mod_crc32c_impl, METH_NOARGS,
     "crc32c_impl() -> str: the dispatched implementation (table, sse42, pclmul, vpclmul256, vpclmul); "
     "UMBP_CRC32C_IMPL caps it"},
    {"crc32c_impls", (PyCFunction)mod_crc32c_impls, METH_NOARGS,
     "crc32c_impls() -> tuple of the implementations this CPU supports, in dispatch order"},
    {"probe", (PyCFunction)mod_probe, METH_NOARGS, "probe() -> dict: ring works, kernel features, ops, sse42, crc32c"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "umbp_nvme._uring",
                                        "io_uring (raw system calls) and CRC32C for umbp_nvme", -1, module_methods,
                                        NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__uring(void) {
    if (PyType_Ready(&RingType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "OP_READ", OP_READ);
    PyModule_AddIntConstant(m, "OP_WRITE", OP_WRITE);
    PyModule_AddIntConstant(m, "OP_FSYNC", OP_FSYNC);
    PyModule_AddIntConstant(m, "OP_FDATASYNC", OP_FDATASYNC);
    PyModule_AddIntConstant(m, "F_DRAIN", UMBP_SQE_IO_DRAIN);
    PyModule_AddIntConstant(m, "F_LINK", UMBP_SQE_IO_LINK);
    PyModule_AddIntConstant(m, "F_HARDLINK", UMBP_SQE_IO_HARDLINK);
    PyModule_AddIntConstant(m, "F_ASYNC", UMBP_SQE_ASYNC);
    PyModule_AddIntConstant(m, "MAX_OP_BYTES", (long)MAX_OP_BYTES);
    PyModule_AddIntConstant(m, "MAX_ENTRIES", MAX_RING_ENTRIES);
    PyModule_AddIntConstant(m, "MAX_FIXED_BUFFERS", MAX_FIXED_BUFFERS);
    PyModule_AddObject(m, "CRC32C_HW", PyBool_FromLong(umbp_crc32c_hw_available()));
    return m;
}
