/* Ring setup and teardown: io_uring_setup (newest flags first), the three mappings, the
 * registered eventfd and the cancel probe; close waits for the kernel (uring_cancel.c) and leaks
 * the ring rather than unmap memory the kernel may still write. */
#include "uring_internal.h"

int try_setup(unsigned entries, unsigned flags, struct umbp_params *p) {
    memset(p, 0, sizeof *p);
    p->flags = flags | UMBP_SETUP_CQSIZE;
    p->cq_entries = entries * 2; /* in flight <= SQ entries, so the CQ never overflows */
    return sys_setup(entries, p);
}

static void ring_unmap(RingObject *self) {
    if (self->sqes && self->sqes != MAP_FAILED) munmap(self->sqes, self->sqes_sz);
    if (self->cq_ptr && self->cq_ptr != self->sq_ptr && self->cq_ptr != MAP_FAILED) munmap(self->cq_ptr, self->cq_sz);
    if (self->sq_ptr && self->sq_ptr != MAP_FAILED) munmap(self->sq_ptr, self->sq_sz);
    self->sqes = NULL;
    self->sq_ptr = self->cq_ptr = NULL;
}

/* Setup, mmaps and eventfd; returns 0 or -errno with nothing left open. */
static int ring_open(RingObject *self, unsigned entries) {
    static const unsigned flag_sets[] = {UMBP_SETUP_SUBMIT_ALL | UMBP_SETUP_COOP_TASKRUN,
                                         UMBP_SETUP_SUBMIT_ALL, 0};
    struct umbp_params p;
    int fd = -EINVAL;
    for (size_t i = 0; i < sizeof flag_sets / sizeof flag_sets[0]; i++) {
        fd = try_setup(entries, flag_sets[i], &p);
        if (fd >= 0 || fd != -EINVAL) break; /* EINVAL: an older kernel without that flag */
    }
    if (fd < 0) return fd;
    self->ring_fd = fd;
    self->sq_entries = p.sq_entries;
    self->cq_entries = p.cq_entries;
    self->features = p.features;
    self->setup_flags = p.flags;

    self->sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    self->cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(struct umbp_cqe);
    if (p.features & UMBP_FEAT_SINGLE_MMAP) {
        if (self->cq_sz > self->sq_sz) self->sq_sz = self->cq_sz;
        self->cq_sz = self->sq_sz;
    }
    int err = 0;
    self->sq_ptr = mmap(NULL, self->sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, UMBP_OFF_SQ_RING);
    if (self->sq_ptr == MAP_FAILED) {
        err = -errno;
        self->sq_ptr = NULL;
        goto fail;
    }
    if (p.features & UMBP_FEAT_SINGLE_MMAP) {
        self->cq_ptr = self->sq_ptr;
    } else {
        self->cq_ptr = mmap(NULL, self->cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, UMBP_OFF_CQ_RING);
        if (self->cq_ptr == MAP_FAILED) {
            err = -errno;
            self->cq_ptr = NULL;
            goto fail;
        }
    }
    self->sqes_sz = p.sq_entries * sizeof(struct umbp_sqe);
    self->sqes = mmap(NULL, self->sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, UMBP_OFF_SQES);
    if (self->sqes == MAP_FAILED) {
        err = -errno;
        self->sqes = NULL;
        goto fail;
    }
    char *sq = self->sq_ptr, *cq = self->cq_ptr;
    self->sq_head = (unsigned *)(sq + p.sq_off.head);
    self->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    self->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    self->sq_flags = (unsigned *)(sq + p.sq_off.flags);
    self->sq_array = (unsigned *)(sq + p.sq_off.array);
    self->cq_head = (unsigned *)(cq + p.cq_off.head);
    self->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    self->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    self->cqes = (struct umbp_cqe *)(cq + p.cq_off.cqes);
    /* SQE i always sits in slot i, so the indirection array is the identity once. */
    for (unsigned i = 0; i < p.sq_entries; i++) self->sq_array[i] = i;

    self->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->event_fd < 0) {
        err = -errno;
        goto fail;
    }
    int r = sys_register(fd, UMBP_REGISTER_EVENTFD, &self->event_fd, 1);
    if (r < 0) {
        err = r;
        goto fail;
    }
    struct umbp_probe *pr = calloc(1, sizeof *pr);
    if (pr && sys_register(fd, UMBP_REGISTER_PROBE, pr, 256) >= 0)
        self->cancel_supported = pr->ops_len > UMBP_OP_ASYNC_CANCEL && (pr->ops[UMBP_OP_ASYNC_CANCEL].flags & 1) &&
                                 (p.flags & UMBP_SETUP_COOP_TASKRUN); /* COOP_TASKRUN (5.19) implies CANCEL_ANY */
    free(pr);
    return 0;
fail:
    ring_unmap(self);
    if (self->event_fd >= 0) close(self->event_fd);
    self->event_fd = -1;
    close(fd);
    self->ring_fd = -1;
    return err;
}

int Ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"entries", NULL};
    unsigned int entries = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|I", kwlist, &entries)) return -1;
    if (self->ring_fd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "Ring.__init__ called twice");
        return -1;
    }
    if (entries < 1 || entries > MAX_RING_ENTRIES) {
        PyErr_Format(PyExc_ValueError, "entries must be in [1, %u], got %u", MAX_RING_ENTRIES, entries);
        return -1;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = ring_open(self, entries);
    Py_END_ALLOW_THREADS
    if (r < 0) {
        errno = -r;
        PyObject *msg = PyUnicode_FromFormat("io_uring setup with %u entries failed: %s", entries, strerror(-r));
        if (msg) {
            PyObject *exc = PyObject_CallFunction(PyExc_OSError, "iO", -r, msg);
            if (exc) {
                PyErr_SetObject(PyExc_OSError, exc);
                Py_DECREF(exc);
            }
            Py_DECREF(msg);
        }
        return -1;
    }
    self->closed = 0;
    return 0;
}

PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    RingObject *self = (RingObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->ring_fd = -1;
    self->event_fd = -1;
    self->closed = 1;
    return (PyObject *)self;
}

static void ring_teardown(RingObject *self, double timeout_s) {
    if (self->closed) return;
    self->closed = 1;
    int clean = quiesce(self, timeout_s);
    if (clean) {
        ring_unmap(self);
        if (self->event_fd >= 0) close(self->event_fd);
        close(self->ring_fd);
    } else {
        /* Ops still owned by the kernel: leak the ring (fd and mappings) rather than let the
         * kernel post into unmapped memory or tear down under running workers. */
        self->leaked = 1;
    }
    self->event_fd = -1;
    self->ring_fd = -1;
    ring_forget_buffers(self);
}

PyObject *Ring_close(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"timeout_s", NULL};
    double timeout_s = 5.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", kwlist, &timeout_s)) return NULL;
    if (self->closed) Py_RETURN_TRUE;
    if (__atomic_exchange_n(&self->busy, 1, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_RuntimeError, "Ring.close() while another thread is using the ring");
        return NULL;
    }
    if (timeout_s < 0 || timeout_s != timeout_s) timeout_s = 0;
    Py_BEGIN_ALLOW_THREADS
    ring_teardown(self, timeout_s);
    Py_END_ALLOW_THREADS
    ring_release(self);
    return PyBool_FromLong(!self->leaked);
}

void Ring_dealloc(RingObject *self) {
    if (!self->closed) {
        Py_BEGIN_ALLOW_THREADS
        ring_teardown(self, 5.0);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}
