/*
 * Page bytes read out of read-only shared mappings of segment files, each page
 * copied into the caller's memory and checked (xxh3-128) in the same pass, with
 * the fault a damaged file raises caught: the Python module
 * kvgraftd.store._mapped_pages (used by kvgraftd.store.segment_maps).
 *
 * Why a mapping: a pread copies out of the page cache at ~9 GB/s on the
 * machines this was written on, where a copy from a mapping runs at memcpy's
 * rate, and the check rides on the copy (each piece hashed while it is still
 * in the core's cache) instead of reading the page a second time.
 * Why a guard: touching a mapped byte the file no longer has (a segment cut
 * short under the daemon) or the disk cannot give (EIO) raises SIGBUS, which
 * kills the process. Every access to a mapping happens under this module's
 * guard, armed in the reading thread over the page being read: in copy_pages
 * here, or in the attention kernel's guarded calls (engine/native/attend), which
 * arm it through kvg_fault_guard_arm. The SIGBUS handler jumps back out of the
 * copy or the kernel, which reports the page as not read. A SIGBUS anywhere
 * else goes to the handler that was there before (Python's faulthandler, or
 * the default action: the process ends, as it would have without this module).
 *
 * map(fd, length) -> address: a read-only shared mapping of `length` bytes of
 *   the file from offset 0 (it may reach past the file's end: those bytes
 *   fault, caught as above); OSError where mmap fails. unmap(address, length).
 * copy_pages(sources, dests, lengths, checksums) -> (index, why): for each
 *   page i in order, copy lengths[i] bytes from address sources[i] into the
 *   writable buffer dests[i] (at least that long); where `checksums` is not
 *   None (bytes, 16 a page), hash them as they are copied and compare with
 *   checksums[16 i : 16 i + 16] (xxh3-128, canonical: big-endian, as
 *   python-xxhash's digest). (-1, 0) when every page was copied and matched;
 *   else (i, FAULTED) for the first page that faulted (its buffer holds part of
 *   it) or (i, MISMATCH) for the first that failed its check. The copies run
 *   without the GIL; the buffers must not change size meanwhile. The copy and
 *   hash run in the best build the CPU has (mapped_copy.h: AVX-512, AVX2 or
 *   portable, chosen once through engine/native/cpu_features.h); every build
 *   gives the same digests (builds() names those the CPU runs, select(name)
 *   switches: for the tests that compare them).
 * kvg_fault_guard_arm / kvg_fault_guard_disarm (C, not Python): the same guard for
 *   another library's native code that reads a mapping (the attention kernel over
 *   stored pages); one handler for the process, so guards never chain into each other.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_features.h"
#define KVG_SUFFIX portable
#include "mapped_copy.h" /* the portable build: SSE2's xxh3 on x86-64 */

enum { PAGE_FAULTED = 1, PAGE_MISMATCH = 2 };

/* initial-exec: the handler reads them without a call that might allocate (glibc keeps
 * room in the static TLS block for a module loaded later, as these few bytes) */
#define KVG_THREAD __thread __attribute__((tls_model("initial-exec")))
static KVG_THREAD sigjmp_buf *armed;      /* this thread's way out of a faulting read */
static KVG_THREAD const char *armed_from; /* the bytes it may fault on: [from, to) */
static KVG_THREAD const char *armed_to;
static struct sigaction previous;            /* whoever handled SIGBUS before us */
static volatile sig_atomic_t passed_on;      /* a foreign SIGBUS went to `previous` once */
static pthread_mutex_t installing = PTHREAD_MUTEX_INITIALIZER;

static void on_bus_error(int signal_number, siginfo_t *info, void *context) {
    sigjmp_buf *jump = armed;
    const char *at = (const char *)info->si_addr;
    /* si_code > 0: raised by the kernel for an access, not sent (kill, sigqueue) */
    if (jump != NULL && info->si_code > 0 && at >= armed_from && at < armed_to) {
        armed = NULL;
        siglongjmp(*jump, 1);
    }
    /* not a fault of ours: what was there before decides */
    const int has_handler = (previous.sa_flags & SA_SIGINFO) ||
                            (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN);
    if (has_handler && !passed_on) {
        passed_on = 1; /* a handler that raises again (faulthandler, once it has printed)
                        * comes back here: the default action then */
        if (previous.sa_flags & SA_SIGINFO)
            previous.sa_sigaction(signal_number, info, context);
        else
            previous.sa_handler(signal_number);
        passed_on = 0;
        return;
    }
    if (!has_handler && previous.sa_handler == SIG_IGN && info->si_code <= 0)
        return; /* sent, and ignored before we were here */
    signal(signal_number, SIG_DFL); /* as if we had never been here: the process ends */
    raise(signal_number);
}

/* Ours is the SIGBUS handler from here on (something installed after us, e.g.
 * faulthandler enabled later, keeps its place as `previous`). */
static void install_handler(void) {
    struct sigaction current;
    armed_to = armed_from = NULL; /* this thread's guard exists before any fault may need it */
    sigaction(SIGBUS, NULL, &current);
    if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_bus_error) return;
    pthread_mutex_lock(&installing);
    sigaction(SIGBUS, NULL, &current);
    if (!((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_bus_error)) {
        struct sigaction ours;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_bus_error;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        previous = current;
        passed_on = 0;
        sigaction(SIGBUS, &ours, NULL);
    }
    pthread_mutex_unlock(&installing);
}

typedef int (*copy_and_check_fn)(const char *, char *, size_t, const uint8_t *);
#if KVG_X86_BUILDS
int kvg_copy_and_check_avx2(const char *, char *, size_t, const uint8_t *);
int kvg_copy_and_check_avx512(const char *, char *, size_t, const uint8_t *);
#endif
static copy_and_check_fn copy_and_check = kvg_copy_and_check_portable;

/* The guard, for native code of other libraries too (the attention kernel reads stored
 * pages where they lie: kvgraftd.engine.model.decode_attention hands it these two):
 * arm(jump, from, to) after sigsetjmp(*jump, 1) in a frame that outlives the reads; a
 * SIGBUS on [from, to) in this thread then returns there with 1; disarm() after. */
void kvg_fault_guard_arm(sigjmp_buf *jump, const void *from, const void *to) {
    install_handler();
    armed_from = from;
    armed_to = to;
    armed = jump;
}

void kvg_fault_guard_disarm(void) { armed = NULL; }

/* The pages' copies, GIL released by the caller: -1, or the first bad page (*why). */
static Py_ssize_t copy_all(const uint64_t *sources, Py_buffer *dests, const uint64_t *lengths,
                           const uint8_t *checksums, Py_ssize_t count, int *why) {
    sigjmp_buf jump;
    volatile Py_ssize_t page = 0; /* read again after a jump back: kept in memory */
    if (sigsetjmp(jump, 1)) {     /* 1: the jump restores the signal mask */
        *why = PAGE_FAULTED;
        return page;
    }
    for (; page < count; page++) {
        const Py_ssize_t i = page;
        const char *source = (const char *)(uintptr_t)sources[i];
        kvg_fault_guard_arm(&jump, source, source + lengths[i]);
        int mismatch = copy_and_check(source, dests[i].buf, lengths[i],
                                      checksums ? checksums + 16 * i : NULL);
        kvg_fault_guard_disarm();
        if (mismatch) {
            *why = PAGE_MISMATCH;
            return i;
        }
    }
    return -1;
}

static int read_u64s(PyObject *sequence, Py_ssize_t count, uint64_t *out, const char *what) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(sequence, i);
        out[i] = PyLong_AsUnsignedLongLong(item);
        if (out[i] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] is not an address or a length", what, i);
            return -1;
        }
    }
    return 0;
}

static PyObject *copy_pages(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_pages(sources, dests, lengths, checksums)");
        return NULL;
    }
    PyObject *sources = PySequence_Fast(args[0], "sources must be a sequence");
    PyObject *dests = PySequence_Fast(args[1], "dests must be a sequence");
    PyObject *lengths = PySequence_Fast(args[2], "lengths must be a sequence");
    Py_buffer checksums = {0};
    uint64_t *numbers = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t count = 0, held = 0, bad = -1;
    int why = 0;
    PyObject *result = NULL;
    if (sources == NULL || dests == NULL || lengths == NULL) goto done;
    count = PySequence_Fast_GET_SIZE(sources);
    if (PySequence_Fast_GET_SIZE(dests) != count || PySequence_Fast_GET_SIZE(lengths) != count) {
        PyErr_SetString(PyExc_ValueError, "sources, dests and lengths differ in length");
        goto done;
    }
    if (args[3] != Py_None) {
        if (PyObject_GetBuffer(args[3], &checksums, PyBUF_SIMPLE) < 0) goto done;
        if (checksums.len != 16 * count) {
            PyErr_SetString(PyExc_ValueError, "checksums must hold 16 bytes a page");
            goto done;
        }
    }
    numbers = PyMem_Malloc(sizeof *numbers * 2 * (count ? count : 1));
    views = PyMem_Calloc(count ? count : 1, sizeof *views);
    if (numbers == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (read_u64s(sources, count, numbers, "sources") < 0 ||
        read_u64s(lengths, count, numbers + count, "lengths") < 0)
        goto done;
    for (; held < count; held++) {
        PyObject *dest = PySequence_Fast_GET_ITEM(dests, held);
        if (PyObject_GetBuffer(dest, &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if ((uint64_t)views[held].len < numbers[count + held]) {
            PyBuffer_Release(&views[held]);
            PyErr_Format(PyExc_ValueError, "dests[%zd] is shorter than its page", held);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    bad = copy_all(numbers, views, numbers + count, checksums.buf, count, &why);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(ni)", bad, why);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    if (checksums.obj != NULL) PyBuffer_Release(&checksums);
    PyMem_Free(views);
    PyMem_Free(numbers);
    Py_XDECREF(sources);
    Py_XDECREF(dests);
    Py_XDECREF(lengths);
    return result;
}

static PyObject *map_file(PyObject *module, PyObject *args) {
    int fd;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "in:map", &fd, &length)) return NULL;
    void *address = mmap(NULL, (size_t)length, PROT_READ, MAP_SHARED, fd, 0);
    if (address == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromVoidPtr(address);
}

static PyObject *unmap_file(PyObject *module, PyObject *args) {
    PyObject *address;
    Py_ssize_t length;
    if (!PyArg_ParseTuple(args, "On:unmap", &address, &length)) return NULL;
    void *pointer = PyLong_AsVoidPtr(address);
    if (pointer == NULL && PyErr_Occurred()) return NULL;
    if (munmap(pointer, (size_t)length) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

/* The builds this CPU runs, portable first; `select` makes one of them the one used (tests
 * compare them; the best is chosen at import). */
static const struct {
    const char *name;
    copy_and_check_fn function;
    int (*runs)(void);
} builds[] = {
    {"portable", kvg_copy_and_check_portable, NULL},
#if KVG_X86_BUILDS
    {"avx2", kvg_copy_and_check_avx2, kvg_cpu_has_avx2_fma},
    {"avx512", kvg_copy_and_check_avx512, kvg_cpu_has_avx512},
#endif
};
#define BUILD_COUNT (sizeof builds / sizeof builds[0])

static PyObject *list_builds(PyObject *module, PyObject *unused) {
    PyObject *names = PyList_New(0);
    for (size_t i = 0; names != NULL && i < BUILD_COUNT; i++) {
        if (builds[i].runs != NULL && !builds[i].runs()) continue;
        PyObject *name = PyUnicode_FromString(builds[i].name);
        if (name == NULL || PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static PyObject *select_build(PyObject *module, PyObject *arg) {
    const char *wanted = PyUnicode_AsUTF8(arg);
    if (wanted == NULL) return NULL;
    for (size_t i = 0; i < BUILD_COUNT; i++) {
        if (strcmp(builds[i].name, wanted) != 0) continue;
        if (builds[i].runs != NULL && !builds[i].runs()) break;
        copy_and_check = builds[i].function;
        Py_RETURN_NONE;
    }
    return PyErr_Format(PyExc_ValueError, "no build %s that this CPU runs", wanted);
}

static PyMethodDef methods[] = {
    {"builds", list_builds, METH_NOARGS, "builds() -> the builds this CPU runs, best last"},
    {"select", select_build, METH_O, "select(name): copy with that build from now on"},
    {"map", map_file, METH_VARARGS, "map(fd, length) -> address of a read-only shared mapping"},
    {"unmap", unmap_file, METH_VARARGS, "unmap(address, length)"},
    {"copy_pages", (PyCFunction)(void (*)(void))copy_pages, METH_FASTCALL,
     "copy_pages(sources, dests, lengths, checksums) -> (index, why); see the module"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {
    PyModuleDef_HEAD_INIT, "_mapped_pages",
    "Guarded, checked copies out of segment mappings (see mapped_pages.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__mapped_pages(void) {
    for (size_t i = 0; i < BUILD_COUNT; i++) /* the last this CPU runs: the best */
        if (builds[i].runs == NULL || builds[i].runs()) copy_and_check = builds[i].function;
    PyObject *module = PyModule_Create(&module_definition);
    if (module == NULL) return NULL;
    if (PyModule_AddIntConstant(module, "FAULTED", PAGE_FAULTED) < 0 ||
        PyModule_AddIntConstant(module, "MISMATCH", PAGE_MISMATCH) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
