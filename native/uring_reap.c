/* Completions: copy CQEs out (reap), finish whole transfers in place (reap_batches), block for
 * them without the GIL (wait). */
#include "uring_internal.h"

/* reap(): copy ready CQEs into the arrays, non-blocking; no system call on the common path. */
PyObject *Ring_reap(RingObject *self, PyObject *args) {
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
 * (lens[i] - done[i]) is finished here: done[i] = lens[i]. A batch whose ``crc`` is a pair of
 * int64 arrays (crc_lens, crc_out) also gets, for each op finished here with
 * 0 < crc_lens[i] <= lens[i], crc_out[i] = the CRC32C of the first crc_lens[i] bytes at
 * addrs[i] (uint64): a read batch's checksums computed while the rest of it is still in flight,
 * not after the last completion. Other ops' crc_out is left as it was (the caller's sentinel). Anything else (short, error) is
 * left untouched and reported in ``odd`` as (batch, index, res) for the engine's policy.
 * ``touched`` lists (batch, ops finished here) for every batch that got a CQE. CQEs of slots
 * not in the dict are dropped (their batch is gone). Non-blocking; no system call on the
 * common path. At most REAP_MAX_BATCHES distinct batches per call (the rest stays queued).
 */
#define REAP_MAX_BATCHES 64
#define REAP_CRC_JOBS 128 /* checksums gathered, then computed without the GIL */
typedef struct {
    int64_t *out;
    const void *addr;
    size_t len;
} CrcJob;

/* The gathered checksums, the GIL released (another thread's Python runs meanwhile; the buffers
 * stay held by their entries and the ring by busy). */
static void crc_flush(CrcJob *jobs, int *n) {
    if (!*n) return;
    Py_BEGIN_ALLOW_THREADS
    for (int j = 0; j < *n; j++) *jobs[j].out = umbp_crc32c(0, jobs[j].addr, jobs[j].len, 0);
    Py_END_ALLOW_THREADS
    *n = 0;
}

typedef struct {
    uint64_t slot;
    PyObject *batch; /* a strong reference: attribute lookups and allocations may run Python code
                      * that removes the batch from the dict */
    Py_buffer done, lens;
    int ok; /* 0: arrays unusable, every CQE of this batch goes to odd */
    Py_ssize_t nfull;
    Py_buffer addrs, crc_lens, crc_out;
    int crc_ok; /* 1: the three arrays above are held and have one entry per op */
} ReapEntry;

static int is_fmt64(const Py_buffer *v, char a, char b) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return v->itemsize == 8 && (f[0] == a || f[0] == b) && f[1] == 0;
}

static int is_int64(const Py_buffer *v) { return is_fmt64(v, 'q', 'l'); }

/* The batch's optional (crc_lens, crc_out) pair and its addrs; anything unusable: no CRCs here
 * (the caller computes what crc_out does not hold). Needs e->done held (its length). */
static void reap_entry_crc(ReapEntry *e, PyObject *batch) {
    static PyObject *s_crc = NULL, *s_addrs = NULL;
    if (!s_crc) s_crc = PyUnicode_InternFromString("crc");
    if (!s_addrs) s_addrs = PyUnicode_InternFromString("addrs");
    e->crc_ok = 0;
    PyObject *c = PyObject_GetAttr(batch, s_crc);
    if (!c || c == Py_None || !PyTuple_CheckExact(c) || PyTuple_GET_SIZE(c) != 2) {
        Py_XDECREF(c);
        PyErr_Clear();
        return;
    }
    PyObject *a = PyObject_GetAttr(batch, s_addrs);
    int held = 0;
    if (a && PyObject_GetBuffer(a, &e->addrs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
        held = 1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(c, 0), &e->crc_lens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) == 0) {
            held = 2;
            if (PyObject_GetBuffer(PyTuple_GET_ITEM(c, 1), &e->crc_out,
                                   PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) == 0)
                held = 3;
        }
    }
    Py_XDECREF(a);
    Py_DECREF(c);
    PyErr_Clear();
    Py_ssize_t n = e->done.len;
    if (held == 3 && is_fmt64(&e->addrs, 'Q', 'L') && is_int64(&e->crc_lens) && is_int64(&e->crc_out) &&
        e->addrs.len == n && e->crc_lens.len == n && e->crc_out.len == n) {
        e->crc_ok = 1;
        return;
    }
    if (held >= 3) PyBuffer_Release(&e->crc_out);
    if (held >= 2) PyBuffer_Release(&e->crc_lens);
    if (held >= 1) PyBuffer_Release(&e->addrs);
}

static void reap_entry_release(ReapEntry *e) {
    if (e->crc_ok) {
        PyBuffer_Release(&e->addrs);
        PyBuffer_Release(&e->crc_lens);
        PyBuffer_Release(&e->crc_out);
    }
    if (e->ok) {
        PyBuffer_Release(&e->done);
        PyBuffer_Release(&e->lens);
    }
    Py_DECREF(e->batch);
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
    e->crc_ok = 0;
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
    reap_entry_crc(e, batch);
}

PyObject *Ring_reap_batches(RingObject *self, PyObject *batches) {
    if (!PyDict_Check(batches)) {
        PyErr_SetString(PyExc_TypeError, "reap_batches takes a dict slot -> batch");
        return NULL;
    }
    if (ring_acquire(self) < 0) return NULL;
    ReapEntry ents[REAP_MAX_BATCHES];
    int nents = 0;
    CrcJob jobs[REAP_CRC_JOBS];
    int njobs = 0;
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
                    if (e->crc_ok) { /* the whole op's bytes are in memory now */
                        int64_t cl = ((const int64_t *)e->crc_lens.buf)[idx];
                        if (cl > 0 && cl <= lens[idx]) {
                            if (njobs == REAP_CRC_JOBS) crc_flush(jobs, &njobs);
                            jobs[njobs++] = (CrcJob){(int64_t *)e->crc_out.buf + idx,
                                                     (const void *)(uintptr_t)((const uint64_t *)e->addrs.buf)[idx],
                                                     (size_t)cl};
                        }
                    }
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
    crc_flush(jobs, &njobs);
    if (!(touched = PyList_New(nents))) goto fail;
    for (int j = 0; j < nents; j++) {
        PyObject *t = Py_BuildValue("(On)", ents[j].batch, ents[j].nfull);
        if (!t) goto fail;
        PyList_SET_ITEM(touched, j, t);
    }
    ret = Py_BuildValue("(nOO)", n, touched, odd ? odd : Py_None);
fail:
    /* Only building the result can fail after CQEs were consumed (no memory for the lists). */
    for (int j = 0; j < nents; j++) reap_entry_release(&ents[j]);
    Py_XDECREF(touched);
    Py_XDECREF(odd);
    ring_release(self);
    return ret;
}

/* wait(min_complete=1, timeout_s=None) -> CQEs ready; blocks without the GIL. */
PyObject *Ring_wait(RingObject *self, PyObject *args, PyObject *kwds) {
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
