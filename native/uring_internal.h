/* What the steps of the _uring extension share (native/uring_*.c, split by ring step as liburing
 * is): the Ring object, the system calls, the ring's memory-ordering helpers, array arguments
 * and each step's entry points. The kernel ABI itself is in uring.h.
 *
 * Memory ordering (single producer / single consumer rings shared with the kernel):
 *   SQ: write SQEs, then store-release the tail; the kernel store-releases the head.
 *   CQ: load-acquire the tail before reading CQEs, store-release the head after copying them.
 */
#ifndef UMBP_URING_INTERNAL_H
#define UMBP_URING_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "uring.h"

#define MAX_OP_BYTES (1ULL << 30)
#define MAX_RING_ENTRIES 32768U
#define MAX_FIXED_BUFFERS 16384 /* the kernel's IORING_MAX_REG_BUFFERS */
#define CANCEL_USER_DATA UINT64_MAX /* the cancel-all op's own CQE; never an engine op */

enum { OP_READ = 0, OP_WRITE = 1, OP_FSYNC = 2, OP_FDATASYNC = 3 };
#define USER_FLAGS_ALLOWED \
    (UMBP_SQE_IO_DRAIN | UMBP_SQE_IO_LINK | UMBP_SQE_IO_HARDLINK | UMBP_SQE_ASYNC)

/* ------------------------------------------------------------------ syscalls */

static inline int sys_setup(unsigned entries, struct umbp_params *p) {
    long r = syscall(UMBP_NR_io_uring_setup, entries, p);
    return r < 0 ? -errno : (int)r;
}

static inline int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void *arg,
                            size_t argsz) {
    long r = syscall(UMBP_NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
    return r < 0 ? -errno : (int)r;
}

static inline int sys_register(int fd, unsigned op, const void *arg, unsigned nr) {
    long r = syscall(UMBP_NR_io_uring_register, fd, op, arg, nr);
    return r < 0 ? -errno : (int)r;
}

static inline unsigned load_acquire(const unsigned *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(unsigned *p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* ------------------------------------------------------------------ Ring */

typedef struct {
    PyObject_HEAD
    int ring_fd;
    int event_fd;
    int closed;
    int leaked;
    int busy;
    unsigned sq_entries, cq_entries, features, setup_flags;
    unsigned inflight; /* SQEs published whose CQE has not been reaped */
    int cancel_supported;
    void *sq_ptr, *cq_ptr;
    size_t sq_sz, cq_sz;
    struct umbp_sqe *sqes;
    size_t sqes_sz;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *sq_flags;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct umbp_cqe *cqes;
    /* registered buffers, for the fixed-op range check */
    unsigned nbufs;
    uint64_t *buf_addr, *buf_len;
    int bufs_sorted; /* ascending, non-overlapping: auto_fixed may binary-search */
    /* I/O priority stamped on every read / write SQE (0 = the task's own, the kernel default) */
    uint16_t read_ioprio, write_ioprio;
} RingObject;

static inline int ring_acquire(RingObject *self) {
    if (self->closed) {
        PyErr_SetString(PyExc_ValueError, "Ring is closed");
        return -1;
    }
    if (__atomic_exchange_n(&self->busy, 1, __ATOMIC_ACQUIRE)) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is in use by another thread; a ring has one owner at a time");
        return -1;
    }
    return 0;
}

static inline void ring_release(RingObject *self) { __atomic_store_n(&self->busy, 0, __ATOMIC_RELEASE); }

static inline unsigned sq_pending(RingObject *self) { return *self->sq_tail - load_acquire(self->sq_head); }

/* ------------------------------------------------------------------ array arguments */

typedef struct {
    Py_buffer view;
    int held;
} Arr;

static inline Py_ssize_t arr_len(const Arr *a) { return a->held ? a->view.len / a->view.itemsize : -1; }

/* Entry points of the steps, for one another and for the module glue (uring_module.c). Hidden:
 * the shared object exports PyInit__uring alone. */
#pragma GCC visibility push(hidden)

/* uring_arrays.c: buffer-protocol arguments. kinds: the struct-module format letters accepted */
int arr_get(PyObject *obj, Arr *a, const char *name, Py_ssize_t itemsize, const char *kinds, int writable,
            int optional);
void arr_release(Arr *a);

/* uring_setup.c: ring setup and teardown */
int try_setup(unsigned entries, unsigned flags, struct umbp_params *p);
PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds);
int Ring_init(RingObject *self, PyObject *args, PyObject *kwds);
PyObject *Ring_close(RingObject *self, PyObject *args, PyObject *kwds);
void Ring_dealloc(RingObject *self);

/* uring_submit.c: validate a batch, write its SQEs, enter */
PyObject *Ring_submit(RingObject *self, PyObject *args, PyObject *kwds);
PyObject *Ring_check(RingObject *self, PyObject *args, PyObject *kwds);
PyObject *Ring_flush(RingObject *self, PyObject *unused);

/* uring_reap.c: completions */
PyObject *Ring_reap(RingObject *self, PyObject *args);
PyObject *Ring_reap_batches(RingObject *self, PyObject *batches);
PyObject *Ring_wait(RingObject *self, PyObject *args, PyObject *kwds);

/* uring_cancel.c: cancelling ops, and the bounded wait before a ring's memory may go */
int quiesce(RingObject *self, double timeout_s);
PyObject *Ring_cancel(RingObject *self, PyObject *o_ud);

/* uring_register.c: registered buffers */
void ring_forget_buffers(RingObject *self);
PyObject *Ring_register_buffers(RingObject *self, PyObject *ranges);
PyObject *Ring_unregister_buffers(RingObject *self, PyObject *unused);

/* uring_probe.c, crc32c_module.c: module functions */
PyObject *mod_probe(PyObject *mod, PyObject *unused);
PyObject *mod_crc32c(PyObject *mod, PyObject *args, PyObject *kwds);
PyObject *mod_crc32c_many(PyObject *mod, PyObject *args);
PyObject *mod_pairs_into(PyObject *mod, PyObject *args);
PyObject *mod_pairs_dst(PyObject *mod, PyObject *args);
PyObject *mod_pairs_src(PyObject *mod, PyObject *args);
PyObject *mod_crc32c_each(PyObject *mod, PyObject *args); /* uring_keycrc.c */
PyObject *mod_put_records(PyObject *mod, PyObject *args); /* uring_records.c */
PyObject *mod_place_records(PyObject *mod, PyObject *args);
PyObject *mod_area_images(PyObject *mod, PyObject *args);
PyObject *mod_records_name(PyObject *mod, PyObject *args); /* uring_record_check.c */
PyObject *mod_crc32c_impl(PyObject *mod, PyObject *unused);
PyObject *mod_crc32c_impls(PyObject *mod, PyObject *unused);

#pragma GCC visibility pop

#endif
