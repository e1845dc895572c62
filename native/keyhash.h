/* A key's bytes and its 64-bit keyed hash, shared by KeyIndex (keyindex.c) and HashSet (hashset.c):
 * a follower's set must probe with exactly the hash the writer's table uses, so there is one copy. */
#ifndef UMBP_KEYHASH_H
#define UMBP_KEYHASH_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEYHASH_TOP (1ULL << 63) /* set in every hash, so 0 never is one */

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fmix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

/* mask: all ones but for tests that narrow KeyIndex's hashes to force collisions */
static inline uint64_t key_hash(uint64_t seed, uint64_t mask, const char *p, size_t n) {
    const uint64_t k1 = 0x9e3779b97f4a7c15ULL, k2 = 0xc2b2ae3d27d4eb4fULL;
    uint64_t h = seed ^ (n * k1);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = rotl(h ^ (w * k2), 31) * k1;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, n - i);
    h = rotl(h ^ (w * k2), 29) * k1;
    return (fmix(h) & mask) | KEYHASH_TOP;
}

/* The key's bytes: ASCII strs in place, others through surrogateescape with the round trip
 * keybytes.encode_key insists on. 0 with *owner set (or NULL) on success; -1 when the key has no
 * byte form (not a str, or ambiguous): a miss for lookups, an error for inserts (err set). */
static inline int key_bytes(PyObject *key, const char **p, Py_ssize_t *n, PyObject **owner, int err) {
    *owner = NULL;
    if (PyUnicode_CheckExact(key)) {
        if (PyUnicode_IS_ASCII(key)) {
            *p = (const char *)PyUnicode_DATA(key);
            *n = PyUnicode_GET_LENGTH(key);
            return *n ? 0 : (err ? (PyErr_SetString(PyExc_ValueError, "empty key"), -1) : -1);
        }
        PyObject *b = PyUnicode_AsEncodedString(key, "utf-8", "surrogateescape");
        if (b == NULL) goto bad;
        PyObject *back = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), "surrogateescape");
        int same = back != NULL && PyUnicode_Compare(back, key) == 0;
        Py_XDECREF(back);
        if (!same) {
            Py_DECREF(b);
            goto bad;
        }
        *owner = b;
        *p = PyBytes_AS_STRING(b);
        *n = PyBytes_GET_SIZE(b);
        return 0;
    }
    if (err && PyBytes_CheckExact(key)) { /* index scans load bytes; a lookup of bytes is a miss (keys are str) */
        *p = PyBytes_AS_STRING(key);
        *n = PyBytes_GET_SIZE(key);
        return *n ? 0 : (err ? (PyErr_SetString(PyExc_ValueError, "empty key"), -1) : -1);
    }
bad:
    if (err) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "key %R has no unambiguous byte form", key);
    } else {
        PyErr_Clear();
    }
    return -1;
}

/* hashset.c: adds HashSet and hash_keys to the _keyindex module (called from its init) */
int hashset_register(PyObject *module);

#endif
