/* Submission: parse a batch's arrays, validate every op before any SQE is written, fill SQEs
 * (fixed buffers found per op, ioprio, F_ASYNC for large page-cache copies), one enter. */
#include "uring_internal.h"

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

PyObject *Ring_submit(RingObject *self, PyObject *args, PyObject *kwds) {
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
PyObject *Ring_check(RingObject *self, PyObject *args, PyObject *kwds) {
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

PyObject *Ring_flush(RingObject *self, PyObject *unused) {
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
