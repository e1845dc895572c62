/* probe(): what this kernel offers (a throwaway ring), for the doctor and the engine choice. */
#include "uring_internal.h"

PyObject *mod_probe(PyObject *mod, PyObject *unused) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    struct umbp_params p;
    int fd, err = 0;
    unsigned flags = 0;
    struct umbp_probe *pr = calloc(1, sizeof *pr);
    int probed = 0;
    Py_BEGIN_ALLOW_THREADS
    fd = try_setup(4, UMBP_SETUP_SUBMIT_ALL | UMBP_SETUP_COOP_TASKRUN, &p);
    if (fd == -EINVAL) fd = try_setup(4, 0, &p);
    if (fd < 0) err = -fd;
    else {
        flags = p.flags;
        probed = pr && sys_register(fd, UMBP_REGISTER_PROBE, pr, 256) >= 0;
        close(fd);
    }
    Py_END_ALLOW_THREADS
    struct utsname u;
    const char *kernel = uname(&u) == 0 ? u.release : "";
    PyObject *ops = PyDict_New();
    static const struct {
        const char *name;
        int op;
    } names[] = {{"read", UMBP_OP_READ},   {"write", UMBP_OP_WRITE}, {"read_fixed", UMBP_OP_READ_FIXED},
                 {"write_fixed", UMBP_OP_WRITE_FIXED}, {"fsync", UMBP_OP_FSYNC}, {"async_cancel", UMBP_OP_ASYNC_CANCEL}};
    for (size_t i = 0; ops && i < sizeof names / sizeof names[0]; i++) {
        int ok = probed && names[i].op < pr->ops_len && (pr->ops[names[i].op].flags & 1);
        PyDict_SetItemString(ops, names[i].name, ok ? Py_True : Py_False);
    }
    free(pr);
    PyObject *items[][2] = {
        {PyUnicode_FromString("ring"), PyBool_FromLong(fd >= 0)},
        {PyUnicode_FromString("errno"), PyLong_FromLong(err)},
        {PyUnicode_FromString("error"), PyUnicode_FromString(err ? strerror(err) : "")},
        {PyUnicode_FromString("features"), PyLong_FromUnsignedLong(fd >= 0 ? p.features : 0)},
        {PyUnicode_FromString("setup_flags"), PyLong_FromUnsignedLong(flags)},
        {PyUnicode_FromString("ext_arg"), PyBool_FromLong(fd >= 0 && (p.features & UMBP_FEAT_EXT_ARG))},
        {PyUnicode_FromString("nodrop"), PyBool_FromLong(fd >= 0 && (p.features & UMBP_FEAT_NODROP))},
        {PyUnicode_FromString("submit_all"), PyBool_FromLong(!!(flags & UMBP_SETUP_SUBMIT_ALL))},
        {PyUnicode_FromString("coop_taskrun"), PyBool_FromLong(!!(flags & UMBP_SETUP_COOP_TASKRUN))},
        {PyUnicode_FromString("sse42"), PyBool_FromLong(umbp_crc32c_hw_available())},
        {PyUnicode_FromString("crc32c"), PyUnicode_FromString(umbp_crc32c_impl_name(umbp_crc32c_impl()))},
        {PyUnicode_FromString("kernel"), PyUnicode_FromString(kernel)},
        {PyUnicode_FromString("ops"), ops},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) {
        if (!items[i][0] || !items[i][1] || PyDict_SetItem(d, items[i][0], items[i][1]) < 0) bad = 1;
        Py_XDECREF(items[i][0]);
        Py_XDECREF(items[i][1]);
    }
    if (bad) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}
