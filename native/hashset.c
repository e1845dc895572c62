/* HashSet: a set of 64-bit key hashes (keyhash.h) for a read-only store opener, which answers
 * `exists` from it without holding a Python object, or the key's bytes, per key: 8 bytes a slot.
 *
 * Open addressing with linear probing over a flat uint64 array (0: empty; every hash has its top
 * bit set), the home found by multiply-shift so the capacity need not be a power of two, growth by
 * half at load 0.8, deletion by backward shift (no tombstones, so probes stay short after churn).
 *
 * Every method runs holding the GIL, start to end: a reader on another thread sees a whole update
 * or none of it. A batch grows the table before it changes anything, so a MemoryError leaves the
 * set as it was.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "keyhash.h"

#define MIN_CAP 1024
#define MAX_CAP ((uint64_t)(PY_SSIZE_T_MAX / 8))

typedef struct {
    PyObject_HEAD
    uint64_t seed;
    uint64_t *slots; /* NULL while cap is 0 */
    uint64_t cap;
    uint64_t count;
} HashSet;

/* The top bit is set in every hash, so the home comes from the 63 bits below it: multiplying the
 * hash itself would put every home in the upper half of the table. */
static inline uint64_t home(uint64_t h, uint64_t cap) {
    return (uint64_t)(((unsigned __int128)(h << 1) * cap) >> 64);
}

static inline uint64_t next(uint64_t i, uint64_t cap) { return i + 1 == cap ? 0 : i + 1; }

static inline int fits(uint64_t n, uint64_t cap) { /* n hashes at load <= 0.8 */
    return (unsigned __int128)n * 5 <= (unsigned __int128)cap * 4;
}

/* h's slot, cap when absent */
static inline uint64_t find(const HashSet *s, uint64_t h) {
    if (s->cap == 0) return s->cap;
    for (uint64_t i = home(h, s->cap);; i = next(i, s->cap)) {
        if (s->slots[i] == h) return i;
        if (s->slots[i] == 0) return s->cap;
    }
}

#define PREFAULT_SLOTS (1u << 20) /* 8 MiB of table */

static int rehash(HashSet *s, uint64_t cap) {
    if (cap > MAX_CAP) return PyErr_NoMemory(), -1;
    uint64_t *t;
    if (cap < PREFAULT_SLOTS) {
        t = PyMem_RawCalloc(cap, sizeof(uint64_t));
    } else {
        /* a large table's pages fault in here without the GIL (no one sees it yet), not one by one
         * under it as the first adds land all over it (~50 ms of the GIL per 128 MB) */
        Py_BEGIN_ALLOW_THREADS
        t = PyMem_RawCalloc(cap, sizeof(uint64_t));
        for (uint64_t i = 0; t != NULL && i < cap; i += 512) ((volatile uint64_t *)t)[i] = 0;
        Py_END_ALLOW_THREADS
        if (t != NULL && s->cap >= cap) { /* another thread grew it meanwhile */
            PyMem_RawFree(t);
            return 0;
        }
    }
    if (t == NULL) return PyErr_NoMemory(), -1;
    for (uint64_t j = 0; j < s->cap; j++) {
        uint64_t h = s->slots[j];
        if (h == 0) continue;
        uint64_t i = home(h, cap);
        while (t[i]) i = next(i, cap);
        t[i] = h;
    }
    PyMem_RawFree(s->slots);
    s->slots = t;
    s->cap = cap;
    return 0;
}

/* room for n hashes at load <= 0.8, growing by half steps (one rehash however many steps) */
static int grow_for(HashSet *s, uint64_t n) {
    uint64_t cap = s->cap;
    while (!fits(n, cap)) {
        uint64_t more = cap + cap / 2;
        cap = more < MIN_CAP ? MIN_CAP : more;
        if (cap > MAX_CAP) return PyErr_NoMemory(), -1;
    }
    return cap == s->cap ? 0 : rehash(s, cap);
}

/* room is there already (grow_for): 1 if h was new */
static inline int insert(HashSet *s, uint64_t h) {
    uint64_t i = home(h, s->cap);
    for (; s->slots[i]; i = next(i, s->cap))
        if (s->slots[i] == h) return 0;
    s->slots[i] = h;
    s->count++;
    return 1;
}

/* Empty slot i, shifting back each later member of its cluster whose home is not in (i, j]. */
static void remove_at(HashSet *s, uint64_t i) {
    uint64_t cap = s->cap;
    for (uint64_t j = next(i, cap); s->slots[j]; j = next(j, cap)) {
        uint64_t k = home(s->slots[j], cap);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        s->slots[i] = s->slots[j];
        i = j;
    }
    s->slots[i] = 0;
    s->count--;
}

/* A buffer of uint64 hashes (or bytes, 8 a hash), each checked before the caller changes anything. */
static int hash_view(PyObject *obj, Py_buffer *v) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = v->format ? v->format : "B";
    char last = f[0] ? f[strlen(f) - 1] : 0;
    /* uint64 read as it is (int64 too: the same bits); bytes 8 at a time in the host's order */
    int ok = last && ((v->itemsize == 8 && strchr("QqLlNn", last)) || (v->itemsize == 1 && strchr("Bbc", last)));
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    ok = ok && f[0] != '>' && f[0] != '!'; /* a byte-swapped array would read as other hashes */
#else
    ok = ok && f[0] != '<';
#endif
    if (!ok || v->len % 8) {
        PyErr_Format(PyExc_ValueError, "hashes must be uint64 (or bytes, 8 a hash): got %zd bytes of '%s'", v->len, f);
        PyBuffer_Release(v);
        return -1;
    }
    const char *p = v->buf;
    for (Py_ssize_t k = 0; k < v->len / 8; k++) {
        uint64_t h;
        memcpy(&h, p + 8 * k, 8); /* a bytes slice need not be aligned */
        if (!(h & KEYHASH_TOP)) {
            PyErr_Format(PyExc_ValueError, "hash %zd (%llu) has its top bit clear: not a key hash", k,
                         (unsigned long long)h);
            PyBuffer_Release(v);
            return -1;
        }
    }
    return 0;
}

static inline uint64_t hash_at(const Py_buffer *v, Py_ssize_t k) {
    uint64_t h;
    memcpy(&h, (const char *)v->buf + 8 * k, 8);
    return h;
}

/* a key's hash as KeyIndex computes it for a lookup; 0 when it has no byte form (a miss) */
static uint64_t str_hash(uint64_t seed, PyObject *key) {
    const char *p;
    Py_ssize_t n;
    PyObject *owner;
    if (key_bytes(key, &p, &n, &owner, 0) < 0) return 0;
    uint64_t h = key_hash(seed, ~KEYHASH_TOP, p, n);
    Py_XDECREF(owner);
    return h;
}

static PyObject *HS_add(HashSet *s, PyObject *hashes) {
    Py_buffer v;
    if (hash_view(hashes, &v) < 0) return NULL;
    Py_ssize_t n = v.len / 8, added = 0;
    if (!fits(s->count + (uint64_t)n, s->cap)) {
        /* count the absent ones (a hash repeated in the batch counts each time: room to spare) */
        uint64_t absent = 0;
        for (Py_ssize_t k = 0; k < n; k++) absent += find(s, hash_at(&v, k)) == s->cap;
        if (grow_for(s, s->count + absent) < 0) {
            PyBuffer_Release(&v);
            return NULL;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + 16 < n) __builtin_prefetch(&s->slots[home(hash_at(&v, k + 16), s->cap)], 1);
        added += insert(s, hash_at(&v, k));
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(added);
}

static PyObject *HS_discard(HashSet *s, PyObject *hashes) {
    Py_buffer v;
    if (hash_view(hashes, &v) < 0) return NULL;
    Py_ssize_t n = v.len / 8, removed = 0;
    for (Py_ssize_t k = 0; k < n && s->count; k++) {
        uint64_t i = find(s, hash_at(&v, k));
        if (i < s->cap) remove_at(s, i), removed++;
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(removed);
}

static PyObject *HS_reserve(HashSet *s, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) return PyErr_SetString(PyExc_ValueError, "reserve a count >= 0"), NULL;
    /* load 0.7, so n adds after it never rehash (that waits for 0.8) */
    unsigned __int128 want = ((unsigned __int128)n * 10 + 6) / 7;
    if (want > MAX_CAP) return PyErr_NoMemory();
    if (want > s->cap && rehash(s, (uint64_t)want < MIN_CAP ? MIN_CAP : (uint64_t)want) < 0) return NULL;
    Py_RETURN_NONE;
}

static int keys_seq(PyObject *keys) {
    if (PyList_Check(keys) || PyTuple_Check(keys)) return 0;
    PyErr_Format(PyExc_TypeError, "keys must be a list or tuple, not %.100s", Py_TYPE(keys)->tp_name);
    return -1;
}

static PyObject *HS_prefix(HashSet *s, PyObject *keys) {
    if (keys_seq(keys) < 0) return NULL;
    Py_ssize_t k = 0;
    for (; k < PySequence_Fast_GET_SIZE(keys); k++) {
        uint64_t h = str_hash(s->seed, PySequence_Fast_GET_ITEM(keys, k));
        if (h == 0 || find(s, h) == s->cap) break;
    }
    return PyLong_FromSsize_t(k);
}

/* contains(keys, out): out[i] = 1 where key i's hash is held; returns how many are */
static PyObject *HS_contains(HashSet *s, PyObject *args) {
    PyObject *keys, *out;
    if (!PyArg_ParseTuple(args, "OO", &keys, &out) || keys_seq(keys) < 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), hits = 0;
    Py_buffer o;
    if (PyObject_GetBuffer(out, &o, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (o.itemsize != 1 || o.len != n) {
        PyErr_Format(PyExc_ValueError, "out must be %zd bytes (one per key)", n);
        PyBuffer_Release(&o);
        return NULL;
    }
    uint8_t *b = o.buf;
    memset(b, 0, n);
    for (Py_ssize_t k = 0; k < n && k < PySequence_Fast_GET_SIZE(keys); k++) {
        uint64_t h = str_hash(s->seed, PySequence_Fast_GET_ITEM(keys, k));
        b[k] = h != 0 && find(s, h) < s->cap;
        hits += b[k];
    }
    PyBuffer_Release(&o);
    return PyLong_FromSsize_t(hits);
}

static void drop_table(HashSet *s) {
    PyMem_RawFree(s->slots); /* the memory goes back: reserve() to refill without regrowth */
    s->slots = NULL;
    s->cap = s->count = 0;
}

static PyObject *HS_clear(HashSet *s, PyObject *unused) {
    drop_table(s);
    Py_RETURN_NONE;
}

static PyObject *HS_nbytes(HashSet *s, PyObject *unused) { return PyLong_FromUnsignedLongLong(s->cap * 8); }

static PyObject *HS_get_seed(HashSet *s, void *closure) { return PyLong_FromUnsignedLongLong(s->seed); }

static Py_ssize_t HS_len(HashSet *s) { return (Py_ssize_t)s->count; }

static int HS_init(HashSet *s, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"seed", NULL};
    unsigned long long seed = 0;
    /* "K" as KeyIndex(seed) takes it, so the two agree on any int given */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "K", kwlist, &seed)) return -1;
    drop_table(s); /* __init__ again: an empty set for the new seed */
    s->seed = seed;
    return 0;
}

static void HS_dealloc(HashSet *s) {
    PyMem_RawFree(s->slots);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

/* hash_keys(seed, keys) -> bytes: each key's hash, 8 bytes little-endian, 0 for a key with no byte form */
static PyObject *mod_hash_keys(PyObject *mod, PyObject *args) {
    unsigned long long seed;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "KO", &seed, &keys) || keys_seq(keys) < 0) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject *ret = PyBytes_FromStringAndSize(NULL, n * 8);
    if (ret == NULL) return NULL;
    unsigned char *o = (unsigned char *)PyBytes_AS_STRING(ret);
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys, k);
        uint64_t h;
        Py_ssize_t len;
        if (!PyBytes_CheckExact(key)) /* a str as a lookup takes it */
            h = str_hash(seed, key);
        else if ((len = PyBytes_GET_SIZE(key)) > 0) /* an LMDB index key: its bytes as they are */
            h = key_hash(seed, ~KEYHASH_TOP, PyBytes_AS_STRING(key), len);
        else
            h = 0;
        for (int b = 0; b < 8; b++) o[8 * k + b] = (unsigned char)(h >> (8 * b));
    }
    return ret;
}

static PyMethodDef HS_methods[] = {
    {"add", (PyCFunction)HS_add, METH_O,
     "add(hashes): add each uint64 hash (top bit set; all checked first); how many were new"},
    {"discard", (PyCFunction)HS_discard, METH_O, "discard(hashes): remove each hash held; how many were"},
    {"reserve", (PyCFunction)HS_reserve, METH_O, "reserve(n): room for n hashes without a rehash"},
    {"prefix", (PyCFunction)HS_prefix, METH_O, "prefix(keys): how many keys, from the first, have their hash here"},
    {"contains", (PyCFunction)HS_contains, METH_VARARGS,
     "contains(keys, out): out[i] = 1 where key i's hash is here, else 0; how many are"},
    {"clear", (PyCFunction)HS_clear, METH_NOARGS, "clear(): hold nothing (and free the table)"},
    {"nbytes", (PyCFunction)HS_nbytes, METH_NOARGS, "bytes of the slot array"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef HS_getset[] = {
    {"seed", (getter)HS_get_seed, NULL, "the seed keys are hashed with", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods HS_seq = {.sq_length = (lenfunc)HS_len};

static PyTypeObject HashSetType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "umbp_nvme._keyindex.HashSet",
    .tp_basicsize = sizeof(HashSet),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "HashSet(seed): a set of 64-bit key hashes (hashset.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)HS_init,
    .tp_dealloc = (destructor)HS_dealloc,
    .tp_methods = HS_methods,
    .tp_getset = HS_getset,
    .tp_as_sequence = &HS_seq,
};

static PyMethodDef HS_functions[] = {
    {"hash_keys", mod_hash_keys, METH_VARARGS,
     "hash_keys(seed, keys) -> bytes: each key's 8-byte little-endian hash (str or bytes; 0: no byte form)"},
    {NULL, NULL, 0, NULL},
};

int hashset_register(PyObject *module) {
    if (PyType_Ready(&HashSetType) < 0) return -1;
    Py_INCREF(&HashSetType);
    if (PyModule_AddObject(module, "HashSet", (PyObject *)&HashSetType) < 0) {
        Py_DECREF(&HashSetType);
        return -1;
    }
    return PyModule_AddFunctions(module, HS_functions);
}
