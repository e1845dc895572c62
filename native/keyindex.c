/* The writer's key -> row table (umbp_nvme/store/keymap.py): no Python object per key, and no key
 * bytes in memory either (issue 36: <= 64 B per indexed object).
 *
 * Each key has a 64-bit keyed hash (per-table random seed; its top bit set, so 63 bits vary).
 * Its high half is kept per row (hv[row], 0: the row holds no key) and picks the home slot; the
 * table is open addressing with linear probing over (low half, row) slots, so a probe compares
 * all 64 bits and a row's slot is found from hv alone. It is a multimap: two keys with one hash each keep their own row, so a collision
 * never makes one key's row another's. A lookup answers candidate rows only: the caller
 * confirms a candidate against the full key on disk (the LMDB index or the row's record,
 * keymap.py) before serving, deleting or overwriting anything. Deletion shifts the cluster back
 * (no tombstones). About 4 + 8/load bytes a row.
 *
 * Every method runs holding the GIL, start to end: readers on other threads (exists_many_nowait
 * on SGLang's thread) see a whole update or none of it, as they did with a dict.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "keyhash.h"

#define EMPTY UINT64_MAX
#define ROW_MAX (UINT32_MAX - 1)
#define KEY_MAX 0xffff
#define HAS_KEY (1ULL << 63)

typedef struct {
    PyObject_HEAD
    uint64_t seed;
    uint64_t hash_mask;     /* all ones; tests narrow it to force collisions */
    uint64_t *slots;        /* (hash low 32 bits) << 32 | row; EMPTY where free */
    uint64_t cap;           /* power of two, at most 2**32 (the home is the hash's low bits) */
    uint64_t count;         /* rows mapped */
    uint32_t *hv;           /* per row: the high half of its key's hash (never 0), 0 when the row holds no key */
    uint64_t nrows;         /* rows with room in hv */
} KeyIndex;

/* key_hash and key_bytes live in keyhash.h (HashSet hashes the same way); this one reads the table's */
static inline uint64_t ki_hash(const KeyIndex *t, const char *p, size_t n) {
    return key_hash(t->seed, t->hash_mask, p, n);
}

static inline uint32_t slot_row(uint64_t s) { return (uint32_t)s; }
static inline uint32_t hi_of(uint64_t h) { return (uint32_t)(h >> 32); }
static inline uint64_t slot_of(uint64_t h, uint32_t r) { return (h & 0xffffffffULL) << 32 | r; }
static inline uint64_t slot_home(const KeyIndex *t, uint64_t s, uint64_t m) { return t->hv[slot_row(s)] & m; }

/* the k-th (from 0) slot whose row has hash h: returns cap when none */
static uint64_t probe_nth(const KeyIndex *t, uint64_t h, int k) {
    uint64_t m = t->cap - 1, i = hi_of(h) & m, tag = (h & 0xffffffffULL) << 32;
    uint32_t hi = hi_of(h);
    for (;; i = (i + 1) & m) {
        uint64_t s = t->slots[i];
        if (s == EMPTY) return t->cap;
        if ((s & 0xffffffff00000000ULL) == tag && t->hv[slot_row(s)] == hi && k-- == 0) return i;
    }
}

/* the slot mapping row r (found from the row's own hash), cap when the row is not mapped */
static uint64_t slot_of_row(const KeyIndex *t, uint32_t r) {
    if (r >= t->nrows || !t->hv[r]) return t->cap;
    uint64_t m = t->cap - 1, i = t->hv[r] & m;
    for (; t->slots[i] != EMPTY; i = (i + 1) & m)
        if (slot_row(t->slots[i]) == r) return i;
    return t->cap;
}

static int resize_table(KeyIndex *t, uint64_t cap) {
    if (cap > (1ULL << 32)) return PyErr_SetString(PyExc_OverflowError, "key table over 2**32 slots"), -1;
    uint64_t *s = PyMem_RawMalloc(cap * sizeof(uint64_t));
    if (s == NULL) return PyErr_NoMemory(), -1;
    memset(s, 0xff, cap * sizeof(uint64_t));
    for (uint64_t j = 0; j < t->cap; j++) {
        uint64_t x = t->slots[j];
        if (x == EMPTY) continue;
        uint64_t i = slot_home(t, x, cap - 1);
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
    uint32_t *hv = PyMem_RawRealloc(t->hv, n * 4);
    if (hv == NULL) return PyErr_NoMemory(), -1;
    t->hv = hv;
    memset(t->hv + t->nrows, 0, (n - t->nrows) * 4);
    t->nrows = n;
    return 0;
}

static void remove_slot(KeyIndex *t, uint64_t i) {
    uint64_t m = t->cap - 1, j = i;
    t->slots[i] = EMPTY;
    for (;;) { /* backward shift: an entry moves into the hole if its home is not between hole and it */
        j = (j + 1) & m;
        uint64_t x = t->slots[j];
        if (x == EMPTY) break;
        uint64_t home = slot_home(t, x, m);
        if (((j - home) & m) >= ((j - i) & m)) {
            t->slots[i] = x;
            t->slots[j] = EMPTY;
            i = j;
        }
    }
    t->count--;
}

static void unmap_row(KeyIndex *t, uint32_t r) {
    uint64_t i = slot_of_row(t, r);
    if (i < t->cap) remove_slot(t, i);
}

/* Row r holds hash h and is mapped (beside any other row of the same hash: a multimap). */
static void add_one(KeyIndex *t, uint32_t r, uint64_t h) {
    unmap_row(t, r); /* a row holds one key: its old one leaves first */
    t->hv[r] = hi_of(h);
    uint64_t m = t->cap - 1, i = hi_of(h) & m;
    while (t->slots[i] != EMPTY) i = (i + 1) & m;
    t->slots[i] = slot_of(h, r);
    t->count++;
}

static int grow_for(KeyIndex *t, uint64_t more) {
    uint64_t cap = t->cap;
    while ((t->count + more) * 10 > cap * 7) cap *= 2;
    return cap != t->cap ? resize_table(t, cap) : 0;
}

/* --- the Python methods ------------------------------------------------------------------- */

static int get_rows_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t n, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    char last = f[0] ? f[strlen(f) - 1] : 0;
    if (view->itemsize != 8 || (n >= 0 && view->len != n * 8) || (last != 'q' && last != 'l')) {
        if (n >= 0) PyErr_Format(PyExc_ValueError, "rows must be %zd int64 values", n);
        else PyErr_SetString(PyExc_ValueError, "rows must be int64 values");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* out: a writable C-contiguous buffer of exactly n bytes; on failure `held` is released too */
static int get_out_bytes(PyObject *out, Py_buffer *o, Py_ssize_t n, Py_buffer *held) {
    if (PyObject_GetBuffer(out, o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(held);
        return -1;
    }
    if (o->len != n) {
        PyErr_Format(PyExc_ValueError, "out must be %zd bytes", n);
        PyBuffer_Release(held);
        PyBuffer_Release(o);
        return -1;
    }
    return 0;
}

/* lookup(keys, out[, nth]): out[i] = the nth candidate row of key i (same hash), -1 when none;
 * returns how many keys have one. Candidates are not confirmed: see keymap.py. */
static PyObject *KI_lookup(KeyIndex *t, PyObject *args) {
    PyObject *keys, *out;
    int nth = 0;
    if (!PyArg_ParseTuple(args, "O!O|i", &PyList_Type, &keys, &out, &nth)) return NULL;
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
        uint64_t h = ki_hash(t, p, len), i = probe_nth(t, h, nth < 0 ? 0 : nth);
        Py_XDECREF(owner);
        if (i < t->cap) {
            o[k] = nth < 0 && probe_nth(t, h, 1) < t->cap ? -2 : (int64_t)slot_row(t->slots[i]);
            hits++;
        }
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(hits);
}

static PyObject *KI_first(KeyIndex *t, PyObject *key) {
    const char *p;
    Py_ssize_t len;
    PyObject *owner;
    if (key_bytes(key, &p, &len, &owner, 0) < 0) return PyLong_FromLong(-1);
    uint64_t i = probe_nth(t, ki_hash(t, p, len), 0);
    Py_XDECREF(owner);
    return PyLong_FromLongLong(i < t->cap ? (long long)slot_row(t->slots[i]) : -1);
}

static PyObject *KI_prefix(KeyIndex *t, PyObject *keys) {
    if (!PyList_Check(keys)) return PyErr_SetString(PyExc_TypeError, "keys must be a list"), NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys), k = 0;
    for (; k < n; k++) {
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        if (key_bytes(PyList_GET_ITEM(keys, k), &p, &len, &owner, 0) < 0) break;
        uint64_t i = probe_nth(t, ki_hash(t, p, len), 0);
        Py_XDECREF(owner);
        if (i >= t->cap) break;
    }
    return PyLong_FromSsize_t(k);
}

/* fresh(keys, max_len) -> bool: the put path's one-pass check that a batch needs no per-key
 * decision: every key an exact str of 1..max_len ASCII chars (its bytes as they are), none with a
 * candidate row here, no two with the same hash (so none repeated). False otherwise: the caller's
 * checked path then decides key by key (a collision between two new keys only costs that path). */
static PyObject *KI_fresh(KeyIndex *t, PyObject *args) {
    PyObject *keys;
    Py_ssize_t max_len;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &keys, &max_len)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2) cap *= 2;
    uint64_t local[512], *seen = cap <= 512 ? local : PyMem_RawMalloc(cap * sizeof(uint64_t));
    if (seen == NULL) return PyErr_NoMemory();
    memset(seen, 0, cap * sizeof(uint64_t)); /* 0: empty (every hash has its top bit set) */
    int ok = 1;
    for (Py_ssize_t k = 0; k < n && ok; k++) {
        PyObject *key = PyList_GET_ITEM(keys, k);
        if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_ASCII(key)) {
            ok = 0;
            break;
        }
        Py_ssize_t len = PyUnicode_GET_LENGTH(key);
        if (len < 1 || len > max_len) {
            ok = 0;
            break;
        }
        uint64_t h = ki_hash(t, (const char *)PyUnicode_DATA(key), len);
        if (probe_nth(t, h, 0) < t->cap) {
            ok = 0;
            break;
        }
        uint64_t i = h & (cap - 1);
        for (; seen[i]; i = (i + 1) & (cap - 1))
            if (seen[i] == h) {
                ok = 0;
                break;
            }
        seen[i] = h;
    }
    if (seen != local) PyMem_RawFree(seen);
    return PyBool_FromLong(ok);
}

/* add(keys, rows): row rows[i] holds key i's hash and is mapped (all or nothing: every key and row
 * is checked first). Replacing a key's earlier row is the caller's (it confirms which row that is). */
static PyObject *KI_add(KeyIndex *t, PyObject *args) {
    PyObject *keys, *rows;
    Py_ssize_t over = -1, longer = 0;
    if (!PyArg_ParseTuple(args, "O!O|n", &PyList_Type, &keys, &rows, &over)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    Py_buffer v;
    if (get_rows_buffer(rows, &v, n, 0) < 0) return NULL;
    const int64_t *r = v.buf;
    uint64_t *h = PyMem_RawMalloc((n ? n : 1) * 8);
    PyObject *ret = h ? Py_None : PyErr_NoMemory();
    int64_t rmax = -1;
    for (Py_ssize_t k = 0; ret && k < n; k++) {
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
        if (len > KEY_MAX) {
            PyErr_Format(PyExc_ValueError, "key of %zd bytes (at most %d)", len, KEY_MAX);
            ret = NULL;
        } else {
            h[k] = ki_hash(t, p, len);
            longer += over >= 0 && len > over;
        }
        Py_XDECREF(owner);
        rmax = r[k] > rmax ? r[k] : rmax;
    }
    /* room for the whole batch at once (an open loads millions): one rehash, one realloc */
    if (ret && rmax >= 0 && reserve_rows_as(t, (uint64_t)rmax + 1, 0) < 0) ret = NULL;
    if (ret && grow_for(t, n) < 0) ret = NULL;
    for (Py_ssize_t k = 0; ret && k < n; k++) add_one(t, (uint32_t)r[k], h[k]);
    PyMem_RawFree(h);
    PyBuffer_Release(&v);
    return ret ? PyLong_FromSsize_t(longer) : NULL;
}

/* unmap(rows): rows no longer mapped (they keep their hash until forget) */
static PyObject *KI_unmap(KeyIndex *t, PyObject *rows) {
    Py_buffer v;
    if (get_rows_buffer(rows, &v, -1, 0) < 0) return NULL;
    const int64_t *r = v.buf;
    Py_ssize_t n = v.len / 8, done = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (r[k] < 0 || (uint64_t)r[k] >= t->nrows) continue;
        uint64_t i = slot_of_row(t, (uint32_t)r[k]);
        if (i < t->cap) remove_slot(t, i), done++;
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(done);
}

/* holds(keys, rows, out): out[i] = 1 where rows[i]'s hash is key i's (all 64 bits while the row is
 * mapped, the 32 kept per row after): checks a key read back from disk names the row */
static PyObject *KI_holds(KeyIndex *t, PyObject *args) {
    PyObject *keys, *rows, *out;
    if (!PyArg_ParseTuple(args, "O!OO", &PyList_Type, &keys, &rows, &out)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    Py_buffer v, o;
    if (get_rows_buffer(rows, &v, n, 0) < 0) return NULL;
    if (get_out_bytes(out, &o, n, &v) < 0) return NULL;
    const int64_t *r = v.buf;
    uint8_t *b = o.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        b[k] = 0;
        if (r[k] < 0 || (uint64_t)r[k] >= t->nrows || !t->hv[r[k]]) continue;
        PyObject *key = PyList_GET_ITEM(keys, k);
        if (PyBytes_CheckExact(key)) {
            p = PyBytes_AS_STRING(key);
            len = PyBytes_GET_SIZE(key);
            owner = NULL;
        } else if (key_bytes(key, &p, &len, &owner, 0) < 0) {
            continue;
        }
        uint64_t h = ki_hash(t, p, len), i = slot_of_row(t, (uint32_t)r[k]);
        Py_XDECREF(owner);
        b[k] = t->hv[r[k]] == hi_of(h) && (i >= t->cap || (t->slots[i] >> 32) == (h & 0xffffffffULL));
    }
    PyBuffer_Release(&v);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* A row column (rows.py) or values for one: a 1-d integer array, read as unsigned or signed; one
 * written must be C-contiguous, one read may be strided (a field of a structured array). */
typedef struct {
    Py_buffer v;
    char kind; /* 'u' or 'i' */
    Py_ssize_t stride, n;
} Col;

static int col_get(PyObject *o, Col *c, Py_ssize_t i, int writable) {
    int flags = writable ? PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE : PyBUF_STRIDES | PyBUF_FORMAT;
    if (PyObject_GetBuffer(o, &c->v, flags) < 0) return -1;
    const char *f = c->v.format ? c->v.format : "B";
    char k = f[0] && strchr("@=<", f[0]) ? f[1] : f[0];
    c->kind = !k ? 0 : strchr("BHILQ?", k) ? 'u' : strchr("bhilq", k) ? 'i' : 0;
    Py_ssize_t w = c->v.itemsize;
    if (!c->kind || c->v.ndim != 1 || (w != 1 && w != 2 && w != 4 && w != 8)) {
        PyErr_Format(PyExc_ValueError, "column %zd must be a 1-d integer array", i);
        PyBuffer_Release(&c->v);
        return -1;
    }
    c->n = c->v.shape ? c->v.shape[0] : c->v.len / w;
    c->stride = c->v.strides ? c->v.strides[0] : w;
    return 0;
}

static inline int64_t col_at(const Col *c, uint64_t r) {
    const char *p = (const char *)c->v.buf + (Py_ssize_t)r * c->stride;
    switch (c->v.itemsize) {
    case 1: return c->kind == 'u' ? (int64_t)*(const uint8_t *)p : (int64_t)*(const int8_t *)p;
    case 2: return c->kind == 'u' ? (int64_t) * (const uint16_t *)p : (int64_t) * (const int16_t *)p;
    case 4: return c->kind == 'u' ? (int64_t) * (const uint32_t *)p : (int64_t) * (const int32_t *)p;
    default: return *(const int64_t *)p; /* uint64 columns (generations) stay below 2**63 */
    }
}

static inline void col_set(const Col *c, uint64_t r, int64_t x) {
    char *p = (char *)c->v.buf + r * c->v.itemsize;
    switch (c->v.itemsize) {
    case 1: *(uint8_t *)p = (uint8_t)x; break;
    case 2: *(uint16_t *)p = (uint16_t)x; break;
    case 4: *(uint32_t *)p = (uint32_t)x; break;
    default: *(int64_t *)p = x;
    }
}

#define SCATTER_COLS 16
/* scatter(rows, cols, vals): cols[j][rows[k]] = vals[j][k], vals[j] an integer array of one value
 * per row (strided is fine), an (array, shift) pair (its values >> shift, each a multiple of
 * 2**shift), or an int for every row; each value cut to its column's width (the caller's values
 * fit: rows.py's columns). Every row, column and value is checked before anything is written. */
static PyObject *mod_scatter(PyObject *mod, PyObject *args) {
    PyObject *rows, *cols, *vals;
    if (!PyArg_ParseTuple(args, "OO!O!", &rows, &PyTuple_Type, &cols, &PyTuple_Type, &vals)) return NULL;
    Py_ssize_t nc = PyTuple_GET_SIZE(cols);
    if (nc != PyTuple_GET_SIZE(vals) || nc > SCATTER_COLS)
        return PyErr_Format(PyExc_ValueError, "cols and vals must pair up (at most %d)", SCATTER_COLS);
    Py_buffer v;
    if (get_rows_buffer(rows, &v, -1, 0) < 0) return NULL;
    Col c[SCATTER_COLS], x[SCATTER_COLS];
    int64_t scalar[SCATTER_COLS];
    int gc = 0, gx = 0, is_arr[SCATTER_COLS] = {0}, shift[SCATTER_COLS] = {0};
    PyObject *ret = NULL;
    const int64_t *r = v.buf;
    Py_ssize_t n = v.len / 8;
    for (; gc < nc; gc++) {
        if (col_get(PyTuple_GET_ITEM(cols, gc), &c[gc], gc, 1) < 0) goto done;
        for (Py_ssize_t k = 0; k < n; k++)
            if (r[k] < 0 || r[k] >= c[gc].n) {
                PyErr_Format(PyExc_IndexError, "row %lld out of range of column %d", (long long)r[k], gc);
                gc++;
                goto done;
            }
    }
    for (; gx < nc; gx++) {
        PyObject *o = PyTuple_GET_ITEM(vals, gx);
        if (PyLong_Check(o)) {
            scalar[gx] = PyLong_AsLongLong(o);
            if (scalar[gx] == -1 && PyErr_Occurred()) goto done;
            continue;
        }
        if (PyTuple_Check(o)) {
            if (PyTuple_GET_SIZE(o) != 2 || !PyLong_Check(PyTuple_GET_ITEM(o, 1))) {
                PyErr_Format(PyExc_ValueError, "vals[%d]: an (array, shift) pair expected", gx);
                goto done;
            }
            long sh = PyLong_AsLong(PyTuple_GET_ITEM(o, 1));
            if (sh < 0 || sh > 32) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "vals[%d]: shift %ld out of range", gx, sh);
                goto done;
            }
            shift[gx] = (int)sh;
            o = PyTuple_GET_ITEM(o, 0);
        }
        if (col_get(o, &x[gx], gx, 0) < 0) goto done;
        is_arr[gx] = 1;
        if (x[gx].n != n) {
            PyErr_Format(PyExc_ValueError, "vals[%d] must hold one value per row (%zd)", gx, n);
            gx++;
            goto done;
        }
        for (Py_ssize_t k = 0; shift[gx] && k < n; k++)
            if (col_at(&x[gx], k) & ((1LL << shift[gx]) - 1)) {
                PyErr_Format(PyExc_ValueError, "vals[%d][%zd] is not a multiple of 2**%d", gx, k, shift[gx]);
                gx++;
                goto done;
            }
    }
    for (int j = 0; j < nc; j++)
        for (Py_ssize_t k = 0; k < n; k++)
            col_set(&c[j], (uint64_t)r[k], is_arr[j] ? col_at(&x[j], k) >> shift[j] : scalar[j]);
    ret = Py_None;
    Py_INCREF(ret);
done:
    for (int j = 0; j < gc; j++) PyBuffer_Release(&c[j].v);
    for (int j = 0; j < gx; j++)
        if (is_arr[j]) PyBuffer_Release(&x[j].v);
    PyBuffer_Release(&v);
    return ret;
}

#define TAKE_COLS 6
/* take(keys, cols, off_shift, out): the get path's lookup and gather in one pass. For each key
 * with exactly one candidate row (not confirmed: keymap.py), in key order, out (int64, 8 x n, row
 * major) gets [0] its key index, [1..6] its row's cols (segment, offset in units of
 * 2**off_shift -> bytes, length, crc, flags, generation) and [7] the row. Returns how many keys
 * hit, or -1 (out partly written) when a key's hash has several candidates: the caller's
 * general path confirms those. A row beyond any column raises (the columns must cover the table). */
static PyObject *KI_take(KeyIndex *t, PyObject *args) {
    PyObject *keys, *cols, *out;
    int shift;
    if (!PyArg_ParseTuple(args, "O!O!iO", &PyList_Type, &keys, &PyTuple_Type, &cols, &shift, &out)) return NULL;
    if (PyTuple_GET_SIZE(cols) != TAKE_COLS) return PyErr_Format(PyExc_ValueError, "cols must be %d arrays", TAKE_COLS);
    if (shift < 0 || shift > 32) return PyErr_Format(PyExc_ValueError, "off_shift %d out of range", shift);
    Py_ssize_t n = PyList_GET_SIZE(keys), got = 0, hits = 0;
    Col c[TAKE_COLS];
    Py_buffer o;
    PyObject *ret = NULL;
    for (; got < TAKE_COLS; got++)
        if (col_get(PyTuple_GET_ITEM(cols, got), &c[got], got, 0) < 0) goto done;
    if (PyObject_GetBuffer(out, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (o.len != 8 * n * 8 || ((uintptr_t)o.buf & 7)) {
        PyErr_Format(PyExc_ValueError, "out must be 8 x %zd aligned int64 values", n);
        PyBuffer_Release(&o);
        goto done;
    }
    uint64_t nrows = UINT64_MAX;
    for (int j = 0; j < TAKE_COLS; j++)
        if ((uint64_t)c[j].n < nrows) nrows = (uint64_t)c[j].n;
    int64_t *w = o.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        const char *p;
        Py_ssize_t len;
        PyObject *owner;
        if (key_bytes(PyList_GET_ITEM(keys, k), &p, &len, &owner, 0) < 0) continue;
        uint64_t h = ki_hash(t, p, len), i = probe_nth(t, h, 0);
        Py_XDECREF(owner);
        if (i >= t->cap) continue;
        if (probe_nth(t, h, 1) < t->cap) {
            hits = -1;
            break;
        }
        uint64_t r = slot_row(t->slots[i]);
        if (r >= nrows) {
            PyErr_Format(PyExc_ValueError, "row %llu is beyond the columns (%llu rows)", (unsigned long long)r,
                         (unsigned long long)nrows);
            PyBuffer_Release(&o);
            goto done;
        }
        w[hits] = k;
        for (int j = 0; j < TAKE_COLS; j++) w[(j + 1) * n + hits] = col_at(&c[j], r) << (j == 1 ? shift : 0);
        w[7 * n + hits] = (int64_t)r;
        hits++;
    }
    PyBuffer_Release(&o);
    ret = PyLong_FromSsize_t(hits);
done:
    for (int j = 0; j < got; j++) PyBuffer_Release(&c[j].v);
    return ret;
}

/* forget(rows): rows hold no key any more (unmapped if they were) */
static PyObject *KI_forget(KeyIndex *t, PyObject *rows) {
    Py_buffer v;
    if (get_rows_buffer(rows, &v, -1, 0) < 0) return NULL;
    const int64_t *r = v.buf;
    for (Py_ssize_t k = 0; k < v.len / 8; k++) {
        if (r[k] < 0 || (uint64_t)r[k] >= t->nrows) continue;
        unmap_row(t, (uint32_t)r[k]);
        t->hv[r[k]] = 0;
    }
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
}

/* mapped(rows, out): out[i] = 1 where rows[i] is mapped (uint8) */
static PyObject *KI_mapped(KeyIndex *t, PyObject *args) {
    PyObject *rows, *out;
    if (!PyArg_ParseTuple(args, "OO", &rows, &out)) return NULL;
    Py_buffer v, o;
    if (get_rows_buffer(rows, &v, -1, 0) < 0) return NULL;
    Py_ssize_t n = v.len / 8;
    if (get_out_bytes(out, &o, n, &v) < 0) return NULL;
    const int64_t *r = v.buf;
    uint8_t *b = o.buf;
    for (Py_ssize_t k = 0; k < n; k++)
        b[k] = r[k] >= 0 && (uint64_t)r[k] < t->nrows && slot_of_row(t, (uint32_t)r[k]) < t->cap;
    PyBuffer_Release(&v);
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* mapped_rows([limit]): the mapped rows in row order (bytes of int64: put order within a session,
 * the index's order after an open, as the dict's was) */
static PyObject *KI_mapped_rows(KeyIndex *t, PyObject *args) {
    Py_ssize_t limit = -1;
    if (!PyArg_ParseTuple(args, "|n", &limit)) return NULL;
    uint64_t want = limit < 0 ? t->count : ((uint64_t)limit < t->count ? (uint64_t)limit : t->count);
    PyObject *out = PyBytes_FromStringAndSize(NULL, want * 8);
    if (out == NULL) return NULL;
    int64_t *o = (int64_t *)PyBytes_AS_STRING(out);
    uint64_t k = 0;
    /* every mapped slot marks its row, then the rows in order */
    uint8_t *mark = PyMem_RawCalloc(t->nrows ? t->nrows : 1, 1);
    if (mark == NULL) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    for (uint64_t i = 0; i < t->cap; i++)
        if (t->slots[i] != EMPTY) mark[slot_row(t->slots[i])] = 1;
    for (uint64_t r = 0; r < t->nrows && k < want; r++)
        if (mark[r]) o[k++] = (int64_t)r;
    PyMem_RawFree(mark);
    return out;
}

/* room for rows 0..n-1 and a table that holds them at load <= 0.7 */
static int load_prepare(KeyIndex *t, Py_ssize_t n) {
    uint64_t cap = t->cap;
    while ((uint64_t)n * 10 > cap * 7) cap *= 2;
    return reserve_rows_as(t, n, 1) < 0 || (cap != t->cap && resize_table(t, cap) < 0) ? -1 : 0;
}

/* rows 0..n-1 (hv set) into their slots; low: each row's low hash half (uint32 items) or its
 * whole hash (uint64 items, masked by mask) */
static void load_slots(KeyIndex *t, Py_ssize_t n, const void *low, size_t item, uint64_t mask) {
    uint64_t m = t->cap - 1;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + 16 < n) __builtin_prefetch(&t->slots[t->hv[k + 16] & m], 1);
        uint64_t i = t->hv[k] & m, lo;
        if (item == 4) {
            uint32_t v;
            memcpy(&v, (const uint8_t *)low + 4 * k, 4);
            lo = v;
        } else {
            uint64_t v;
            memcpy(&v, (const uint8_t *)low + 8 * k, 8);
            lo = (uint32_t)(v & mask);
        }
        while (t->slots[i] != EMPTY) i = (i + 1) & m;
        t->slots[i] = lo << 32 | (uint64_t)k;
    }
    t->count = n;
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
    uint64_t total = 0;
    if (t->count) {
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
    if (load_prepare(t, n) < 0) goto out;
    /* hashes first, so the slot of a key further on is prefetched; no key is compared (a multimap) */
    uint32_t *lo = PyMem_RawMalloc((n ? n : 1) * 4);
    if (lo == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t k = 0, at = 0; k < n; at += l[k], k++) {
        uint64_t h = ki_hash(t, b + at, l[k]);
        t->hv[k] = hi_of(h);
        lo[k] = (uint32_t)h;
    }
    load_slots(t, n, lo, sizeof *lo, 0);
    PyMem_RawFree(lo);
    ret = PyLong_FromSsize_t(t->count);
out:
    PyBuffer_Release(&lv);
    PyBuffer_Release(&bv);
    return ret;
}

/* load_hashes(seed, hashes): load's rows from hashes already made with seed (a hashed page walk's,
 * native/lmdbwalk.c: no key bytes in memory at all); into an empty table only, which takes the seed. */
static PyObject *KI_load_hashes(KeyIndex *t, PyObject *args) {
    unsigned long long seed;
    Py_buffer hv;
    if (!PyArg_ParseTuple(args, "Ky*", &seed, &hv)) return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = hv.len / 8;
    const uint64_t *h = hv.buf;
    if (t->count) {
        PyErr_SetString(PyExc_ValueError, "load into an empty table only");
        goto out;
    }
    if (hv.len % 8) {
        PyErr_SetString(PyExc_ValueError, "hashes: a whole number of uint64");
        goto out;
    }
    for (Py_ssize_t k = 0; k < n; k++)
        if (!(h[k] & KEYHASH_TOP)) {
            PyErr_Format(PyExc_ValueError, "hash %zd is not a key hash (top bit clear)", k);
            goto out;
        }
    if (load_prepare(t, n) < 0) goto out;
    t->seed = seed;
    for (Py_ssize_t k = 0; k < n; k++) t->hv[k] = hi_of((h[k] & t->hash_mask) | KEYHASH_TOP);
    load_slots(t, n, h, 8, t->hash_mask);
    ret = PyLong_FromSsize_t(t->count);
out:
    PyBuffer_Release(&hv);
    return ret;
}

static PyObject *KI_nbytes(KeyIndex *t, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(t->cap * 8 + t->nrows * 4);
}

static PyObject *KI_narrow(KeyIndex *t, PyObject *arg) {
    /* tests: keep only the low bits of every hash, so distinct keys collide (never to be used otherwise) */
    int bits = PyLong_AsLong(arg);
    if (bits == -1 && PyErr_Occurred()) return NULL;
    if (t->count) return PyErr_SetString(PyExc_ValueError, "narrow an empty table only"), NULL;
    t->hash_mask = bits >= 63 ? ~HAS_KEY : ((1ULL << bits) - 1);
    Py_RETURN_NONE;
}

static Py_ssize_t KI_len(KeyIndex *t) { return (Py_ssize_t)t->count; }

static int KI_init(KeyIndex *t, PyObject *args, PyObject *kwds) {
    unsigned long long seed = 0;
    if (!PyArg_ParseTuple(args, "K", &seed)) return -1;
    t->seed = seed;
    t->hash_mask = ~HAS_KEY;
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
    PyMem_RawFree(t->hv);
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

/* add_at(counts, rows, delta): counts[rows[i]] += delta for each i, repeats counted each time (a
 * read's pins: rows.py); every row is checked before any count changes */
static PyObject *mod_add_at(PyObject *mod, PyObject *args) {
    PyObject *counts, *rows;
    int delta;
    if (!PyArg_ParseTuple(args, "OOi", &counts, &rows, &delta)) return NULL;
    Py_buffer c, v;
    if (get_rows_buffer(rows, &v, -1, 0) < 0) return NULL;
    if (PyObject_GetBuffer(counts, &c, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&v);
        return NULL;
    }
    const char *f = c.format ? c.format : "B";
    if (c.itemsize != 4 || !strchr("il", f[strlen(f) - 1])) {
        PyErr_SetString(PyExc_ValueError, "counts must be int32 values");
        goto fail;
    }
    const int64_t *r = v.buf;
    Py_ssize_t n = v.len / 8, cap = c.len / 4;
    for (Py_ssize_t k = 0; k < n; k++)
        if (r[k] < 0 || r[k] >= cap) {
            PyErr_Format(PyExc_IndexError, "row %lld out of range (%zd)", (long long)r[k], cap);
            goto fail;
        }
    int32_t *x = c.buf;
    for (Py_ssize_t k = 0; k < n; k++) x[r[k]] += delta;
    PyBuffer_Release(&c);
    PyBuffer_Release(&v);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&c);
    PyBuffer_Release(&v);
    return NULL;
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
    {"scatter", mod_scatter, METH_VARARGS, "scatter(rows, cols, vals): cols[j][rows[k]] = vals[j][k] (or the int vals[j])"},
    {"add_at", mod_add_at, METH_VARARGS, "add_at(counts int32[], rows int64[], delta): counts[rows[i]] += delta, "
     "each repeat counted"},
    {"gather", mod_gather, METH_VARARGS, "gather(buf, offsets, lengths): the byte ranges back to back (bytes)"},
    {"unordered", mod_unordered, METH_VARARGS, "unordered(blob, lengths): i where key i-1 >= key i"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef KI_methods[] = {
    {"lookup", (PyCFunction)KI_lookup, METH_VARARGS,
     "lookup(keys, out[, nth]): out[i] = key i's nth candidate row or -1; nth -1: the only candidate, -2 when "
     "the hash has several"},
    {"take", (PyCFunction)KI_take, METH_VARARGS,
     "take(keys, cols, off_shift, out): per key with one candidate row, its index, row columns and row into "
     "out (8 x n int64); how many, -1 when a hash has several"},
    {"first", (PyCFunction)KI_first, METH_O, "first(key): its first candidate row, -1 when none"},
    {"fresh", (PyCFunction)KI_fresh, METH_VARARGS,
     "fresh(keys, max_len) -> bool: every key an ASCII str of 1..max_len chars, none stored, no two with one hash"},
    {"prefix", (PyCFunction)KI_prefix, METH_O, "prefix(keys): how many keys, from the first, have a candidate row"},
    {"add", (PyCFunction)KI_add, METH_VARARGS,
     "add(keys, rows[, over]): row i holds key i's hash, mapped; how many keys have more than over bytes"},
    {"unmap", (PyCFunction)KI_unmap, METH_O, "unmap(rows): the rows are no longer mapped; how many were"},
    {"holds", (PyCFunction)KI_holds, METH_VARARGS, "holds(keys, rows, out): out[i] = 1 where row i has key i's hash"},
    {"forget", (PyCFunction)KI_forget, METH_O, "forget(rows): the rows hold no key (unmapped if they were)"},
    {"mapped", (PyCFunction)KI_mapped, METH_VARARGS, "mapped(rows, out): out[i] = 1 where rows[i] is mapped"},
    {"mapped_rows", (PyCFunction)KI_mapped_rows, METH_VARARGS, "mapped_rows([limit]): int64 bytes, row order"},
    {"load", (PyCFunction)KI_load, METH_VARARGS, "load(lens, blob): rows 0..n-1 hold and map the packed keys"},
    {"load_hashes", (PyCFunction)KI_load_hashes, METH_VARARGS,
     "load_hashes(seed, hashes): rows 0..n-1 hold and map keys whose hashes under seed are given (the table takes seed)"},
    {"nbytes", (PyCFunction)KI_nbytes, METH_NOARGS, "bytes allocated (table, per-row hashes)"},
    {"narrow_hash_for_tests", (PyCFunction)KI_narrow, METH_O, "keep only the low N bits of each hash (tests)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KI_seq = {.sq_length = (lenfunc)KI_len};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp_nvme._keyindex.KeyIndex",
    .tp_basicsize = sizeof(KeyIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "key hash -> rows multimap (keyindex.c)",
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
    if (hashset_register(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
