/* A batch's (address, nbytes) buffers in one C pass: pairs_into (as two int64 arrays), pairs_dst (a
 * get's destinations, checked) and pairs_src (a put's sources, checked).
 *
 * The SGLang backend hands every put and get 256+ such tuples; numpy's np.array over them costs
 * ~1 us per tuple (it discovers the nested shape and type item by item). Only the plainest form is
 * taken here: a list or tuple of exact 2-tuples of exact ints (never bools, which are ints in
 * Python) that fit int64. Anything else answers False with the outputs unspecified, and the
 * caller takes its general path, which checks and explains each buffer. pairs_dst and pairs_src
 * check a buffer as memory.Ranges.resolve_pairs does (the last registered range starting at or
 * below its address holds it whole) and decline what that would send to the checked path.
 */
#include "uring_internal.h"

PyObject *mod_pairs_into(PyObject *mod, PyObject *args) {
    PyObject *seq, *o_a, *o_n;
    if (!PyArg_ParseTuple(args, "OOO", &seq, &o_a, &o_n)) return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_FALSE;
    Arr a, n;
    a.held = n.held = 0;
    PyObject *ret = NULL;
    if (arr_get(o_a, &a, "addrs", 8, "lq", 1, 0) < 0 || arr_get(o_n, &n, "nbytes", 8, "lq", 1, 0) < 0) goto done;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (arr_len(&a) != len || arr_len(&n) != len) {
        PyErr_Format(PyExc_ValueError, "addrs and nbytes must hold one entry per buffer (%zd), got %zd and %zd", len,
                     arr_len(&a), arr_len(&n));
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t *ap = a.view.buf, *np_ = n.view.buf;
    ret = Py_True;
    for (Py_ssize_t i = 0; i < len; i++) {
        PyObject *t = items[i];
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2) {
            ret = Py_False;
            break;
        }
        PyObject *x = PyTuple_GET_ITEM(t, 0), *y = PyTuple_GET_ITEM(t, 1);
        if (!PyLong_CheckExact(x) || !PyLong_CheckExact(y)) {
            ret = Py_False;
            break;
        }
        int ox = 0, oy = 0;
        long long vx = PyLong_AsLongLongAndOverflow(x, &ox), vy = PyLong_AsLongLongAndOverflow(y, &oy);
        if (ox || oy) {
            ret = Py_False;
            break;
        }
        ap[i] = vx;
        np_[i] = vy;
    }
    Py_INCREF(ret);
done:
    arr_release(&a);
    arr_release(&n);
    return ret;
}

/* *t as an exact (address, nbytes) tuple of ints, address >= addr_min, 1 < nbytes, wholly inside
 * the registered range of the last start <= address: 0 with *addr and *nb set, -1 when it is not so. */
static int pair_in(PyObject *t, const int64_t *st, const int64_t *en, Py_ssize_t nr, int64_t addr_min, int64_t *addr,
                   int64_t *nb) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 2) return -1;
    PyObject *x = PyTuple_GET_ITEM(t, 0), *y = PyTuple_GET_ITEM(t, 1);
    if (!PyLong_CheckExact(x) || !PyLong_CheckExact(y)) return -1;
    int ox = 0, oy = 0;
    long long a = PyLong_AsLongLongAndOverflow(x, &ox), b = PyLong_AsLongLongAndOverflow(y, &oy);
    if (ox || oy || a < addr_min || b <= 1) return -1;
    Py_ssize_t lo = 0, hi = nr; /* the last range starting at or below a */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (st[mid] <= a) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0 || b > en[lo - 1] - a) return -1; /* never a + b: it wraps for b near 2**63 */
    *addr = a;
    *nb = b;
    return 0;
}

/* pairs_dst(buffers, idx, lens, segs, starts, ends, direct, align, addr_min, out) -> bool: a get's
 * destinations in one pass. Op j reads lens[j] bytes of segment segs[j] into buffers[idx[j]]: an
 * exact (address, nbytes) tuple of ints, address >= addr_min, 1 < nbytes, lens[j] <= nbytes, wholly
 * inside the registered range of the last start <= address (starts sorted, ends beside them); on an
 * O_DIRECT segment (direct[seg]) address and length are multiples of align[seg] (nothing to bounce).
 * out[j] = the address. False (out partly written) where an op is not so: the caller's general path
 * then explains each buffer (memory.py, staging.py). Bad arrays or an index out of range raise. */
PyObject *mod_pairs_dst(PyObject *mod, PyObject *args) {
    PyObject *seq, *o[8];
    long long addr_min;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLO", &seq, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &addr_min, &o[7]))
        return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_FALSE;
    static const char *names[8] = {"idx", "lens", "segs", "starts", "ends", "direct", "align", "out"};
    Arr a[8];
    int got = 0;
    PyObject *ret = NULL;
    for (; got < 8; got++) {
        int is_bool = got == 5;
        if (arr_get(o[got], &a[got], names[got], is_bool ? 1 : 8, is_bool ? "?" : got == 7 ? "LQ" : "lq", got == 7,
                    0) < 0)
            goto done;
    }
    Py_ssize_t m = arr_len(&a[0]), nr = arr_len(&a[3]), nseg = arr_len(&a[5]), nbuf = PySequence_Fast_GET_SIZE(seq);
    if (arr_len(&a[1]) != m || arr_len(&a[2]) != m || arr_len(&a[7]) != m || arr_len(&a[4]) != nr ||
        arr_len(&a[6]) != nseg) {
        PyErr_SetString(PyExc_ValueError, "idx, lens, segs and out must have one entry per op; starts and ends, "
                                          "direct and align one per range and per segment");
        goto done;
    }
    const int64_t *idx = a[0].view.buf, *lens = a[1].view.buf, *segs = a[2].view.buf, *st = a[3].view.buf,
                  *en = a[4].view.buf, *al = a[6].view.buf;
    const uint8_t *direct = a[5].view.buf;
    int64_t *out = a[7].view.buf;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    ret = Py_True;
    for (Py_ssize_t j = 0; j < m; j++) {
        if (idx[j] < 0 || idx[j] >= nbuf || segs[j] < 0 || segs[j] >= nseg) {
            PyErr_Format(PyExc_IndexError, "op %zd: buffer %lld or segment %lld out of range", j, (long long)idx[j],
                         (long long)segs[j]);
            ret = NULL;
            goto done;
        }
        int64_t addr, nb;
        if (lens[j] < 0 || pair_in(items[idx[j]], st, en, nr, addr_min, &addr, &nb) < 0 || nb < lens[j]) {
            ret = Py_False;
            break;
        }
        int64_t k = al[segs[j]];
        if (direct[segs[j]] && (k <= 0 || addr % k || lens[j] % k)) {
            ret = Py_False;
            break;
        }
        out[j] = addr;
    }
    Py_INCREF(ret);
done:
    for (int i = 0; i < got; i++) arr_release(&a[i]);
    return ret;
}

/* pairs_src(buffers, starts, ends, addr_min, max_bytes, align, addrs uint64[], lens int64[]) -> int:
 * a put's sources in one pass: every buffer an exact (address, nbytes) tuple of ints, address >=
 * addr_min, 1 < nbytes <= max_bytes, wholly inside the registered range of the last start <=
 * address. 2 when every address and length is also a multiple of align (nothing to bounce on any
 * O_DIRECT file of that alignment), 1 when not, 0 (outputs partly written) where a buffer is not
 * so: the caller's checked path explains it. */
PyObject *mod_pairs_src(PyObject *mod, PyObject *args) {
    PyObject *seq, *o[4];
    long long addr_min, max_bytes, align;
    if (!PyArg_ParseTuple(args, "OOOLLLOO", &seq, &o[0], &o[1], &addr_min, &max_bytes, &align, &o[2], &o[3]))
        return NULL;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return PyLong_FromLong(0);
    if (align <= 0) return PyErr_Format(PyExc_ValueError, "align must be positive, got %lld", align);
    static const char *names[4] = {"starts", "ends", "addrs", "lens"};
    Arr a[4];
    int got = 0;
    PyObject *ret = NULL;
    for (; got < 4; got++)
        if (arr_get(o[got], &a[got], names[got], 8, got == 2 ? "LQ" : "lq", got >= 2, 0) < 0) goto done;
    Py_ssize_t nr = arr_len(&a[0]), n = PySequence_Fast_GET_SIZE(seq);
    if (arr_len(&a[1]) != nr || arr_len(&a[2]) != n || arr_len(&a[3]) != n) {
        PyErr_SetString(PyExc_ValueError, "starts and ends must match; addrs and lens need one entry per buffer");
        goto done;
    }
    const int64_t *st = a[0].view.buf, *en = a[1].view.buf;
    int64_t *ad = a[2].view.buf, *ln = a[3].view.buf;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long code = 2;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (pair_in(items[j], st, en, nr, addr_min, &ad[j], &ln[j]) < 0 || ln[j] > max_bytes) {
            code = 0;
            break;
        }
        if ((ad[j] | ln[j]) % align) code = 1;
    }
    ret = PyLong_FromLong(code);
done:
    for (int i = 0; i < got; i++) arr_release(&a[i]);
    return ret;
}
