/* The LMDB page walk of index_check.py in C: every reachable page of an index.lmdb checked
 * before LMDB maps it, and the leaves of one sub-database captured on the way.
 *
 * The bytes are untrusted (a truncated, zeroed or scribbled file): every page number is checked
 * against last_pg before its page is touched, every node and value against its page or its
 * overflow run, every count against the bytes that hold it. The rules are those of the numpy
 * walker (_walk_pages, kept as the reference the fuzz test compares with); this one exists
 * because the numpy one costs ~1 s per 1 M keys and this ~0.05 s. The GIL is released: a
 * background open walks while the loop serves.
 *
 * walk(buf, psize, last_pg, free_root, free_depth, main_root, main_depth, capture_db, seed=None, tree_only=False)
 *   -> str (why the file is not safe) or None, or where a sub-database named capture_db was
 *      walked the tuple (True, klen int64 bytes, keys blob, rec mask uint8 bytes, records blob);
 *      with a seed, hashes instead of keys (hashed_capture) and node_keys for the few keys needed;
 *      tree_only: main_root is one database's tree (no sub-databases), walked and captured;
 *      rec_check: records checked against their key's CRC in place (bit 4), none copied;
 *      stop: a bytearray whose first byte, once set (by another thread), ends the walk: "stopped" */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "keyhash.h"
#include "uring.h" /* umbp_crc32c */

#define P_BRANCH 0x01
#define P_LEAF 0x02
#define P_OVERFLOW 0x04
#define P_TYPES (0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40)
#define F_BIGDATA 0x01
#define F_SUBDATA 0x02
#define DB_BYTES 48
#define REC_BYTES 48
#define MAX_DEPTH 64
#define MAX_TREES 64 /* sub-databases: ours are two; more is damage we refuse rather than chase */
#define P_INVALID UINT64_MAX
#define STOPPED "stopped" /* the answer of a walk its caller's stop flag ended */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} vec;

static int vec_grow(vec *v, size_t n) {
    size_t cap = v->cap ? v->cap : 4096;
    while (cap < v->n + n) cap *= 2;
    uint8_t *q = realloc(v->p, cap);
    if (q == NULL) return -1;
    v->p = q;
    v->cap = cap;
    return 0;
}

static inline int vec_put(vec *v, const void *src, size_t n) {
    if (v->n + n > v->cap && vec_grow(v, n) < 0) return -1;
    memcpy(v->p + v->n, src, n);
    v->n += n;
    return 0;
}

typedef struct {
    const uint8_t *buf;
    uint64_t psize, last_pg;
    uint8_t *seen;
    char why[256];
    int nomem;
    int captured; /* a tree named capture_db was walked */
    const volatile uint8_t *stop; /* the caller's flag (a follower's close): nonzero ends the walk */
    /* the capture tree's leaf pages in key order, and what they hold: the walk counts, then
     * fill_capture copies into outputs of exactly that size (one touch of fresh memory each) */
    vec cap_pages;
    size_t n_nodes, n_key_bytes, n_recs;
} walker;

typedef struct {
    uint64_t root, depth;
    uint64_t key_at, key_len; /* a sub-database's name: bytes of the main tree's leaf */
    char name[96];
    int capture, main;
} tree;

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

#define BAD(...) (snprintf(w->why, sizeof w->why, __VA_ARGS__), -1)

typedef struct {
    uint32_t ptr, end;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    return (x->ptr > y->ptr) - (x->ptr < y->ptr);
}

/* One page of a level: reached once, stamped, of type want, sane bounds, nodes inside it and
 * not overlapping. Appends branch children to next, checks leaf values, captures. */
static int check_page(walker *w, const tree *t, uint64_t pg, int want, vec *next, tree *subs, int *nsubs,
                      span *sp) {
    const uint64_t psize = w->psize;
    if (pg < 2 || pg > w->last_pg)
        return BAD("%s tree points at page %llu outside 2..%llu", t->name, (unsigned long long)pg,
                   (unsigned long long)w->last_pg);
    if (w->seen[pg]) return BAD("%s tree reaches a page twice", t->name);
    w->seen[pg] = 1;
    const uint8_t *page = w->buf + pg * psize;
    uint64_t stamp = rd64(page);
    if (stamp != pg)
        return BAD("page %llu of the %s tree is stamped as page %llu (zeroed or overwritten)", (unsigned long long)pg,
                   t->name, (unsigned long long)stamp);
    unsigned flags = rd16(page + 10) & P_TYPES;
    if (flags != (unsigned)want)
        return BAD("page %llu of the %s tree has type flags %#x, not %#x", (unsigned long long)pg, t->name, flags,
                   (unsigned)want);
    uint64_t lower = rd16(page + 12), upper = rd16(page + 14);
    if (lower < 16 || lower > upper || upper > psize || (lower & 1))
        return BAD("a page of the %s tree has bounds outside its %llu bytes", t->name, (unsigned long long)psize);
    uint64_t nk = (lower - 16) / 2;
    if (want == P_BRANCH && nk < 1) return BAD("a branch page of the %s tree has no children", t->name);
    int sorted = 1;
    for (uint64_t i = 0; i < nk; i++) {
        uint64_t ptr = rd16(page + 16 + 2 * i);
        if (ptr < upper || ptr + 8 > psize || (ptr & 1)) return BAD("a node of the %s tree lies outside its page", t->name);
        const uint8_t *node = page + ptr;
        uint64_t lo = rd16(node), hi = rd16(node + 2), nflags = rd16(node + 4), ksize = rd16(node + 6);
        uint64_t kend = ptr + 8 + ksize;
        if (kend > psize) return BAD("a key in the %s tree runs past its page", t->name);
        uint64_t dsize = lo | (hi << 16);
        int big = (nflags & F_BIGDATA) != 0;
        uint64_t end = want == P_BRANCH ? kend : kend + (big ? 8 : dsize);
        sp[i].ptr = (uint32_t)ptr;
        sp[i].end = end > UINT32_MAX ? UINT32_MAX : (uint32_t)end;
        if (i && sp[i].ptr < sp[i - 1].ptr) sorted = 0;
    }
    /* the numpy walker checks all nodes of a level before the leaf rules: same verdicts, and the
     * overlap rule comes first so a flipped slot pointer never pairs one key with another's value */
    if (!sorted && nk > 48) {
        qsort(sp, nk, sizeof *sp, span_cmp);
    } else if (!sorted) { /* a leaf of 4 KiB pages holds a few dozen nodes: no call per compare */
        for (uint64_t i = 1; i < nk; i++) {
            span x = sp[i];
            uint64_t j = i;
            for (; j > 0 && sp[j - 1].ptr > x.ptr; j--) sp[j] = sp[j - 1];
            sp[j] = x;
        }
    }
    for (uint64_t i = 1; i < nk; i++)
        if (sp[i].ptr < sp[i - 1].end) return BAD("nodes of a page of the %s tree overlap", t->name);
    for (uint64_t i = 0; i < nk; i++) {
        uint64_t ptr = rd16(page + 16 + 2 * i);
        const uint8_t *node = page + ptr;
        uint64_t lo = rd16(node), hi = rd16(node + 2), nflags = rd16(node + 4), ksize = rd16(node + 6);
        if (want == P_BRANCH) {
            uint64_t child = lo | (hi << 16) | (nflags << 32);
            if (vec_put(next, &child, 8) < 0) return (w->nomem = 1, -1);
            continue;
        }
        uint64_t bad = nflags & ~(uint64_t)(F_BIGDATA | F_SUBDATA);
        if (!t->main) bad |= nflags & F_SUBDATA;
        if (bad) return BAD("a node of the %s tree has flags %#llx", t->name, (unsigned long long)nflags);
        uint64_t dsize = lo | (hi << 16);
        int big = (nflags & F_BIGDATA) != 0;
        uint64_t kend = ptr + 8 + ksize;
        if (kend + (big ? 8 : dsize) > psize) return BAD("a value in the %s tree runs past its page", t->name);
        const uint8_t *data = node + 8 + ksize;
        const uint8_t *val = data; /* the value's bytes, on the page or on its overflow run */
        if (big) {
            uint64_t ov = rd64(data);
            if (ov < 2 || ov > w->last_pg) return BAD("an overflow value of the %s tree points outside the file", t->name);
            if (ov * psize + 16 + dsize > (w->last_pg + 1) * psize)
                return BAD("an overflow value of the %s tree runs past the end of the file", t->name);
            const uint8_t *op = w->buf + ov * psize;
            if (rd64(op) != ov || (rd16(op + 10) & P_TYPES) != P_OVERFLOW)
                return BAD("an overflow page of the %s tree is damaged", t->name);
            val = op + 16;
        }
        if (t->main && (nflags & F_SUBDATA)) {
            if (big || dsize != DB_BYTES) return BAD("a sub-database record in the main tree is damaged");
            uint64_t sflags = rd16(data + 4);
            if (sflags & ~(uint64_t)0x0E) return BAD("a sub-database has flags %#llx", (unsigned long long)sflags);
            if (*nsubs >= MAX_TREES) return BAD("the main tree names more than %d sub-databases", MAX_TREES);
            tree *s = &subs[(*nsubs)++];
            s->root = rd64(data + 40);
            s->depth = rd16(data + 6);
            s->main = 0;
            s->capture = 0;
            s->key_at = (uint64_t)(node + 8 - w->buf);
            s->key_len = ksize;
            snprintf(s->name, sizeof s->name, "sub-database at %llu", (unsigned long long)(data - w->buf));
            continue;
        }
        if (!strcmp(t->name, "free-list")) {
            if (dsize < 8) return BAD("a free-list entry is damaged");
            uint64_t count = rd64(val);
            if (count > dsize / 8 || (count + 1) * 8 > dsize) return BAD("a free-list entry is damaged");
            for (uint64_t j = 0; j < count; j++) {
                uint64_t p = rd64(val + 8 + 8 * j);
                if (p < 2 || p > w->last_pg) return BAD("a free-list entry names pages outside the file");
            }
        }
        if (t->capture) {
            w->n_nodes++;
            w->n_key_bytes += ksize;
            w->n_recs += !big && dsize == REC_BYTES;
        }
    }
    if (want == P_LEAF && t->capture && vec_put(&w->cap_pages, &pg, 8) < 0) return (w->nomem = 1, -1);
    return 0;
}

/* Fresh output memory faults 4 KiB at a time: ~30 K faults per 1 M keys, which on a loaded VM
 * cost more than the walk. Transparent huge pages (where madvise mode allows) make it ~60. */
static void want_huge_pages(void *p, size_t n) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1), e = ((uintptr_t)p + n) & ~(huge - 1);
    if (e > a) (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
    (void)p;
    (void)n;
#endif
}

/* The captured leaves' nodes in key order, one at a time: pages the walk checked, so no bound is
 * re-checked (fill_capture, fill_hashed). NULL at the end. */
typedef struct {
    size_t p;
    uint64_t i, nk;
    const uint8_t *page;
} leaf_cursor;

static inline const uint8_t *next_leaf_node(const walker *w, leaf_cursor *c, uint64_t *ksize, uint8_t *rec) {
    while (c->i >= c->nk) {
        if (c->p >= w->cap_pages.n / 8) return NULL;
        uint64_t pg;
        memcpy(&pg, w->cap_pages.p + 8 * c->p++, 8);
        c->page = w->buf + pg * w->psize;
        c->nk = (rd16(c->page + 12) - 16) / 2;
        c->i = 0;
    }
    const uint8_t *node = c->page + rd16(c->page + 16 + 2 * c->i++);
    uint64_t dsize = rd16(node) | ((uint64_t)rd16(node + 2) << 16);
    *ksize = rd16(node + 6);
    *rec = !(rd16(node + 4) & F_BIGDATA) && dsize == REC_BYTES;
    return node;
}

/* The captured leaves into klen (int64 per node), keys (back to back), isrec (uint8 per node),
 * recs (48 bytes per record-sized value). */
static void fill_capture(const walker *w, int64_t *klen, uint8_t *keys, uint8_t *isrec, uint8_t *recs) {
    /* the counts bound every copy: pages that changed since the walk (they cannot while this
     * process holds the writer lock) could only come out short, never write past the outputs */
    size_t nodes = w->n_nodes, key_bytes = w->n_key_bytes, n_recs = w->n_recs;
    leaf_cursor c = {0};
    uint64_t ksize;
    uint8_t rec;
    const uint8_t *node;
    while ((node = next_leaf_node(w, &c, &ksize, &rec)) != NULL) {
        if (!nodes || ksize > key_bytes || (rec && !n_recs)) return;
        nodes--;
        key_bytes -= ksize;
        n_recs -= rec;
        *klen++ = (int64_t)ksize;
        memcpy(keys, node + 8, ksize);
        keys += ksize;
        *isrec++ = rec;
        if (rec) {
            memcpy(recs, node + 8 + ksize, REC_BYTES);
            recs += REC_BYTES;
        }
    }
}

/* where a record says its key's CRC32C (a follower's walk keeps no records: fill_hashed checks them in
 * place and marks a record that is not its key's with FOREIGN); offsets within REC_BYTES */
typedef struct {
    uint32_t flags_at, crc_at, flag;
} rec_check;
#define FOREIGN 4

/* The captured leaves without copying their keys (a writer's open, issue 36): per node its
 * KeyIndex hash under seed, length, CRC32C and whether it breaks LMDB's order (not strictly above
 * the node before it: a shorter prefix first), the records as fill_capture's (or, with rc, checked
 * in place). Key bytes stay in the map: node_keys reads the few an open needs (dropped records,
 * keys longer than a record holds). -1 when the caller's stop flag ended it. */
static int fill_hashed(const walker *w, uint64_t seed, uint64_t *hash, uint16_t *klen, uint32_t *crc, uint8_t *isrec,
                       uint8_t *recs, const rec_check *rc) {
    size_t nodes = w->n_nodes, n_recs = w->n_recs;
    const uint8_t *prev = NULL;
    uint64_t plen = 0, ksize;
    uint8_t rec;
    leaf_cursor c = {0};
    const uint8_t *node;
    while ((node = next_leaf_node(w, &c, &ksize, &rec)) != NULL) {
        if ((nodes & 4095) == 0 && w->stop != NULL && *w->stop) return -1;
        if (!nodes || (rec && !n_recs)) return 0; /* the counts bound the outputs (fill_capture) */
        nodes--;
        n_recs -= rec;
        const uint8_t *key = node + 8;
        uint8_t bits = rec;
        if (prev != NULL) {
            int cmp = memcmp(prev, key, plen < ksize ? plen : ksize);
            bits |= (uint8_t)((cmp > 0 || (cmp == 0 && plen >= ksize)) << 1);
        }
        prev = key;
        plen = ksize;
        *hash++ = key_hash(seed, ~0ULL, (const char *)key, ksize);
        *klen++ = (uint16_t)ksize;
        *crc++ = umbp_crc32c(0, key, ksize, 0);
        if (rec && rc != NULL) {
            const uint8_t *r = key + ksize;
            uint32_t f, kc;
            memcpy(&f, r + rc->flags_at, 4);
            memcpy(&kc, r + rc->crc_at, 4);
            bits |= (uint8_t)(((f & rc->flag) && kc != crc[-1]) ? FOREIGN : 0);
        } else if (rec) {
            memcpy(recs, key + ksize, REC_BYTES);
            recs += REC_BYTES;
        }
        *isrec++ = bits;
    }
    return 0;
}

static int walk_tree(walker *w, tree *t, tree *subs, int *nsubs, span *sp) {
    if (t->depth < 1 || t->depth > MAX_DEPTH)
        return BAD("%s tree has depth %llu", t->name, (unsigned long long)t->depth);
    vec cur = {0}, next = {0};
    int rc = 0;
    if (t->capture) { /* the last tree of that name wins, as in the numpy walk */
        w->cap_pages.n = w->n_nodes = w->n_key_bytes = w->n_recs = 0;
        w->captured = 1;
    }
    if (vec_put(&cur, &t->root, 8) < 0) return (w->nomem = 1, -1);
    for (uint64_t d = 0; d < t->depth && rc == 0; d++) {
        int want = d + 1 < t->depth ? P_BRANCH : P_LEAF;
        next.n = 0;
        size_t n = cur.n / 8;
        /* the level's pages in order, as the numpy walker takes them: its page checks run over
         * the whole level first, so a bad page is reported before any node of the level */
        for (size_t i = 0; i < n && rc == 0; i++) {
            uint64_t pg;
            memcpy(&pg, cur.p + 8 * i, 8);
            rc = w->stop != NULL && *w->stop ? BAD(STOPPED) : check_page(w, t, pg, want, &next, subs, nsubs, sp);
        }
        vec tmp = cur;
        cur = next;
        next = tmp;
    }
    free(cur.p);
    free(next.p);
    return rc;
}

/* (True, hashes u64, lengths u16, crcs u32, bits u8 (1 record, 2 order break, 4 foreign), records, leaf
 * pages u64), or STOPPED */
static PyObject *hashed_capture(const walker *w, uint64_t seed, const rec_check *rc) {
    size_t n = w->n_nodes;
    PyObject *h = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * n));
    PyObject *kl = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(2 * n));
    PyObject *cr = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 * n));
    PyObject *ir = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    PyObject *rs = PyBytes_FromStringAndSize(NULL, rc != NULL ? 0 : (Py_ssize_t)(REC_BYTES * w->n_recs));
    PyObject *pg = PyBytes_FromStringAndSize((const char *)w->cap_pages.p, (Py_ssize_t)w->cap_pages.n);
    PyObject *out = NULL;
    int stopped = 0;
    if (h && kl && cr && ir && rs && pg) {
        Py_BEGIN_ALLOW_THREADS
        want_huge_pages(PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h));
        want_huge_pages(PyBytes_AS_STRING(rs), PyBytes_GET_SIZE(rs));
        stopped = fill_hashed(w, seed, (uint64_t *)PyBytes_AS_STRING(h), (uint16_t *)PyBytes_AS_STRING(kl),
                              (uint32_t *)PyBytes_AS_STRING(cr), (uint8_t *)PyBytes_AS_STRING(ir),
                              (uint8_t *)PyBytes_AS_STRING(rs), rc);
        Py_END_ALLOW_THREADS
        out = stopped ? PyUnicode_FromString(STOPPED) : Py_BuildValue("(OOOOOOO)", Py_True, h, kl, cr, ir, rs, pg);
    }
    Py_XDECREF(h);
    Py_XDECREF(kl);
    Py_XDECREF(cr);
    Py_XDECREF(ir);
    Py_XDECREF(rs);
    Py_XDECREF(pg);
    return out;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    Py_buffer b;
    unsigned long long psize, last_pg, froot, fdepth, mroot, mdepth;
    const char *cap = NULL;
    Py_ssize_t caplen = 0;
    PyObject *seed_obj = Py_None;
    int tree_only = 0;
    PyObject *check_obj = Py_None, *stop_obj = Py_None;
    if (!PyArg_ParseTuple(args, "y*KKKKKK|z#OpOO", &b, &psize, &last_pg, &froot, &fdepth, &mroot, &mdepth, &cap,
                          &caplen, &seed_obj, &tree_only, &check_obj, &stop_obj))
        return NULL;
    if (stop_obj != Py_None && !PyByteArray_Check(stop_obj)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_TypeError, "walk: stop must be a bytearray");
        return NULL;
    }
    rec_check check = {0}, *rcheck = NULL;
    if (check_obj != Py_None) {
        if (!PyArg_ParseTuple(check_obj, "III", &check.flags_at, &check.crc_at, &check.flag) ||
            check.flags_at > REC_BYTES - 4 || check.crc_at > REC_BYTES - 4) {
            PyBuffer_Release(&b);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "walk: record check offsets outside a record");
            return NULL;
        }
        rcheck = &check;
    }
    uint64_t seed = 0;
    if (seed_obj != Py_None) {
        seed = PyLong_AsUnsignedLongLong(seed_obj);
        if (seed == (uint64_t)-1 && PyErr_Occurred()) {
            PyBuffer_Release(&b);
            return NULL;
        }
    }
    if (psize < 512 || psize > 65536 || (psize & (psize - 1)) || last_pg < 1 ||
        (unsigned long long)b.len / psize < last_pg + 1) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "walk: a buffer of %zd bytes does not hold pages 0..%llu of %llu bytes", b.len,
                     last_pg, psize);
        return NULL;
    }
    walker w = {.buf = b.buf, .psize = psize, .last_pg = last_pg};
    if (stop_obj != Py_None && PyByteArray_GET_SIZE(stop_obj) > 0) /* its object outlives the call (args hold it) */
        w.stop = (const volatile uint8_t *)PyByteArray_AS_STRING(stop_obj);
    w.why[0] = 0;
    int rc = 0;
    Py_BEGIN_ALLOW_THREADS
    w.seen = calloc(last_pg + 1, 1);
    span *sp = malloc(sizeof(span) * (psize / 2 + 1)); /* at most (psize - 16) / 2 nodes a page */
    tree stack[2 + MAX_TREES];
    int top = 0;
    stack[top++] = (tree){.root = froot, .depth = fdepth, .name = "free-list"};
    if (tree_only) /* one database's tree from its root (a follower's snapshot of objects): captured */
        stack[top++] = (tree){.root = mroot, .depth = mdepth, .name = "objects", .capture = 1};
    else
        stack[top++] = (tree){.root = mroot, .depth = mdepth, .name = "main", .main = 1};
    if (w.seen == NULL || sp == NULL) {
        w.nomem = 1;
        rc = -1;
    } else {
        w.seen[0] = w.seen[1] = 1; /* the meta pages */
    }
    while (rc == 0 && top > 0) {
        tree t = stack[--top];
        if (t.root == P_INVALID) continue;
        tree subs[MAX_TREES];
        int nsubs = 0;
        rc = walk_tree(&w, &t, subs, &nsubs, sp);
        for (int i = 0; rc == 0 && i < nsubs; i++) {
            subs[i].capture = cap != NULL && (uint64_t)caplen == subs[i].key_len &&
                              !memcmp(w.buf + subs[i].key_at, cap, subs[i].key_len);
            stack[top++] = subs[i];
        }
    }
    free(sp);
    free(w.seen);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (w.nomem) {
        PyErr_NoMemory();
    } else if (rc != 0) {
        out = PyUnicode_FromString(w.why);
    } else if ((cap == NULL && !tree_only) || !w.captured) {
        Py_INCREF(Py_None);
        out = Py_None;
    } else if (seed_obj != Py_None) {
        out = hashed_capture(&w, seed, rcheck);
    } else {
        PyObject *kl = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * w.n_nodes));
        PyObject *ks = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)w.n_key_bytes);
        PyObject *ir = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)w.n_nodes);
        PyObject *rs = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(REC_BYTES * w.n_recs));
        if (kl && ks && ir && rs) {
            /* the map is still held (b): the pages are the ones checked above */
            Py_BEGIN_ALLOW_THREADS
            want_huge_pages(PyBytes_AS_STRING(kl), PyBytes_GET_SIZE(kl));
            want_huge_pages(PyBytes_AS_STRING(ks), PyBytes_GET_SIZE(ks));
            want_huge_pages(PyBytes_AS_STRING(rs), PyBytes_GET_SIZE(rs));
            fill_capture(&w, (int64_t *)PyBytes_AS_STRING(kl), (uint8_t *)PyBytes_AS_STRING(ks),
                         (uint8_t *)PyBytes_AS_STRING(ir), (uint8_t *)PyBytes_AS_STRING(rs));
            Py_END_ALLOW_THREADS
            out = Py_BuildValue("(OOOOO)", Py_True, kl, ks, ir, rs);
        }
        Py_XDECREF(kl);
        Py_XDECREF(ks);
        Py_XDECREF(ir);
        Py_XDECREF(rs);
    }
    PyBuffer_Release(&b);
    free(w.cap_pages.p);
    return out;
}

/* node_keys(buf, psize, last_pg, pages, ordinals): the keys of the captured nodes at ordinals
 * (increasing int64) of the leaf pages (a hashed capture's, in order). Every bound is checked
 * again: the map is the file now, not necessarily the one walked (ValueError, never a wrong read). */
static PyObject *node_keys(PyObject *self, PyObject *args) {
    Py_buffer b, pv, ov;
    unsigned long long psize, last_pg;
    if (!PyArg_ParseTuple(args, "y*KKy*y*", &b, &psize, &last_pg, &pv, &ov)) return NULL;
    PyObject *out = NULL;
    const char *why = NULL;
    size_t npages = (size_t)pv.len / 8, nord = (size_t)ov.len / 8;
    if (psize < 512 || psize > 65536 || (unsigned long long)b.len / psize < last_pg + 1 || pv.len % 8 || ov.len % 8) {
        why = "node_keys: bad arguments";
        goto done;
    }
    out = PyList_New((Py_ssize_t)nord);
    if (out == NULL) goto done;
    const uint8_t *buf = b.buf;
    size_t p = 0, k = 0;
    int64_t first = 0, prev = -1; /* ordinal of page p's first node */
    for (; k < nord && why == NULL; k++) {
        int64_t want;
        memcpy(&want, (const uint8_t *)ov.buf + 8 * k, 8);
        if (want <= prev) {
            why = "node_keys: ordinals must increase";
            break;
        }
        prev = want;
        for (;;) {
            if (p >= npages) {
                why = "node_keys: an ordinal past the captured nodes";
                break;
            }
            uint64_t pg;
            memcpy(&pg, (const uint8_t *)pv.buf + 8 * p, 8);
            if (pg < 2 || pg > last_pg) {
                why = "node_keys: a page outside the file";
                break;
            }
            const uint8_t *page = buf + pg * psize;
            uint64_t lower = rd16(page + 12);
            if (lower < 16 || lower > psize || (rd16(page + 10) & P_TYPES) != P_LEAF) {
                why = "node_keys: a leaf page changed since the walk";
                break;
            }
            int64_t nk = (int64_t)(lower - 16) / 2;
            if (want < first + nk) {
                uint64_t ptr = rd16(page + 16 + 2 * (want - first));
                uint64_t ksize = ptr + 8 <= psize ? rd16(page + ptr + 6) : 0;
                if (ptr + 8 > psize || ptr + 8 + ksize > psize) {
                    why = "node_keys: a node changed since the walk";
                    break;
                }
                PyObject *key = PyBytes_FromStringAndSize((const char *)page + ptr + 8, (Py_ssize_t)ksize);
                if (key == NULL) {
                    Py_CLEAR(out);
                    goto done;
                }
                PyList_SET_ITEM(out, (Py_ssize_t)k, key);
                break;
            }
            first += nk;
            p++;
        }
    }
done:
    if (why != NULL) {
        Py_CLEAR(out);
        PyErr_SetString(PyExc_ValueError, why);
    }
    PyBuffer_Release(&b);
    PyBuffer_Release(&pv);
    PyBuffer_Release(&ov);
    return out;
}

static PyMethodDef methods[] = {
    {"node_keys", node_keys, METH_VARARGS,
     "node_keys(buf, psize, last_pg, pages, ordinals): the keys of a hashed capture's nodes at ordinals (increasing)"},
    {"walk", walk, METH_VARARGS,
     "walk(buf, psize, last_pg, free_root, free_depth, main_root, main_depth, capture_db=None, seed=None, "
     "tree_only=False, rec_check=None, stop=None): why "
     "the LMDB file in buf is unsafe (str), else None or (True, klen, keys, is_rec, recs) of capture_db's leaves; "
     "with a seed (True, hashes, lengths, crcs, bits, recs, pages) and no key copied; tree_only: main_root is one "
     "database's tree, captured; rec_check (flags offset, key CRC offset, flag): records checked in place, not "
     "copied (bit 4: a record not its key's); stop (bytearray): its first byte set ends the walk (\"stopped\")"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mod = {
    PyModuleDef_HEAD_INIT, "_lmdbwalk", "The LMDB page walk (index_check.py) in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__lmdbwalk(void) { return PyModule_Create(&mod); }
