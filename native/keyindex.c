/* The writer's key -> row table (umbp_nvme/store/keymap.py): no Python object per key.
 *
 * Keys live as their bytes (UTF-8, surrogateescape: keybytes.py) in one arena; each row has one
 * uint64 reference (offset << 16 | length: keys are at most LMDB's 511 bytes). The table is open
 * addressing with linear probing; a slot holds the low 32 bits of the key's hash beside its row,
 * so a probe touches the row's key only when those bits match, then compares the full key bytes:
 * a hash collision never answers another key's row. Deletion shifts the cluster back (no
 * tombstones). The hash is seeded per table (random per store open): keys chosen to collide
 * cost probes, never a wrong answer. About 8 + 8/load bytes a key beside its bytes.
 *
 * Every method runs holding the GIL, start to end: readers on other threads (exists_many_nowait
 * on SGLang's thread) see a whole update or none of it, as they did with a dict.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY UINT64_MAX
#define ROW_MAX (UINT32_MAX - 1)
#define KEY_MAX 0xffff
#define REF_OFF(x) ((x) >> 16)
#define REF_LEN(x) ((uint32_t)((x) & 0xffff))

typedef struct {
    PyObject_HEAD
    uint64_t seed;
    uint64_t hash_mask;     /* all ones; tests narrow it to force collisions */
    uint64_t *slots;        /* (hash low 32 bits) << 32 | row; EMPTY where free */
    uint64_t cap;           /* power of two, at most 2**32 (the home is the hash's low bits) */
    uint64_t count;         /* keys mapped */
    uint64_t *ref;          /* per row: arena offset << 16 | key bytes (0: the row holds no key) */
    uint64_t nrows;         /* rows with room in ref */
    char *arena;
    uint64_t used, size, garbage;
} KeyIndex;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fmix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t key_hash(const KeyIndex *t, const char *p, size_t n) {
    const uint64_t k1 = 0x9e3779b97f4a7c15ULL, k2 = 0xc2b2ae3d27d4eb4fULL;
    uint64_t h = t->seed ^ (n * k1);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = rotl(h ^ (w * k2), 31) * k1;
    }
    uint64_t w = 0;
    memcpy(&w, p + i, n - i);
    h = rotl(h ^ (w * k2), 29) * k1;
    return fmix(h) & t->hash_mask;
}

/* The key's bytes: ASCII strs in place, others through surrogateescape with the round trip
 * keybytes.encode_key insists on. 0 with *owner set (or NULL) on success; -1 when the key has no
 * byte form (not a str, or ambiguous): a miss for lookups, an error for inserts (err set). */
static int key_bytes(PyObject *key, const char **p, Py_ssize_t *n, PyObject **owner, int err) {
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

static inline int row_is(const KeyIndex *t, uint32_t r, const char *p, Py_ssize_t n) {
    uint64_t x = t->ref[r];
    return REF_LEN(x) == (uint32_t)n && memcmp(t->arena + REF_OFF(x), p, n) == 0;
}

static inline uint32_t slot_row(uint64_t s) { return (uint32_t)s; }
static inline uint64_t slot_home(uint64_t s, uint64_t m) { return (s >> 32) & m; }

/* slot of the key, or the free slot where it would go (*found says which) */
static uint64_t probe(const KeyIndex *t, uint64_t h, const char *p, Py_ssize_t n, int *found) {
    uint64_t m = t->cap - 1, i = h & m, tag = (h & 0xffffffffULL) << 32;
    for (;;) {
        uint64_t s = t->slots[i];
        if (s == EMPTY) {
            *found = 0;
            return i;
        }
        if ((s & 0xffffffff00000000ULL) == tag && row_is(t, slot_row(s), p, n)) {
            *found = 1;
            return i;
        }
        i = (i + 1) & m;
    }
}

static inline uint64_t row_hash(const KeyIndex *t, uint32_t r) {
    return key_hash(t, t->arena + REF_OFF(t->ref[r]), REF_LEN(t->ref[r]));
}

static int resize_table(KeyIndex *t, uint64_t cap) {
    if (cap > (1ULL << 32)) return PyErr_SetString(PyExc_OverflowError, "key table over 2**32 slots"), -1;
    uint64_t *s = PyMem_RawMalloc(cap * sizeof(uint64_t));
    if (s == NULL) return PyErr_NoMemory(), -1;
    memset(s, 0xff, cap * sizeof(uint64_t));
    for (uint64_t j = 0; j < t->cap; j++) {
        uint64_t x = t->slots[j];
        if (x == EMPTY) continue;
        uint64_t i = slot_home(x, cap - 1);
        while (s[i] != EMPTY) i = (i + 1) & (cap - 1);
        s[i] = x;
    }
    PyMem_RawFree(t->slots);
    t->slots = s;
    t->cap = cap;
    return 0;
}

/* room for rows 0..rows-1: grown by a quarter (puts), or to exactly ``rows`` (an open's load) */
static int reserve_rows_as(KeyIndex *t, uint64_t rows, int exact) {
    if (rows <= t->nrows) return 0;
    if (rows > (uint64_t)ROW_MAX) return PyErr_SetString(PyExc_OverflowError, "more than 2**32-2 rows"), -1;
    uint64_t n = t->nrows;
    while (n < rows) n += n / 4 > 1024 ? n / 4 : 1024; /* by a quarter, never by nothing (a load sized it exactly) */
    if (exact) n = rows;
    uint64_t *ref = PyMem_RawRealloc(t->ref, n * 8);
    if (ref == NULL) return PyErr_NoMemory(), -1;
    t->ref = ref;
    memset(t->ref + t->nrows, 0, (n - t->nrows) * 8);
    t->nrows = n;
    return 0;
}

static int reserve_rows(KeyIndex *t, uint64_t rows) { return reserve_rows_as(t, rows, 0); }

/* Rewrite the arena without the bytes of forgotten keys (keys of every row that has one stay). */
static int compact(KeyIndex *t) {
    uint64_t live = t->used - t->garbage, size = live + live / 4 + 4096;
    char *a = PyMem_RawMalloc(size);
    if (a == NULL) return PyErr_NoMemory(), -1;
    uint64_t at = 0;
    for (uint64_t r = 0; r < t->nrows; r++) {
        uint32_t n = REF_LEN(t->ref[r]);
        if (!n) continue;
        memcpy(a + at, t->arena + REF_OFF(t->ref[r]), n);
        t->ref[r] = at << 16 | n;
        at += n;
    }
    PyMem_RawFree(t->arena);
    t->arena = a;
    t->used = at;
    t->size = size;
    t->garbage = 0;
    return 0;
}

static void remove_slot(KeyIndex *t, uint64_t i);

static void forget_row_key(KeyIndex *t, uint32_t r) {
    if (r < t->nrows && t->ref[r]) {
        t->garbage += REF_LEN(t->ref[r]);
        t->ref[r] = 0;
    }
}

/* Unmap row r's key if the table maps it to r (its slot is found from the row's own hash). */
static void unmap_row(KeyIndex *t, uint32_t r) {
    uint64_t m = t->cap - 1, i = row_hash(t, r) & m;
    for (; t->slots[i] != EMPTY; i = (i + 1) & m)
        if (slot_row(t->slots[i]) == r) {
            remove_slot(t, i);
            return;
        }
}

static int arena_put(KeyIndex *t, const char *p, Py_ssize_t n, uint64_t *off) {
    if (t->used + n > t->size) {
        if (t->garbage > (t->used >> 1) && compact(t) < 0) return -1;
        if (t->used + n > t->size) {
            uint64_t size = t->size ? t->size : 1 << 16;
            while (size < t->used + n) size += size / 4; /* large: realloc moves pages, not bytes */
            char *a = PyMem_RawRealloc(t->arena, size);
            if (a == NULL) return PyErr_NoMemory(), -1;
            t->arena = a;
            t->size = size;
        }
    }
    memcpy(t->arena + t->used, p, n);
    *off = t->used;
    t->used += n;
    return 0;
}

/* Give row r key (p, n) and map the key to r (replacing the key's earlier row, as dict[k] = r). */
static int set_one(KeyIndex *t, uint32_t r, const char *p, Py_ssize_t n) {
    if (n > KEY_MAX) return PyErr_Format(PyExc_ValueError, "key of %zd bytes (at most %d)", n, KEY_MAX), -1;
    if (reserve_rows(t, (uint64_t)r + 1) < 0) return -1;
    if ((t->count + 1) * 10 > t->cap * 7 && resize_table(t, t->cap * 2) < 0) return -1;
    uint64_t h = key_hash(t, p, n), off;
    if (t->ref[r] && !row_is(t, r, p, n)) { /* a row holds one key: its old one leaves first */
        unmap_row(t, r);
        forget_row_key(t, r);
    }
    int found;
    uint64_t i = probe(t, h, p, n, &found);
    if (found && slot_row(t->slots[i]) == r) return 0;
    if (!t->ref[r]) {
        if (arena_put(t, p, n, &off) < 0) return -1;
        t->ref[r] = off << 16 | (uint64_t)n;
    }
    if (!found) t->count++;
    t->slots[i] = (h & 0xffffffffULL) << 32 | r;
    return 0;
}

static void remove_slot(KeyIndex *t, uint64_t i) {
    uint64_t m = t->cap - 1, j = i;
    t->slots[i] = EMPTY;
    for (;;) { /* backward shift: an entry moves into the hole if its home is not between hole and it */
        j = (j + 1) & m;
        uint64_t x = t->slots[j];
        if (x == EMPTY) break;
        uint64_t home = slot_home(x, m);
        if (((j - home) & m) >= ((j - i) & m)) {
            t->slots[i] = x;
            t->slots[j] = EMPTY;
            i = j;
        }
    }
    t->count--;
}

/* --- the Python methods ------------------------------------------------------------------- */

static int get_rows_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t n, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    char last = f[0] ? f[strlen(f) - 1] : 0;
    if (view->itemsize != 8 || view->len != n * 8 || (last != 'q' && last != 'l')) {
        PyErr_Format(PyExc_ValueError, "rows must be %zd int64 values", n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *KI_lookup(KeyIndex *t, PyObject *args) {
    PyObject *keys, *out;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &keys, &out)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), hits = 0;
    Py_buffer v;
    if (get_rows_buffer(out, &v, n, 1) < 0) return NULL;
    int64_t *o = v.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        o[k] = -1;
        if (key_bytes(PyList_GET_ITEM(keys, k), &p, &len, &owner, 0) < 0) continue;
        int found;
        uint64_t i = probe(t, key_hash(t, p, len), p, len, &found);
        if (found) {
            o[k] = slot_row(t->slots[i]);
            hits++;
        }
        Py_XDECREF(owner);
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(hits);
}

static PyObject *KI_prefix(KeyIndex *t, PyObject *keys) {
    if (!PyList_Check(keys)) return PyErr_SetString(PyExc_TypeError, "keys must be a list"), NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), k = 0;
    for (; k < n; k++) {
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        if (key_bytes(PyList_GET_ITEM(keys, k), &p, &len, &owner, 0) < 0) break;
        int found;
        probe(t, key_hash(t, p, len), p, len, &found);
        Py_XDECREF(owner);
        if (!found) break;
    }
    return PyLong_FromSsize_t(k);
}

static PyObject *KI_get(KeyIndex *t, PyObject *key) {
    const char *p;
    Py_ssize_t len;
    PyObject *owner;
    if (key_bytes(key, &p, &len, &owner, 0) < 0) return PyLong_FromLong(-1);
    int found;
    uint64_t i = probe(t, key_hash(t, p, len), p, len, &found);
    Py_XDECREF(owner);
    return PyLong_FromLongLong(found ? (long long)slot_row(t->slots[i]) : -1);
}

static PyObject *KI_set_many(KeyIndex *t, PyObject *args) {
    PyObject *keys, *rows;
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &keys, &rows)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    Py_buffer v;
    if (get_rows_buffer(rows, &v, n, 0) < 0) return NULL;
    const int64_t *r = v.buf;
    PyObject *ret = Py_None;
    int64_t rmax = -1;
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++) { /* all or nothing: every key and row checked first */
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        if (r[k] < 0 || r[k] > ROW_MAX) {
            PyErr_Format(PyExc_ValueError, "row %lld out of range", (long long)r[k]);
            ret = NULL;
            break;
        }
        if (key_bytes(PyList_GET_ITEM(keys, k), &p, &len, &owner, 1) < 0) {
            ret = NULL;
            break;
        }
        Py_XDECREF(owner);
        if (len > KEY_MAX) {
            PyErr_Format(PyExc_ValueError, "key of %zd bytes (at most %d)", len, KEY_MAX);
            ret = NULL;
            break;
        }
        rmax = r[k] > rmax ? r[k] : rmax;
        total += len;
    }
    /* room for the whole batch at once (an open loads millions): one rehash, one realloc each */
    if (ret && rmax >= 0 && reserve_rows(t, (uint64_t)rmax + 1) < 0) ret = NULL;
    if (ret && t->used + total > t->size && total > 4096) {
        char *a = PyMem_RawRealloc(t->arena, t->used + total + total / 8);
        if (a == NULL) ret = PyErr_NoMemory();
        else t->arena = a, t->size = t->used + total + total / 8;
    }
    if (ret) {
        uint64_t cap = t->cap;
        while ((t->count + n) * 10 > cap * 7) cap *= 2;
        if (cap != t->cap && resize_table(t, cap) < 0) ret = NULL;
    }
    for (Py_ssize_t k = 0; ret && k < n; k++) {
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        key_bytes(PyList_GET_ITEM(keys, k), &p, &len, &owner, 1);
        if (set_one(t, (uint32_t)r[k], p, len) < 0) ret = NULL;
        Py_XDECREF(owner);
    }
    PyBuffer_Release(&v);
    Py_XINCREF(ret);
    return ret;
}

static PyObject *KI_discard(KeyIndex *t, PyObject *args) {
    PyObject *key;
    long long row = -1;
    if (!PyArg_ParseTuple(args, "O|L", &key, &row)) return NULL;
    const char *p;
    Py_ssize_t len;
    PyObject *owner;
    if (key_bytes(key, &p, &len, &owner, 0) < 0) Py_RETURN_FALSE;
    int found;
    uint64_t i = probe(t, key_hash(t, p, len), p, len, &found);
    Py_XDECREF(owner);
    if (!found || (row >= 0 && slot_row(t->slots[i]) != (uint64_t)row)) Py_RETURN_FALSE;
    remove_slot(t, i);
    Py_RETURN_TRUE;
}

static PyObject *key_str(const KeyIndex *t, uint32_t r) {
    return PyUnicode_DecodeUTF8(t->arena + REF_OFF(t->ref[r]), REF_LEN(t->ref[r]), "surrogateescape");
}

static PyObject *KI_key(KeyIndex *t, PyObject *arg) {
    long long r = PyLong_AsLongLong(arg);
    if (r == -1 && PyErr_Occurred()) return NULL;
    if (r < 0 || (uint64_t)r >= t->nrows || !t->ref[r]) Py_RETURN_NONE;
    return key_str(t, (uint32_t)r);
}

static PyObject *KI_key_bytes(KeyIndex *t, PyObject *arg) {
    long long r = PyLong_AsLongLong(arg);
    if (r == -1 && PyErr_Occurred()) return NULL;
    if (r < 0 || (uint64_t)r >= t->nrows || !t->ref[r]) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(t->arena + REF_OFF(t->ref[r]), REF_LEN(t->ref[r]));
}

static PyObject *KI_forget(KeyIndex *t, PyObject *arg) {
    long long r = PyLong_AsLongLong(arg);
    if (r == -1 && PyErr_Occurred()) return NULL;
    if (r >= 0 && (uint64_t)r < t->nrows && t->ref[r]) {
        unmap_row(t, (uint32_t)r); /* a row still mapped leaves the table with its key */
        forget_row_key(t, (uint32_t)r);
    }
    Py_RETURN_NONE;
}

static PyObject *KI_mapped(KeyIndex *t, PyObject *args) {
    Py_ssize_t limit = -1;
    if (!PyArg_ParseTuple(args, "|n", &limit)) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    /* row order: put order within a session, the index's order after an open (as the dict's was) */
    for (uint64_t r = 0; r < t->nrows && (limit < 0 || PyList_GET_SIZE(out) < limit); r++) {
        if (!t->ref[r]) continue;
        int found;
        uint64_t i = probe(t, row_hash(t, (uint32_t)r), t->arena + REF_OFF(t->ref[r]), REF_LEN(t->ref[r]), &found);
        if (!found || slot_row(t->slots[i]) != r) continue;
        PyObject *s = key_str(t, (uint32_t)r);
        if (s == NULL || PyList_Append(out, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(s);
    }
    return out;
}

/* load(lens, blob): rows 0..n-1 hold the packed keys (uint16 lengths, bytes back to back), each
 * mapped to its row; into an empty table only. No Python object per key. */
static PyObject *KI_load(KeyIndex *t, PyObject *args) {
    Py_buffer lv, bv;
    if (!PyArg_ParseTuple(args, "y*y*", &lv, &bv)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = lv.len / 2;
    const uint16_t *l = lv.buf;
    const char *b = bv.buf;
    uint64_t total = 0, cap = t->cap;
    if (t->count || t->used) {
        PyErr_SetString(PyExc_ValueError, "load into an empty table only");
        goto out;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!l[k]) {
            PyErr_Format(PyExc_ValueError, "packed key %zd is empty", k);
            goto out;
        }
        total += l[k];
    }
    if (total != (uint64_t)bv.len || lv.len % 2) {
        PyErr_Format(PyExc_ValueError, "packed keys: lengths sum to %llu, %zd bytes given",
                     (unsigned long long)total, bv.len);
        goto out;
    }
    while ((uint64_t)n * 10 > cap * 7) cap *= 2;
    if (reserve_rows_as(t, n, 1) < 0 || (cap != t->cap && resize_table(t, cap) < 0)) goto out;
    char *a = PyMem_RawRealloc(t->arena, total + total / 64 + 16);
    if (a == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    t->arena = a;
    t->size = total + total / 64 + 16;
    /* keys strictly ascending (an index scan's) are distinct: each goes to the first free slot of
     * its probe, no key compared; hashes first, so the slot of a key further on is prefetched */
    if (n == 0) {
        ret = PyLong_FromLong(0);
        goto out;
    }
    int ascending = 1;
    for (Py_ssize_t k = 1, at = l[0]; ascending && k < n; at += l[k], k++) {
        int c = memcmp(b + at - l[k - 1], b + at, l[k - 1] < l[k] ? l[k - 1] : l[k]);
        ascending = c < 0 || (c == 0 && l[k - 1] < l[k]);
    }
    if (!ascending) {
        for (Py_ssize_t k = 0; k < n; k++) {
            if (set_one(t, (uint32_t)k, b, l[k]) < 0) goto out;
            b += l[k];
        }
        ret = PyLong_FromSsize_t(t->count);
        goto out;
    }
    uint64_t *h = PyMem_RawMalloc((n ? n : 1) * sizeof(uint64_t));
    if (h == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t k = 0, at = 0; k < n; at += l[k], k++) h[k] = key_hash(t, b + at, l[k]);
    memcpy(t->arena, b, total);
    t->used = total;
    uint64_t m = t->cap - 1;
    for (Py_ssize_t k = 0, at = 0; k < n; at += l[k], k++) {
        if (k + 16 < n) __builtin_prefetch(&t->slots[h[k + 16] & m], 1);
        uint64_t i = h[k] & m;
        while (t->slots[i] != EMPTY) i = (i + 1) & m;
        t->slots[i] = (h[k] & 0xffffffffULL) << 32 | (uint64_t)k;
        t->ref[k] = (uint64_t)at << 16 | l[k];
    }
    t->count = n;
    PyMem_RawFree(h);
    ret = PyLong_FromSsize_t(t->count);
out:
    PyBuffer_Release(&lv);
    PyBuffer_Release(&bv);
    return ret;
}

static PyObject *KI_nbytes(KeyIndex *t, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(t->cap * 8 + t->nrows * 8 + t->size);
}

static PyObject *KI_narrow(KeyIndex *t, PyObject *arg) {
    /* tests: keep only the low bits of every hash, so distinct keys collide (never to be used otherwise) */
    int bits = PyLong_AsLong(arg);
    if (bits == -1 && PyErr_Occurred()) return NULL;
    if (t->count) return PyErr_SetString(PyExc_ValueError, "narrow an empty table only"), NULL;
    t->hash_mask = bits >= 64 ? UINT64_MAX : ((1ULL << bits) - 1);
    Py_RETURN_NONE;
}

static Py_ssize_t KI_len(KeyIndex *t) { return (Py_ssize_t)t->count; }

static int KI_init(KeyIndex *t, PyObject *args, PyObject *kwds) {
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "K", &seed)) return -1;
    t->seed = seed;
    t->hash_mask = UINT64_MAX;
    if (t->slots == NULL) {
        t->cap = 1024;
        t->slots = PyMem_RawMalloc(t->cap * 8);
        if (t->slots == NULL) return PyErr_NoMemory(), -1;
        memset(t->slots, 0xff, t->cap * 8);
    }
    return 0;
}

static void KI_dealloc(KeyIndex *t) {
    PyMem_RawFree(t->slots);
    PyMem_RawFree(t->ref);
    PyMem_RawFree(t->arena);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

/* --- module functions: an index scan straight from the mapped file (index_check.py) ------- */

static int int64_view(PyObject *obj, Py_buffer *v, const char *what) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = v->format ? v->format : "B";
    char last = f[0] ? f[strlen(f) - 1] : 0;
    if (v->itemsize != 8 || (last != 'q' && last != 'l')) {
        PyBuffer_Release(v);
        PyErr_Format(PyExc_ValueError, "%s must be int64", what);
        return -1;
    }
    return 0;
}

/* gather(buf, offsets, lengths): the byte ranges back to back, as one bytes object */
static PyObject *mod_gather(PyObject *mod, PyObject *args) {
    PyObject *bo, *oo, *lo;
    if (!PyArg_ParseTuple(args, "OOO", &bo, &oo, &lo)) return NULL;
    Py_buffer b, o, l;
    if (PyObject_GetBuffer(bo, &b, PyBUF_SIMPLE) < 0) return NULL;
    if (int64_view(oo, &o, "offsets") < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    if (int64_view(lo, &l, "lengths") < 0) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&o);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t n = o.len / 8;
    const int64_t *off = o.buf, *len = l.buf;
    uint64_t total = 0;
    if (l.len != o.len) {
        PyErr_SetString(PyExc_ValueError, "offsets and lengths differ in count");
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (off[k] < 0 || len[k] < 0 || off[k] + len[k] > b.len) {
            PyErr_Format(PyExc_ValueError, "range %zd (%lld, %lld) is outside the buffer", k, (long long)off[k],
                         (long long)len[k]);
            goto done;
        }
        total += len[k];
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) goto done;
    char *d = PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0; k < n; k++) {
        memcpy(d, (const char *)b.buf + off[k], len[k]);
        d += len[k];
    }
done:
    PyBuffer_Release(&b);
    PyBuffer_Release(&o);
    PyBuffer_Release(&l);
    return out;
}

/* unordered(blob, lengths): indices i where key i-1 is not strictly below key i (memcmp order,
 * a shorter prefix first: LMDB's default order) */
static PyObject *mod_unordered(PyObject *mod, PyObject *args) {
    Py_buffer b, l;
    PyObject *lo;
    if (!PyArg_ParseTuple(args, "y*O", &b, &lo)) return NULL;
    if (int64_view(lo, &l, "lengths") < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    Py_ssize_t n = l.len / 8;
    const int64_t *len = l.buf;
    const char *p = b.buf, *prev = NULL;
    int64_t plen = 0, at = 0;
    for (Py_ssize_t k = 0; out && k < n; k++) {
        if (len[k] < 0 || at + len[k] > b.len) {
            Py_CLEAR(out);
            PyErr_SetString(PyExc_ValueError, "lengths run past the keys");
            break;
        }
        if (prev) {
            int64_t m = plen < len[k] ? plen : len[k];
            int c = memcmp(prev, p + at, m);
            if (c > 0 || (c == 0 && plen >= len[k])) {
                PyObject *i = PyLong_FromSsize_t(k);
                if (i == NULL || PyList_Append(out, i) < 0) Py_CLEAR(out);
                Py_XDECREF(i);
            }
        }
        prev = p + at;
        plen = len[k];
        at += len[k];
    }
    PyBuffer_Release(&b);
    PyBuffer_Release(&l);
    return out;
}

static PyMethodDef mod_methods[] = {
    {"gather", mod_gather, METH_VARARGS, "gather(buf, offsets, lengths): the byte ranges back to back (bytes)"},
    {"unordered", mod_unordered, METH_VARARGS, "unordered(blob, lengths): i where key i-1 >= key i"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef KI_methods[] = {
    {"lookup", (PyCFunction)KI_lookup, METH_VARARGS, "lookup(keys, out): out[i] = key i's row or -1; the hit count"},
    {"prefix", (PyCFunction)KI_prefix, METH_O, "prefix(keys): how many keys, from the first, are mapped"},
    {"get", (PyCFunction)KI_get, METH_O, "get(key): its row, -1 when not mapped"},
    {"set_many", (PyCFunction)KI_set_many, METH_VARARGS, "set_many(keys, rows): row i holds key i, mapped to it"},
    {"discard", (PyCFunction)KI_discard, METH_VARARGS, "discard(key[, row]): unmap key (if mapped to row); mapped?"},
    {"key", (PyCFunction)KI_key, METH_O, "key(row): the row's key (str), None when it has none"},
    {"key_bytes", (PyCFunction)KI_key_bytes, METH_O, "key_bytes(row): the row's key bytes, None when none"},
    {"forget", (PyCFunction)KI_forget, METH_O, "forget(row): the row holds no key (unmapped if it was)"},
    {"mapped_keys", (PyCFunction)KI_mapped, METH_VARARGS, "mapped_keys([limit]): mapped keys (str), row order"},
    {"load", (PyCFunction)KI_load, METH_VARARGS, "load(lens, blob): rows 0..n-1 hold and map the packed keys"},
    {"nbytes", (PyCFunction)KI_nbytes, METH_NOARGS, "bytes allocated (table, per-row references, arena)"},
    {"narrow_hash_for_tests", (PyCFunction)KI_narrow, METH_O, "keep only the low N bits of each hash (tests)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KI_seq = {.sq_length = (lenfunc)KI_len};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp_nvme._keyindex.KeyIndex",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "key -> row table with the keys' bytes in one arena (keyindex.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KI_init,
    .tp_dealloc = (destructor)KI_dealloc,
    .tp_methods = KI_methods,
    .tp_as_sequence = &KI_seq,
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "umbp_nvme._keyindex",
                                        "The writer's key -> row table (keyindex.c).", -1, mod_methods};

PyMODINIT_FUNC PyInit__keyindex(void) {
    if (PyType_Ready(&KeyIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&KeyIndexType);
    if (PyModule_AddObject(m, "KeyIndex", (PyObject *)&KeyIndexType) < 0) {
        Py_DECREF(&KeyIndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
