/* Cancelling: IORING_OP_ASYNC_CANCEL per op (best effort), and quiesce(), the bounded wait for
 * every op in flight before a ring's memory may be unmapped. */
#include "uring_internal.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
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
int quiesce(RingObject *self, double timeout_s) {
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

/* cancel(user_data: uint64[]) -> n submitted: one IORING_OP_ASYNC_CANCEL per op, matched by its
 * user_data. Best effort: a pipe or socket read is cancelled (its CQE says -ECANCELED), block I/O
 * usually is not; either way the op's own CQE still arrives and only it ends the op. The cancel
 * ops' CQEs carry CANCEL_USER_DATA and are dropped by reap; in flight stays <= SQ entries and the
 * CQ is twice that, so they cannot overflow it. */
PyObject *Ring_cancel(RingObject *self, PyObject *o_ud) {
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
