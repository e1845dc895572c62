/* CRC32C implementations and their runtime dispatch (crc32c.c). The generic entry points stay in uring.h. */
#ifndef UMBP_CRC32C_H
#define UMBP_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* In dispatch order, lowest first: the best one the CPU supports wins, UMBP_CRC32C_IMPL caps it. */
enum {
    UMBP_CRC32C_TABLE,
    UMBP_CRC32C_SSE42,
    UMBP_CRC32C_PCLMUL,
    UMBP_CRC32C_VPCLMUL256, /* AVX2 + VPCLMULQDQ on ymm: Zen 3, Alder Lake and later clients (no AVX-512) */
    UMBP_CRC32C_VPCLMUL,    /* AVX-512 VPCLMULQDQ on zmm */
    UMBP_CRC32C_NIMPL
};

/* The x86_64 paths; -DUMBP_CRC32C_PORTABLE builds the table alone (how the non-x86 build is checked here). */
#if defined(__x86_64__) && !defined(UMBP_CRC32C_PORTABLE)
#define UMBP_CRC32C_X86 1
#else
#define UMBP_CRC32C_X86 0
#endif

/* VPCLMULQDQ intrinsics need gcc >= 8 or clang >= 6. */
#if UMBP_CRC32C_X86 && ((defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && __GNUC__ >= 8))
#define UMBP_HAVE_VPCLMUL 1
#else
#define UMBP_HAVE_VPCLMUL 0
#endif

int umbp_crc32c_impl(void);                      /* the dispatched implementation */
const char *umbp_crc32c_impl_name(int impl);     /* NULL when out of range */
int umbp_crc32c_impl_index(const char *name);    /* -1 when unknown */
int umbp_crc32c_impl_supported(int impl);        /* this CPU (and build) can run it */
/* One implementation, whatever the dispatch chose; impl must be supported. Chainable through crc. */
uint32_t umbp_crc32c_with(int impl, uint32_t crc, const void *buf, size_t len);

#endif
