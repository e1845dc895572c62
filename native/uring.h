/* The io_uring kernel ABI (as much as _uring uses) and the CRC32C entry points.
 *
 * The ABI is restated here instead of including <linux/io_uring.h> so the extension builds
 * against old kernel headers too (only gcc and Python headers are required); the layouts are
 * fixed by the kernel's UAPI and never change.
 */
#ifndef UMBP_URING_H
#define UMBP_URING_H

#include <stddef.h>
#include <stdint.h>

/* ---- syscalls: one number on every architecture of the unified table (5.1+) ---- */
#define UMBP_NR_io_uring_setup 425
#define UMBP_NR_io_uring_enter 426
#define UMBP_NR_io_uring_register 427

/* ---- setup flags ---- */
#define UMBP_SETUP_CQSIZE (1U << 3)
#define UMBP_SETUP_SUBMIT_ALL (1U << 7)   /* 5.18: one bad SQE does not stop the rest */
#define UMBP_SETUP_COOP_TASKRUN (1U << 8) /* 5.19: no IPI per completion */

/* ---- features ---- */
#define UMBP_FEAT_SINGLE_MMAP (1U << 0)
#define UMBP_FEAT_NODROP (1U << 1)
#define UMBP_FEAT_EXT_ARG (1U << 8)

/* ---- enter flags ---- */
#define UMBP_ENTER_GETEVENTS (1U << 0)
#define UMBP_ENTER_EXT_ARG (1U << 3)

/* ---- sq ring flags ---- */
#define UMBP_SQ_CQ_OVERFLOW (1U << 1)

/* ---- sqe flags ---- */
#define UMBP_SQE_FIXED_FILE (1U << 0)
#define UMBP_SQE_IO_DRAIN (1U << 1)
#define UMBP_SQE_IO_LINK (1U << 2)
#define UMBP_SQE_IO_HARDLINK (1U << 3)
#define UMBP_SQE_ASYNC (1U << 4)

/* ---- opcodes ---- */
#define UMBP_OP_NOP 0
#define UMBP_OP_FSYNC 3
#define UMBP_OP_READ_FIXED 4
#define UMBP_OP_WRITE_FIXED 5
#define UMBP_OP_ASYNC_CANCEL 14
#define UMBP_OP_READ 22
#define UMBP_OP_WRITE 23

#define UMBP_FSYNC_DATASYNC (1U << 0)
#define UMBP_ASYNC_CANCEL_ANY (1U << 2) /* 5.19 */

/* ---- register opcodes ---- */
#define UMBP_REGISTER_BUFFERS 0
#define UMBP_UNREGISTER_BUFFERS 1
#define UMBP_REGISTER_FILES 2
#define UMBP_UNREGISTER_FILES 3
#define UMBP_REGISTER_EVENTFD 4
#define UMBP_UNREGISTER_EVENTFD 5
#define UMBP_REGISTER_PROBE 8

/* ---- mmap offsets ---- */
#define UMBP_OFF_SQ_RING 0ULL
#define UMBP_OFF_CQ_RING 0x8000000ULL
#define UMBP_OFF_SQES 0x10000000ULL

struct umbp_sqe {
    uint8_t opcode;
    uint8_t flags;
    uint16_t ioprio;
    int32_t fd;
    uint64_t off;
    uint64_t addr;
    uint32_t len;
    uint32_t op_flags; /* rw_flags / fsync_flags / cancel_flags */
    uint64_t user_data;
    uint16_t buf_index;
    uint16_t personality;
    int32_t file_index;
    uint64_t addr3;
    uint64_t pad2;
};

struct umbp_cqe {
    uint64_t user_data;
    int32_t res;
    uint32_t flags;
};

struct umbp_sqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
    uint64_t user_addr;
};

struct umbp_cqring_offsets {
    uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
    uint64_t user_addr;
};

struct umbp_params {
    uint32_t sq_entries;
    uint32_t cq_entries;
    uint32_t flags;
    uint32_t sq_thread_cpu;
    uint32_t sq_thread_idle;
    uint32_t features;
    uint32_t wq_fd;
    uint32_t resv[3];
    struct umbp_sqring_offsets sq_off;
    struct umbp_cqring_offsets cq_off;
};

struct umbp_getevents_arg {
    uint64_t sigmask;
    uint32_t sigmask_sz;
    uint32_t pad;
    uint64_t ts;
};

struct umbp_timespec {
    int64_t tv_sec;
    long long tv_nsec;
};

struct umbp_probe_op {
    uint8_t op;
    uint8_t resv;
    uint16_t flags; /* bit 0: supported */
    uint32_t resv2;
};

struct umbp_probe {
    uint8_t last_op;
    uint8_t ops_len;
    uint16_t resv;
    uint32_t resv2[3];
    struct umbp_probe_op ops[256];
};

struct umbp_iovec {
    void *base;
    size_t len;
};

_Static_assert(sizeof(struct umbp_sqe) == 64, "io_uring sqe is 64 bytes");
_Static_assert(sizeof(struct umbp_cqe) == 16, "io_uring cqe is 16 bytes");
_Static_assert(sizeof(struct umbp_params) == 120, "io_uring_params is 120 bytes");
_Static_assert(sizeof(struct umbp_getevents_arg) == 24, "io_uring_getevents_arg is 24 bytes");

/* ---- CRC32C (Castagnoli), crc32c.c ---- */

/* Chainable: crc of a||b == umbp_crc32c(umbp_crc32c(0, a), b). force_table skips SSE4.2. */
uint32_t umbp_crc32c(uint32_t crc, const void *buf, size_t len, int force_table);
int umbp_crc32c_hw_available(void);

#endif
