/* _uring: a small io_uring binding over the raw system calls (no liburing).
 *
 * The extension only moves descriptors: validate a batch, write SQEs, one io_uring_enter, copy
 * CQEs out. Policy (queueing beyond the ring, retries of short ops, futures) lives in
 * umbp_nvme/engine/uring.py. Every system call runs with the GIL released.
 *
 * Memory ordering (single producer / single consumer rings shared with the kernel):
 *   SQ: write SQEs, then store-release the tail; the kernel store-releases the head.
 *   CQ: load-acquire the tail before reading CQEs, store-release the head after copying them.
 */
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
#define CRC_GIL_RELEASE_BYTES 8192
#define CANCEL_USER_DATA UINT64_MAX /* the cancel-all op's own CQE; never an engine op */

enum { OP_READ = 0, OP_WRITE = 1, OP_FSYNC = 2, OP_FDATASYNC = 3 };
#define USER_FLAGS_ALLOWED \
    (UMBP_SQE_IO_DRAIN | UMBP_SQE_IO_LINK | UMBP_SQE_IO_HARDLINK | UMBP_SQE_ASYNC)

/* ------------------------------------------------------------------ syscalls */

static int sys_setup(unsigned entries, struct umbp_params *p) {
    long r = syscall(UMBP_NR_io_uring_setup, entries, p);
    return r < 0 ? -errno : (int)r;
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags, void *arg,
                     size_t argsz) {
    long r = syscall(UMBP_NR_io_uring_enter, fd, to_submit, min_complete, flags, arg, argsz);
    return r < 0 ? -errno : (int)r;
}

static int sys_register(int fd, unsigned op, const void *arg, unsigned nr) {
    long r = syscall(UMBP_NR_io_uring_register, fd, op, arg, nr);
    return r < 0 ? -errno : (int)r;
}

static inline unsigned load_acquire(const unsigned *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void store_release(unsigned *p, unsigned v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

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

static int ring_acquire(RingObject *self) {
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

static void ring_release(RingObject *self) { __atomic_store_n(&self->busy, 0, __ATOMIC_RELEASE); }

static unsigned sq_pending(RingObject *self) { return *self->sq_tail - load_acquire(self->sq_head); }

static int try_setup(unsigned entries, unsigned flags, struct umbp_params *p) {
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

static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds) {
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

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    RingObject *self = (RingObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->ring_fd = -1;
    self->event_fd = -1;
    self->closed = 1;
    return (PyObject *)self;
}

/* Discard CQEs; the caller holds no GIL. */
static unsigned drain_cq(RingObject *self) {
    unsigned head = *self->cq_head, tail = load_acquire(self->cq_tail), n = 0;
    for (; head != tail; head++) {
        if (self->cqes[head & *self->cq_mask].user_data != CANCEL_USER_DATA) n++;
    }
    store_release(self->cq_head, head);
    return n;
}

/* Cancel what can be cancelled and wait (bounded) for every in-flight op. Returns 1 when none
 * remains in flight: only then may the ring memory go, because the kernel writes CQEs into it
 * and io-wq workers may still copy into caller memory until their CQE is posted. */
static int quiesce(RingObject *self, double timeout_s) {
    if (!self->inflight) return 1;
    unsigned pending = sq_pending(self);
    if (pending) { /* never submitted: take them back so they cannot start after close */
        store_release(self->sq_tail, *self->sq_tail - pending);
        self->inflight -= pending;
    }
    if (self->inflight && self->cancel_supported && sq_pending(self) < self->sq_entries) {
        unsigned tail = *self->sq_tail;
        struct umbp_sqe *sqe = &self->sqes[tail & *self->sq_mask];
        memset(sqe, 0, sizeof *sqe);
        sqe->opcode = UMBP_OP_ASYNC_CANCEL;
        sqe->fd = -1;
        sqe->op_flags = UMBP_ASYNC_CANCEL_ANY;
        sqe->user_data = CANCEL_USER_DATA;
        store_release(self->sq_tail, tail + 1);
        if (sys_enter(self->ring_fd, 1, 0, 0, NULL, 0) != 1) store_release(self->sq_tail, tail);
    }
    double deadline = now_s() + timeout_s;
    for (;;) {
        unsigned got = drain_cq(self);
        self->inflight -= got < self->inflight ? got : self->inflight;
        if (!self->inflight) return 1;
        double left = deadline - now_s();
        if (left <= 0) return 0;
        if (self->features & UMBP_FEAT_EXT_ARG) {
            struct umbp_timespec ts = {(int64_t)left, (long long)((left - (int64_t)left) * 1e9)};
            struct umbp_getevents_arg arg = {0, 0, 0, (uint64_t)(uintptr_t)&ts};
            sys_enter(self->ring_fd, 0, 1, UMBP_ENTER_GETEVENTS | UMBP_ENTER_EXT_ARG, &arg, sizeof arg);
        } else {
            sys_enter(self->ring_fd, 0, 0, UMBP_ENTER_GETEVENTS, NULL, 0);
            usleep(1000);
        }
    }
}

/* Forget the registered buffer table / file table (the caller holds the ring). */
static void ring_forget_buffers(RingObject *self) {
    free(self->buf_addr);
    free(self->buf_len);
    self->buf_addr = self->buf_len = NULL;
    self->nbufs = 0;
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

static PyObject *Ring_close(RingObject *self, PyObject *args, PyObject *kwds) {
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

static void Ring_dealloc(RingObject *self) {
    if (!self->closed) {
        Py_BEGIN_ALLOW_THREADS
        ring_teardown(self, 5.0);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ------------------------------------------------------------------ array arguments */

typedef struct {
    Py_buffer view;
    int held;
} Arr;

static void arr_release(Arr *a) {
    if (a->held) PyBuffer_Release(&a->view);
    a->held = 0;
}

/* kinds: the struct-module format letters accepted for this element size */
static int arr_get(PyObject *obj, Arr *a, const char *name, Py_ssize_t itemsize, const char *kinds, int writable,
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

static Py_ssize_t arr_len(const Arr *a) { return a->held ? a->view.len / a->view.itemsize : -1; }

/* ------------------------------------------------------------------ submit */

typedef struct {
    int opcode;
    Py_ssize_t n;
    const int32_t *fds; /* NULL: every op uses fd_value */
    int32_t fd_value;
    const int64_t *offs;
    const uint64_t *addrs;
    const int64_t *lens;
    const int16_t *bidx;
    const uint64_t *ud; /* NULL: op i gets ud_base + i */
    uint64_t ud_base;
    const uint8_t *flags;
    int auto_fixed; /* bidx NULL and auto_fixed: the registered buffer holding the op, if any */
    uint64_t async_min_bytes;
    /* O_DIRECT alignment the caller knows for every op's file (engine/files.py); 0/1 = no check */
    uint32_t mem_align, off_align;
    int enter;
    /* results */
    Py_ssize_t queued;
    int sys_err;
    char msg[320];
} SubmitArgs;

#define OP_FD(a, i) ((a)->fds ? (a)->fds[i] : (a)->fd_value)
#define OP_UD(a, i) ((a)->ud ? (a)->ud[i] : (a)->ud_base + (uint64_t)(i))

/* Index of the registered buffer holding [addr, addr + len), or -1. */
static int find_fixed(RingObject *self, uint64_t addr, uint64_t len) {
    unsigned nb = self->nbufs;
    if (!nb) return -1;
    if (self->bufs_sorted) {
        unsigned lo = 0, hi = nb; /* first buffer starting after addr */
        while (lo < hi) {
            unsigned mid = (lo + hi) / 2;
            if (self->buf_addr[mid] <= addr) lo = mid + 1;
            else hi = mid;
        }
        if (lo == 0) return -1;
        unsigned b = lo - 1;
        return addr + len <= self->buf_addr[b] + self->buf_len[b] ? (int)b : -1;
    }
    for (unsigned b = 0; b < nb; b++)
        if (addr >= self->buf_addr[b] && addr + len <= self->buf_addr[b] + self->buf_len[b]) return (int)b;
    return -1;
}


/* Every argument check, before any SQE is written. Returns 0 or -1 with a->msg set. */
static int validate_ops(RingObject *self, SubmitArgs *a) {
    int rw = a->opcode == OP_READ || a->opcode == OP_WRITE;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        int fd = OP_FD(a, i);
        uint8_t fl = a->flags ? a->flags[i] : 0;
        if (fl & ~USER_FLAGS_ALLOWED) {
            snprintf(a->msg, sizeof a->msg, "op %zd: flags 0x%x has bits outside F_DRAIN|F_LINK|F_HARDLINK|F_ASYNC", i, fl);
            return -1;
        }
        if (fd < 0) {
            snprintf(a->msg, sizeof a->msg, "op %zd: fd must be >= 0, got %d", i, fd);
            return -1;
        }
        /* reap()/reap_batches() drop CQEs carrying the cancel op's tag: such an op would stay in
         * flight forever. Checked in op order, this also stops ud_base + i before it can wrap. */
        if (OP_UD(a, i) == CANCEL_USER_DATA) {
            snprintf(a->msg, sizeof a->msg,
                     "op %zd: user_data 0x%llx is reserved for the ring's own cancel op (ud_base + op index must stay "
                     "below it)",
                     i, (unsigned long long)OP_UD(a, i));
            return -1;
        }
        if (!rw) continue;
        int64_t off = a->offs[i], len = a->lens[i];
        uint64_t addr = a->addrs[i];
        if (len <= 0 || (uint64_t)len > MAX_OP_BYTES) {
            snprintf(a->msg, sizeof a->msg, "op %zd: length must be in (0, %llu], got %lld", i, (unsigned long long)MAX_OP_BYTES,
                     (long long)len);
            return -1;
        }
        if (off < 0) {
            snprintf(a->msg, sizeof a->msg, "op %zd: file offset must be >= 0, got %lld", i, (long long)off);
            return -1;
        }
        if (addr == 0 || addr + (uint64_t)len < addr) {
            snprintf(a->msg, sizeof a->msg, "op %zd: buffer address 0x%llx (+%lld bytes) is not a valid range", i,
                     (unsigned long long)addr, (long long)len);
            return -1;
        }
        int b = a->bidx ? a->bidx[i] : -1;
        if (b < -1 || b >= (int)self->nbufs) {
            snprintf(a->msg, sizeof a->msg, "op %zd: fixed buffer index %d is not registered (%u registered; -1 = not fixed)", i, b,
                     self->nbufs);
            return -1;
        }
        if (b >= 0 && (addr < self->buf_addr[b] || addr + (uint64_t)len > self->buf_addr[b] + self->buf_len[b])) {
            snprintf(a->msg, sizeof a->msg,
                     "op %zd: [0x%llx, +%lld) lies outside registered buffer %d [0x%llx, +%llu); use buf_index -1 for "
                     "memory outside registered buffers",
                     i, (unsigned long long)addr, (long long)len, b, (unsigned long long)self->buf_addr[b],
                     (unsigned long long)self->buf_len[b]);
            return -1;
        }
        uint32_t ma = a->mem_align > 1 ? a->mem_align : 1, oa = a->off_align > 1 ? a->off_align : 1;
        if ((addr % ma) || ((uint64_t)off % oa) || ((uint64_t)len % oa)) {
            snprintf(a->msg, sizeof a->msg,
                     "op %zd: fd %d is O_DIRECT and needs the buffer address aligned to %u bytes and the offset and "
                     "length to %u bytes; got address 0x%llx, offset %lld, length %lld (use an aligned buffer such as "
                     "umbp_nvme.buffers.AlignedBuffer)",
                     i, fd, ma, oa, (unsigned long long)addr, (long long)off, (long long)len);
            return -1;
        }
    }
    return 0;
}

static void fill_sqe(RingObject *self, SubmitArgs *a, Py_ssize_t i, struct umbp_sqe *sqe) {
    uint8_t fl = a->flags ? a->flags[i] : 0;
    int fd = OP_FD(a, i);
    memset(sqe, 0, sizeof *sqe);
    sqe->fd = fd;
    sqe->user_data = OP_UD(a, i);
    if (a->opcode == OP_FSYNC || a->opcode == OP_FDATASYNC) {
        sqe->opcode = UMBP_OP_FSYNC;
        sqe->op_flags = a->opcode == OP_FDATASYNC ? UMBP_FSYNC_DATASYNC : 0;
        sqe->flags = fl;
        return;
    }
    int b = a->bidx ? a->bidx[i] : (a->auto_fixed ? find_fixed(self, a->addrs[i], (uint64_t)a->lens[i]) : -1);
    int write = a->opcode == OP_WRITE;
    sqe->opcode = b >= 0 ? (write ? UMBP_OP_WRITE_FIXED : UMBP_OP_READ_FIXED) : (write ? UMBP_OP_WRITE : UMBP_OP_READ);
    if (b >= 0) sqe->buf_index = (uint16_t)b;
    sqe->off = (uint64_t)a->offs[i];
    sqe->addr = a->addrs[i];
    sqe->len = (uint32_t)a->lens[i];
    sqe->ioprio = write ? self->write_ioprio : self->read_ioprio;
    /* Page-cache copies run inline in io_uring_enter on the submitting core; large ones are
     * pushed to io-wq workers when the caller asks (Python passes 0 for O_DIRECT files). */
    if (a->async_min_bytes && (uint64_t)a->lens[i] >= a->async_min_bytes)
        fl |= UMBP_SQE_ASYNC;
    sqe->flags = fl;
}

/* Runs without the GIL. Returns 0, -1 (validation, msg set) or -2 (system error in sys_err). */
static int do_submit(RingObject *self, SubmitArgs *a) {
    a->queued = 0;
    if (validate_ops(self, a) < 0) return -1;
    unsigned tail = *self->sq_tail;
    unsigned sq_free = self->sq_entries - (tail - load_acquire(self->sq_head));
    unsigned cq_free = self->cq_entries > self->inflight ? self->cq_entries - self->inflight : 0;
    Py_ssize_t k = a->n;
    if ((Py_ssize_t)sq_free < k) k = sq_free;
    if ((Py_ssize_t)cq_free < k) k = cq_free;
    /* A link chain cut at the ring's edge would link into the next, unrelated op. */
    if (k < a->n && a->flags) {
        while (k > 0 && (a->flags[k - 1] & (UMBP_SQE_IO_LINK | UMBP_SQE_IO_HARDLINK))) k--;
    }
    unsigned mask = *self->sq_mask;
    for (Py_ssize_t i = 0; i < k; i++) fill_sqe(self, a, i, &self->sqes[(tail + (unsigned)i) & mask]);
    store_release(self->sq_tail, tail + (unsigned)k);
    self->inflight += (unsigned)k;
    a->queued = k;
    if (!a->enter) return 0;
    for (;;) {
        unsigned pending = sq_pending(self);
        if (!pending) return 0;
        int r = sys_enter(self->ring_fd, pending, 0, 0, NULL, 0);
        if (r >= 0) return 0; /* a partial submit leaves the rest in the SQ: sq_pending tells */
        if (r == -EINTR) continue;
        if (r == -EAGAIN || r == -EBUSY) return 0; /* transient: the SQEs stay queued */
        /* Hard failure: take this call's SQEs back if the kernel consumed none of them. */
        if (sq_pending(self) >= (unsigned)k) {
            store_release(self->sq_tail, tail);
            self->inflight -= (unsigned)k;
            a->queued = 0;
        }
        a->sys_err = -r;
        return -2;
    }
}

/* The op arrays of one submit() or check() call, held until ops_release(). */
typedef struct {
    Arr fds, offs, addrs, lens, bidx, ud, flags;
} OpArrays;

static void ops_release(OpArrays *o) {
    arr_release(&o->fds);
    arr_release(&o->offs);
    arr_release(&o->addrs);
    arr_release(&o->lens);
    arr_release(&o->bidx);
    arr_release(&o->ud);
    arr_release(&o->flags);
}

/* One parser for submit() and check(): fds (an int for every op, a 1-entry int32 array that
 * broadcasts, or one int32 per op) and the op arrays, each checked for type and length; fills
 * the op fields of *a. read/write ops need offsets, addrs and lengths; sync ops none. Returns -1
 * with a Python error set (o is released by the caller either way). */
static int parse_ops(int opcode, PyObject *o_fds, PyObject *o_offs, PyObject *o_addrs, PyObject *o_lens, PyObject *o_bidx,
                     PyObject *o_ud, PyObject *o_flags, OpArrays *o, SubmitArgs *a) {
    int rw = opcode <= OP_WRITE;
    int fd_scalar = PyLong_Check(o_fds);
    long fd_value = 0;
    if (fd_scalar) {
        fd_value = PyLong_AsLong(o_fds);
        if (fd_value == -1 && PyErr_Occurred()) return -1;
        if (fd_value < INT32_MIN || fd_value > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "fd %ld is out of range", fd_value);
            return -1;
        }
    }
    if ((!fd_scalar && arr_get(o_fds, &o->fds, "fds", 4, "i", 0, 0) < 0) ||
        arr_get(o_offs, &o->offs, "offsets", 8, "lq", 0, !rw) < 0 || arr_get(o_addrs, &o->addrs, "addrs", 8, "LQ", 0, !rw) < 0 ||
        arr_get(o_lens, &o->lens, "lengths", 8, "lq", 0, !rw) < 0 || arr_get(o_bidx, &o->bidx, "buf_index", 2, "h", 0, 1) < 0 ||
        arr_get(o_ud, &o->ud, "user_data", 8, "LQ", 0, 1) < 0 || arr_get(o_flags, &o->flags, "flags", 1, "B", 0, 1) < 0)
        return -1;
    Py_ssize_t nf = fd_scalar ? 1 : arr_len(&o->fds);
    Py_ssize_t n = nf == 1 && o->lens.held ? arr_len(&o->lens) : nf; /* one fd broadcasts */
    if (nf == 1 && !fd_scalar) {
        fd_scalar = 1;
        fd_value = ((const int32_t *)o->fds.view.buf)[0];
    }
    const char *names[] = {"offsets", "addrs", "lengths", "buf_index", "user_data", "flags"};
    Arr *others[] = {&o->offs, &o->addrs, &o->lens, &o->bidx, &o->ud, &o->flags};
    for (int j = 0; j < 6; j++) {
        if (others[j]->held && arr_len(others[j]) != n) {
            PyErr_Format(PyExc_ValueError, "%s has %zd entries but fds has %zd; the arrays differ in length (each needs one entry per op)", names[j],
                         arr_len(others[j]), n);
            return -1;
        }
    }
    memset(a, 0, sizeof *a);
    a->opcode = opcode;
    a->n = n;
    a->fds = fd_scalar ? NULL : o->fds.view.buf;
    a->fd_value = (int32_t)fd_value;
    a->offs = o->offs.held ? o->offs.view.buf : NULL;
    a->addrs = o->addrs.held ? o->addrs.view.buf : NULL;
    a->lens = o->lens.held ? o->lens.view.buf : NULL;
    a->bidx = o->bidx.held && rw ? o->bidx.view.buf : NULL;
    a->ud = o->ud.held ? o->ud.view.buf : NULL;
    a->flags = o->flags.held ? o->flags.view.buf : NULL;
    return 0;
}

static PyObject *Ring_submit(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"opcode",          "fds",   "offsets", "addrs",   "lengths",    "buf_index", "user_data",
                             "flags",           "async_min_bytes",  "enter",   "ud_base", "auto_fixed", "mem_align",
                             "off_align",       NULL};
    int opcode;
    PyObject *o_fds, *o_offs = Py_None, *o_addrs = Py_None, *o_lens = Py_None, *o_bidx = Py_None, *o_ud = Py_None,
                     *o_flags = Py_None;
    unsigned long long async_min = 0, ud_base = 0;
    PyObject *o_ud_base = Py_None;
    int enter = 1, auto_fixed = 0;
    unsigned int mem_align = 0, off_align = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOO|OOOKpOp$II", kwlist, &opcode, &o_fds, &o_offs, &o_addrs, &o_lens,
                                     &o_bidx, &o_ud, &o_flags, &async_min, &enter, &o_ud_base, &auto_fixed, &mem_align,
                                     &off_align))
        return NULL;
    if (o_ud_base != Py_None) { /* checked: a negative or oversized base must not wrap silently */
        PyObject *ix = PyNumber_Index(o_ud_base);
        if (!ix) return NULL;
        ud_base = PyLong_AsUnsignedLongLong(ix);
        Py_DECREF(ix);
        if (ud_base == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    if (opcode < OP_READ || opcode > OP_FDATASYNC) {
        PyErr_Format(PyExc_ValueError, "opcode must be OP_READ, OP_WRITE, OP_FSYNC or OP_FDATASYNC, got %d", opcode);
        return NULL;
    }
    OpArrays o;
    memset(&o, 0, sizeof o);
    SubmitArgs a;
    PyObject *ret = NULL;
    /* user_data: None means ud_base + op index */
    if (parse_ops(opcode, o_fds, o_offs, o_addrs, o_lens, o_bidx, o_ud, o_flags, &o, &a) < 0) goto done;
    if (ring_acquire(self) < 0) goto done;
    a.auto_fixed = auto_fixed && opcode <= OP_WRITE && !o.bidx.held;
    a.ud_base = ud_base;
    a.async_min_bytes = async_min;
    a.mem_align = mem_align;
    a.off_align = off_align;
    a.enter = enter;
    int r;
    if (a.n <= 64 && !enter) {
        r = do_submit(self, &a); /* no system call: not worth a GIL round trip */
    } else {
        Py_BEGIN_ALLOW_THREADS
        r = do_submit(self, &a);
        Py_END_ALLOW_THREADS
    }
    ring_release(self);
    if (r == -1) {
        PyErr_SetString(PyExc_ValueError, a.msg);
    } else if (r == -2) {
        errno = a.sys_err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        ret = PyLong_FromSsize_t(a.queued);
    }
done:
    ops_release(&o);
    return ret;
}

/* check(): submit()'s validation for a whole batch, writing nothing. */
static PyObject *Ring_check(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"opcode", "fds", "offsets", "addrs", "lengths", "buf_index", "flags", "mem_align", "off_align",
                             NULL};
    int opcode;
    PyObject *o_fds, *o_offs, *o_addrs, *o_lens, *o_bidx = Py_None, *o_flags = Py_None;
    unsigned int mem_align = 0, off_align = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOOOO|OO$II", kwlist, &opcode, &o_fds, &o_offs, &o_addrs, &o_lens, &o_bidx,
                                     &o_flags, &mem_align, &off_align))
        return NULL;
    if (opcode != OP_READ && opcode != OP_WRITE) {
        PyErr_Format(PyExc_ValueError, "check() takes OP_READ or OP_WRITE, got %d", opcode);
        return NULL;
    }
    OpArrays o;
    memset(&o, 0, sizeof o);
    SubmitArgs a;
    PyObject *ret = NULL;
    if (parse_ops(opcode, o_fds, o_offs, o_addrs, o_lens, o_bidx, Py_None, o_flags, &o, &a) < 0) goto done;
    if (ring_acquire(self) < 0) goto done;
    a.mem_align = mem_align;
    a.off_align = off_align;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = validate_ops(self, &a);
    Py_END_ALLOW_THREADS
    ring_release(self);
    if (r < 0)
        PyErr_SetString(PyExc_ValueError, a.msg);
    else
        ret = Py_NewRef(Py_None);
done:
    ops_release(&o);
    return ret;
}

static PyObject *Ring_flush(RingObject *self, PyObject *unused) {
    if (ring_acquire(self) < 0) return NULL;
    int r = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        unsigned pending = sq_pending(self);
        if (!pending) {
            r = 0;
            break;
        }
        r = sys_enter(self->ring_fd, pending, 0, 0, NULL, 0);
        if (r != -EINTR) break;
    }
    Py_END_ALLOW_THREADS
    ring_release(self);
    if (r < 0 && r != -EAGAIN && r != -EBUSY) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLong(sq_pending(self));
}

/* cancel(user_data: uint64[]) -> n submitted: one IORING_OP_ASYNC_CANCEL per op, matched by its
 * user_data. Best effort: a pipe or socket read is cancelled (its CQE says -ECANCELED), block I/O
 * usually is not; either way the op's own CQE still arrives and only it ends the op. The cancel
 * ops' CQEs carry CANCEL_USER_DATA and are dropped by reap; in flight stays <= SQ entries and the
 * CQ is twice that, so they cannot overflow it. */
static PyObject *Ring_cancel(RingObject *self, PyObject *o_ud) {
    Arr ud;
    if (arr_get(o_ud, &ud, "user_data", 8, "LQ", 0, 0) < 0) return NULL;
    if (ring_acquire(self) < 0) {
        arr_release(&ud);
        return NULL;
    }
    const uint64_t *u = ud.view.buf;
    Py_ssize_t n = arr_len(&ud), k = 0;
    if (self->cancel_supported) {
        unsigned room = self->sq_entries - sq_pending(self), tail = *self->sq_tail;
        for (; k < n && (unsigned)k < room; k++) {
            struct umbp_sqe *sqe = &self->sqes[(tail + (unsigned)k) & *self->sq_mask];
            memset(sqe, 0, sizeof *sqe);
            sqe->opcode = UMBP_OP_ASYNC_CANCEL;
            sqe->fd = -1;
            sqe->addr = u[k];
            sqe->user_data = CANCEL_USER_DATA;
        }
        if (k) {
            store_release(self->sq_tail, tail + (unsigned)k);
            int r;
            Py_BEGIN_ALLOW_THREADS
            do r = sys_enter(self->ring_fd, sq_pending(self), 0, 0, NULL, 0);
            while (r == -EINTR);
            Py_END_ALLOW_THREADS
        }
    }
    ring_release(self);
    arr_release(&ud);
    return PyLong_FromSsize_t(k);
}

/* reap(): copy ready CQEs into the arrays, non-blocking; no system call on the common path. */
static PyObject *Ring_reap(RingObject *self, PyObject *args) {
    PyObject *o_ud, *o_res;
    if (!PyArg_ParseTuple(args, "OO", &o_ud, &o_res)) return NULL;
    Arr ud, res;
    ud.held = res.held = 0;
    PyObject *ret = NULL;
    if (arr_get(o_ud, &ud, "out_user_data", 8, "LQ", 1, 0) < 0 || arr_get(o_res, &res, "out_res", 4, "i", 1, 0) < 0)
        goto done;
    Py_ssize_t cap = arr_len(&ud) < arr_len(&res) ? arr_len(&ud) : arr_len(&res);
    if (ring_acquire(self) < 0) goto done;
    uint64_t *out_ud = ud.view.buf;
    int32_t *out_res = res.view.buf;
    Py_ssize_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        unsigned head = *self->cq_head, tail = load_acquire(self->cq_tail), mask = *self->cq_mask;
        while (head != tail && n < cap) {
            const struct umbp_cqe *c = &self->cqes[head & mask];
            if (c->user_data != CANCEL_USER_DATA) {
                out_ud[n] = c->user_data;
                out_res[n] = c->res;
                n++;
                self->inflight--;
            }
            head++;
        }
        store_release(self->cq_head, head);
        /* Overflowed CQEs wait in the kernel until an enter flushes them (never expected:
         * in flight is bounded by the CQ size). */
        if (n || !(load_acquire(self->sq_flags) & UMBP_SQ_CQ_OVERFLOW)) break;
        Py_BEGIN_ALLOW_THREADS
        sys_enter(self->ring_fd, 0, 0, UMBP_ENTER_GETEVENTS, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    ring_release(self);
    ret = PyLong_FromSsize_t(n);
done:
    arr_release(&ud);
    arr_release(&res);
    return ret;
}

/* reap_batches(batches: dict) -> (n, touched, odd): reap ready CQEs and complete them in place.
 *
 * user_data = (slot << 32) | op index; batches maps slot -> an object with int64 arrays
 * ``done`` (writable) and ``lens``. An op whose result equals what it still had to move
 * (lens[i] - done[i]) is finished here: done[i] = lens[i]. Anything else (short, error) is
 * left untouched and reported in ``odd`` as (batch, index, res) for the engine's policy.
 * ``touched`` lists (batch, ops finished here) for every batch that got a CQE. CQEs of slots
 * not in the dict are dropped (their batch is gone). Non-blocking; no system call on the
 * common path. At most REAP_MAX_BATCHES distinct batches per call (the rest stays queued).
 */
#define REAP_MAX_BATCHES 64
typedef struct {
    uint64_t slot;
    PyObject *batch; /* a strong reference: attribute lookups and allocations may run Python code
                      * that removes the batch from the dict */
    Py_buffer done, lens;
    int ok; /* 0: arrays unusable, every CQE of this batch goes to odd */
    Py_ssize_t nfull;
} ReapEntry;

static int is_int64(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return v->itemsize == 8 && (f[0] == 'q' || f[0] == 'l') && f[1] == 0;
}

/* Takes a new reference to batch; an unusable batch (ok = 0) is not an error. */
static void reap_entry_init(ReapEntry *e, PyObject *batch, uint64_t slot) {
    static PyObject *s_done = NULL, *s_lens = NULL;
    if (!s_done) s_done = PyUnicode_InternFromString("done");
    if (!s_lens) s_lens = PyUnicode_InternFromString("lens");
    e->slot = slot;
    Py_INCREF(batch);
    e->batch = batch;
    e->nfull = 0;
    e->ok = 0;
    PyObject *d = PyObject_GetAttr(batch, s_done);
    PyObject *l = d ? PyObject_GetAttr(batch, s_lens) : NULL;
    if (!d || !l) {
        Py_XDECREF(d);
        PyErr_Clear();
        return;
    }
    int got_d = PyObject_GetBuffer(d, &e->done, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0;
    int got_l = got_d && PyObject_GetBuffer(l, &e->lens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0;
    Py_DECREF(d);
    Py_DECREF(l);
    if (!got_l) {
        if (got_d) PyBuffer_Release(&e->done);
        PyErr_Clear();
        return;
    }
    if (!is_int64(&e->done) || !is_int64(&e->lens) || e->done.len != e->lens.len) {
        PyBuffer_Release(&e->done);
        PyBuffer_Release(&e->lens);
        return;
    }
    e->ok = 1;
}

static PyObject *Ring_reap_batches(RingObject *self, PyObject *batches) {
    if (!PyDict_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "reap_batches takes a dict slot -> batch");
        return NULL;
    }
    if (ring_acquire(self) < 0) return NULL;
    ReapEntry ents[REAP_MAX_BATCHES];
    int nents = 0;
    PyObject *odd = NULL, *touched = NULL, *ret = NULL;
    Py_ssize_t n = 0;
    int last = -1, err = 0;
    for (int pass = 0; pass < 2; pass++) {
        unsigned head = *self->cq_head, tail = load_acquire(self->cq_tail), mask = *self->cq_mask;
        while (head != tail) {
            const struct umbp_cqe *c = &self->cqes[head & mask];
            uint64_t u = c->user_data;
            if (u == CANCEL_USER_DATA) {
                head++;
                continue;
            }
            uint64_t slot = u >> 32, idx = u & 0xFFFFFFFFULL;
            int k = -1;
            if (last >= 0 && ents[last].slot == slot) {
                k = last;
            } else {
                for (int j = 0; j < nents; j++)
                    if (ents[j].slot == slot) {
                        k = j;
                        break;
                    }
            }
            if (k < 0) {
                PyObject *key = PyLong_FromUnsignedLongLong(slot);
                if (!key) {
                    err = 1;
                    break;
                }
                PyObject *b = PyDict_GetItemWithError(batches, key);
                Py_DECREF(key);
                if (!b) {
                    if (PyErr_Occurred()) {
                        err = 1;
                        break;
                    }
                    head++; /* its batch is gone */
                    n++;
                    self->inflight--;
                    continue;
                }
                if (nents == REAP_MAX_BATCHES) break; /* the rest on the next call */
                k = nents++;
                reap_entry_init(&ents[k], b, slot);
            }
            last = k;
            ReapEntry *e = &ents[k];
            int32_t res = c->res;
            int handled = 0;
            if (e->ok && idx < (uint64_t)(e->done.len / 8)) {
                int64_t *done = e->done.buf;
                const int64_t *lens = e->lens.buf;
                if (done[idx] >= 0 && (int64_t)res == lens[idx] - done[idx]) {
                    done[idx] = lens[idx];
                    e->nfull++;
                    handled = 1;
                }
            }
            if (!handled) { /* this CQE stays in the ring if it cannot be reported */
                PyObject *t = NULL;
                if ((!odd && !(odd = PyList_New(0))) ||
                    !(t = Py_BuildValue("(OKi)", e->batch, (unsigned long long)idx, (int)res)) || PyList_Append(odd, t) < 0) {
                    Py_XDECREF(t);
                    err = 1;
                    break;
                }
                Py_DECREF(t);
            }
            head++;
            n++;
            self->inflight--;
        }
        store_release(self->cq_head, head);
        if (err) {
            /* The CQE that failed stays in the ring. Those consumed before it already changed
             * done[] and inflight: report them (the error comes back on the next call, with
             * nothing consumed) rather than lose their counts and odd results. */
            if (!n) goto fail;
            PyErr_Clear();
            break;
        }
        if (n || !(load_acquire(self->sq_flags) & UMBP_SQ_CQ_OVERFLOW)) break;
        Py_BEGIN_ALLOW_THREADS
        sys_enter(self->ring_fd, 0, 0, UMBP_ENTER_GETEVENTS, NULL, 0);
        Py_END_ALLOW_THREADS
    }
    if (!(touched = PyList_New(nents))) goto fail;
    for (int j = 0; j < nents; j++) {
        PyObject *t = Py_BuildValue("(On)", ents[j].batch, ents[j].nfull);
        if (!t) goto fail;
        PyList_SET_ITEM(touched, j, t);
    }
    ret = Py_BuildValue("(nOO)", n, touched, odd ? odd : Py_None);
fail:
    /* Only building the result can fail after CQEs were consumed (no memory for the lists). */
    for (int j = 0; j < nents; j++) {
        if (ents[j].ok) {
            PyBuffer_Release(&ents[j].done);
            PyBuffer_Release(&ents[j].lens);
        }
        Py_DECREF(ents[j].batch);
    }
    Py_XDECREF(touched);
    Py_XDECREF(odd);
    ring_release(self);
    return ret;
}

/* wait(min_complete=1, timeout_s=None) -> CQEs ready; blocks without the GIL. */
static PyObject *Ring_wait(RingObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"min_complete", "timeout_s", NULL};
    unsigned int min_complete = 1;
    PyObject *o_timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|IO", kwlist, &min_complete, &o_timeout)) return NULL;
    double timeout_s = -1;
    if (o_timeout != Py_None) {
        timeout_s = PyFloat_AsDouble(o_timeout);
        if (timeout_s == -1 && PyErr_Occurred()) return NULL;
        if (timeout_s < 0 || timeout_s != timeout_s) {
            PyErr_Format(PyExc_ValueError, "timeout_s must be >= 0 or None, got %R", o_timeout);
            return NULL;
        }
    }
    if (ring_acquire(self) < 0) return NULL;
    /* Waiting for more than can ever complete would block forever. */
    if (min_complete > self->inflight) min_complete = self->inflight;
    int r = 0;
    for (;;) {
        unsigned ready = load_acquire(self->cq_tail) - *self->cq_head;
        if (ready >= min_complete) break;
        Py_BEGIN_ALLOW_THREADS
        if (timeout_s >= 0 && (self->features & UMBP_FEAT_EXT_ARG)) {
            struct umbp_timespec ts = {(int64_t)timeout_s, (long long)((timeout_s - (int64_t)timeout_s) * 1e9)};
            struct umbp_getevents_arg arg = {0, 0, 0, (uint64_t)(uintptr_t)&ts};
            r = sys_enter(self->ring_fd, 0, min_complete - ready, UMBP_ENTER_GETEVENTS | UMBP_ENTER_EXT_ARG, &arg,
                          sizeof arg);
        } else {
            r = sys_enter(self->ring_fd, 0, min_complete - ready, UMBP_ENTER_GETEVENTS, NULL, 0);
        }
        Py_END_ALLOW_THREADS
        if (r == -EINTR) {
            if (PyErr_CheckSignals() < 0) {
                ring_release(self);
                return NULL;
            }
            continue;
        }
        break;
    }
    ring_release(self);
    if (r < 0 && r != -ETIME && r != -EINTR) {
        errno = -r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLong(load_acquire(self->cq_tail) - *self->cq_head);
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

static PyObject *Ring_register_buffers(RingObject *self, PyObject *ranges) {
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

static PyObject *Ring_unregister_buffers(RingObject *self, PyObject *unused) {
    return ring_unregister(self, UMBP_UNREGISTER_BUFFERS, &self->nbufs, ring_forget_buffers);
}

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

/* ------------------------------------------------------------------ crc32c */

static PyObject *mod_crc32c(PyObject *mod, PyObject *args, PyObject *kwds) {
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
static PyObject *mod_crc32c_many(PyObject *mod, PyObject *args) {
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
static PyObject *mod_crc32c_impl(PyObject *mod, PyObject *unused) {
    return PyUnicode_FromString(umbp_crc32c_impl_name(umbp_crc32c_impl()));
}

static PyObject *mod_crc32c_impls(PyObject *mod, PyObject *unused) {
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

/* ------------------------------------------------------------------ probe */

static PyObject *mod_probe(PyObject *mod, PyObject *unused) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    struct umbp_params p;
    int fd, err = 0;
    unsigned flags = 0;
    struct umbp_probe *pr = calloc(1, sizeof *pr);
    int probed = 0;
    Py_BEGIN_ALLOW_THREADS
    fd = try_setup(4, UMBP_SETUP_SUBMIT_ALL | UMBP_SETUP_COOP_TASKRUN, &p);
    if (fd == -EINVAL) fd = try_setup(4, 0, &p);
    if (fd < 0) err = -fd;
    else {
        flags = p.flags;
        probed = pr && sys_register(fd, UMBP_REGISTER_PROBE, pr, 256) >= 0;
        close(fd);
    }
    Py_END_ALLOW_THREADS
    struct utsname u;
    const char *kernel = uname(&u) == 0 ? u.release : "";
    PyObject *ops = PyDict_New();
    static const struct {
        const char *name;
        int op;
    } names[] = {{"read", UMBP_OP_READ},   {"write", UMBP_OP_WRITE}, {"read_fixed", UMBP_OP_READ_FIXED},
                 {"write_fixed", UMBP_OP_WRITE_FIXED}, {"fsync", UMBP_OP_FSYNC}, {"async_cancel", UMBP_OP_ASYNC_CANCEL}};
    for (size_t i = 0; ops && i < sizeof names / sizeof names[0]; i++) {
        int ok = probed && names[i].op < pr->ops_len && (pr->ops[names[i].op].flags & 1);
        PyDict_SetItemString(ops, names[i].name, ok ? Py_True : Py_False);
    }
    free(pr);
    PyObject *items[][2] = {
        {PyUnicode_FromString("ring"), PyBool_FromLong(fd >= 0)},
        {PyUnicode_FromString("errno"), PyLong_FromLong(err)},
        {PyUnicode_FromString("error"), PyUnicode_FromString(err ? strerror(err) : "")},
        {PyUnicode_FromString("features"), PyLong_FromUnsignedLong(fd >= 0 ? p.features : 0)},
        {PyUnicode_FromString("setup_flags"), PyLong_FromUnsignedLong(flags)},
        {PyUnicode_FromString("ext_arg"), PyBool_FromLong(fd >= 0 && (p.features & UMBP_FEAT_EXT_ARG))},
        {PyUnicode_FromString("nodrop"), PyBool_FromLong(fd >= 0 && (p.features & UMBP_FEAT_NODROP))},
        {PyUnicode_FromString("submit_all"), PyBool_FromLong(!!(flags & UMBP_SETUP_SUBMIT_ALL))},
        {PyUnicode_FromString("coop_taskrun"), PyBool_FromLong(!!(flags & UMBP_SETUP_COOP_TASKRUN))},
        {PyUnicode_FromString("sse42"), PyBool_FromLong(umbp_crc32c_hw_available())},
        {PyUnicode_FromString("crc32c"), PyUnicode_FromString(umbp_crc32c_impl_name(umbp_crc32c_impl()))},
        {PyUnicode_FromString("kernel"), PyUnicode_FromString(kernel)},
        {PyUnicode_FromString("ops"), ops},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) {
        if (!items[i][0] || !items[i][1] || PyDict_SetItem(d, items[i][0], items[i][1]) < 0) bad = 1;
        Py_XDECREF(items[i][0]);
        Py_XDECREF(items[i][1]);
    }
    if (bad) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyMethodDef module_methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))mod_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data | (address, nbytes), seed=0, force_table=False, impl=None) -> int; chainable via seed; GIL "
     "released; impl names one implementation (see crc32c_impls())"},
    {"crc32c_many", (PyCFunction)mod_crc32c_many, METH_VARARGS,
     "crc32c_many(addrs uint64[], lengths int64[], out uint32[]) -> n; one CRC per range, GIL released"},
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
