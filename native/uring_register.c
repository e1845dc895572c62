/* Registration: the fixed-buffer table (registered with the kernel, kept here for the range
 * checks and auto_fixed's binary search). */
#include "uring_internal.h"

/* Forget the registered buffer table / file table (the caller holds the ring). */
void ring_forget_buffers(RingObject *self) {
    free(self->buf_addr);
    free(self->buf_len);
    self->buf_addr = self->buf_len = NULL;
    self->nbufs = 0;
}

/* register_buffers: `obj` as a fast sequence of 1..max_n items (count in *n),
   or NULL with TypeError(type_err) or ValueError("<fn> takes 1..<max_n> <unit>, got <n>"). */
static PyObject *registration_seq(PyObject *obj, const char *type_err, const char *fn, const char *unit, int max_n,
                                  Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(obj, type_err);
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    if (*n < 1 || *n > max_n) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s takes 1..%d %s, got %zd", fn, max_n, unit, *n);
        return NULL;
    }
    return seq;
}

/* Swap a registration table: drop the old one (if any), register the new one, forget the old
   table either way. Called with the ring acquired; on failure the ring is released and an
   OSError is set. Registration pins or looks up every entry, which takes long: no GIL held. */
static int ring_reregister(RingObject *self, unsigned unreg_op, unsigned reg_op, void *arg, unsigned n, unsigned had,
                           void (*forget)(RingObject *)) {
    int r;
    Py_BEGIN_ALLOW_THREADS
    if (had) sys_register(self->ring_fd, unreg_op, NULL, 0);
    r = sys_register(self->ring_fd, reg_op, arg, n);
    Py_END_ALLOW_THREADS
    forget(self);
    if (r < 0) {
        ring_release(self);
        errno = -r;
        PyErr_SetFromErrno(PyExc_OSError);
    }
    return r;
}

PyObject *Ring_register_buffers(RingObject *self, PyObject *ranges) {
    Py_ssize_t n;
    PyObject *seq = registration_seq(ranges, "ranges must be a sequence of (address, nbytes) pairs", "register_buffers",
                                     "ranges", MAX_FIXED_BUFFERS, &n);
    if (!seq) return NULL;
    struct umbp_iovec *iov = calloc((size_t)n, sizeof *iov);
    uint64_t *ba = calloc((size_t)n, sizeof *ba), *bl = calloc((size_t)n, sizeof *bl);
    if (!iov || !ba || !bl) {
        free(iov), free(ba), free(bl);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr, len;
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyArg_ParseTuple(item, "KK;each range must be an (address, nbytes) pair of ints", &addr, &len)) goto fail;
        if (addr == 0 || len == 0 || len > MAX_OP_BYTES || addr + len < addr) {
            PyErr_Format(PyExc_ValueError, "range %zd: (0x%llx, %llu) must be a non-null address and 1..%llu bytes", i, addr, len,
                         (unsigned long long)MAX_OP_BYTES);
            goto fail;
        }
        iov[i].base = (void *)(uintptr_t)addr;
        iov[i].len = len;
        ba[i] = addr;
        bl[i] = len;
    }
    Py_DECREF(seq);
    seq = NULL;
    if (ring_acquire(self) < 0) goto fail;
    if (ring_reregister(self, UMBP_UNREGISTER_BUFFERS, UMBP_REGISTER_BUFFERS, iov, (unsigned)n, self->nbufs,
                        ring_forget_buffers) < 0)
        goto fail;
    self->buf_addr = ba;
    self->buf_len = bl;
    self->nbufs = (unsigned)n;
    self->bufs_sorted = 1;
    for (Py_ssize_t i = 1; i < n; i++)
        if (ba[i] < ba[i - 1] + bl[i - 1]) self->bufs_sorted = 0;
    ring_release(self);
    free(iov);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(seq);
    free(iov);
    free(ba);
    free(bl);
    return NULL;
}

/* unregister_buffers: unregister what *count says is
   registered, forget the table, and report a failure other than "nothing registered". */
static PyObject *ring_unregister(RingObject *self, unsigned opcode, const unsigned *count,
                                 void (*forget)(RingObject *)) {
    if (ring_acquire(self) < 0) return NULL;
    int r = 0;
    if (*count) {
        Py_BEGIN_ALLOW_THREADS
        r = sys_register(self->ring_fd, opcode, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    forget(self);
    ring_release(self);
    if (r < 0 && r != -ENXIO) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyObject *Ring_unregister_buffers(RingObject *self, PyObject *unused) {
    return ring_unregister(self, UMBP_UNREGISTER_BUFFERS, &self->nbufs, ring_forget_buffers);
}
