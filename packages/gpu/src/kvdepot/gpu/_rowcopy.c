/*
 * kvdepot.gpu._rowcopy: copy rows between two row matrices of host memory.
 *
 * The CPU copy path (kvdepot.gpu._flat) sees every KV storage as rows of one matrix and
 * moves a chunk as a list of rows. numpy and torch copy each row with memcpy, which
 * loses to one long memcpy when the rows are a few KiB at random addresses:
 *
 *   - Writes: every store to a line that is not cached first reads that line (read for
 *     ownership); a long memcpy avoids it with non-temporal stores, a memcpy per 4 KiB
 *     row does not. Here rows are written with non-temporal (streaming) stores when
 *     asked. Scatters use them: a scattered block is next read by a forward pass over
 *     the whole sequence, not straight away from the cache.
 *   - Reads: every listed source row starts in a cold page the hardware prefetcher has
 *     not reached; the lines of the next few rows are prefetched in software while the
 *     current row is copied.
 *   - Threads: one core keeps too few misses in flight to read rows at random places at
 *     full speed. With `threads` > 1 the rows are shared out in 64 KiB batches over an
 *     OpenMP parallel loop. The module links libgomp.so.1, and torch (imported first)
 *     has already loaded its own libgomp.so.1, so the loader reuses it: these loops run
 *     on torch's intra-op thread team, which is hot after a forward pass, rather than
 *     on threads of our own that would compete with it for the cores.
 *
 * The GIL is released while bytes move. Every row number is checked against its matrix
 * before any byte moves. Only the C library, SSE2 (x86-64's baseline) and OpenMP are
 * used; without SSE2 rows are copied with memcpy, without OpenMP on one thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define KVD_STREAM 1
#else
#define KVD_STREAM 0
#endif

/* Software prefetch keeps about this many source bytes in flight ahead of the copy. */
#define PREFETCH_BYTES (16 * 1024)
#define LINE 64

static void copy_plain(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

#if KVD_STREAM
/* memcpy with non-temporal stores; the caller issues the closing sfence. */
static void copy_stream(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst) & 15; /* stores must be 16-byte aligned */
    if (head > n) {
        head = n;
    }
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
}
#endif

static void prefetch_row(const char *row, size_t row_bytes)
{
#if defined(__GNUC__)
    size_t n = row_bytes < PREFETCH_BYTES ? row_bytes : PREFETCH_BYTES;
    for (size_t k = 0; k < n; k += LINE) {
        __builtin_prefetch(row + k, 0, 3);
    }
#else
    (void)row;
    (void)row_bytes;
#endif
}

typedef struct {
    Py_buffer view;
    const int64_t *rows; /* NULL: row i is row i */
    Py_ssize_t count;
} RowList;

/* Take `obj` (None, or a C-contiguous buffer of 64-bit integers) as a list of row numbers. */
static int row_list(PyObject *obj, const char *name, RowList *out)
{
    out->rows = NULL;
    out->count = -1;
    out->view.obj = NULL;
    if (obj == Py_None) {
        return 0;
    }
    if (PyObject_GetBuffer(obj, &out->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *fmt = out->view.format ? out->view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') {
        fmt++;
    }
    if (out->view.itemsize != 8 || strlen(fmt) != 1 || strchr("qlQL", *fmt) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must hold 64-bit integers, not format '%s' of %zd bytes", name,
                     out->view.format ? out->view.format : "B", out->view.itemsize);
        PyBuffer_Release(&out->view);
        out->view.obj = NULL;
        return -1;
    }
    out->rows = (const int64_t *)out->view.buf;
    out->count = out->view.len / 8;
    return 0;
}

static void release(RowList *list)
{
    if (list->view.obj != NULL) {
        PyBuffer_Release(&list->view);
    }
}

/* Every row number of `list` (or 0..count-1) lies in [0, limit). */
static int check_rows(const RowList *list, Py_ssize_t count, long long limit, const char *name)
{
    if (list->rows == NULL) {
        if (count > limit) {
            PyErr_Format(PyExc_IndexError, "%s: %zd rows do not fit a matrix of %lld", name, count, limit);
            return -1;
        }
        return 0;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t r = list->rows[i];
        if (r < 0 || r >= limit) {
            PyErr_Format(PyExc_IndexError, "%s[%zd] = %lld is outside a matrix of %lld rows", name, i, (long long)r,
                         limit);
            return -1;
        }
    }
    return 0;
}

typedef struct {
    char *dst;
    const int64_t *dst_rows; /* NULL: row i is row i */
    const char *src;
    const int64_t *src_rows;
    Py_ssize_t count;
    size_t row_bytes;
    int stream;
} Job;

/* Copy rows [lo, hi) of `job`, prefetching listed source rows a few rows ahead. */
static void copy_range(const Job *job, Py_ssize_t lo, Py_ssize_t hi)
{
    void (*copy)(char *, const char *, size_t) = copy_plain;
#if KVD_STREAM
    if (job->stream) {
        copy = copy_stream;
    }
#endif
    size_t row_bytes = job->row_bytes;
    /* Only a listed source is scattered; a contiguous one the hardware prefetcher follows. */
    Py_ssize_t ahead = 0;
    if (job->src_rows != NULL) {
        ahead = row_bytes >= PREFETCH_BYTES ? 1 : (Py_ssize_t)(PREFETCH_BYTES / row_bytes);
        for (Py_ssize_t i = lo; i < lo + ahead && i < hi; i++) {
            prefetch_row(job->src + (size_t)job->src_rows[i] * row_bytes, row_bytes);
        }
    }
    for (Py_ssize_t i = lo; i < hi; i++) {
        if (ahead && i + ahead < hi) {
            prefetch_row(job->src + (size_t)job->src_rows[i + ahead] * row_bytes, row_bytes);
        }
        size_t d = job->dst_rows ? (size_t)job->dst_rows[i] : (size_t)i;
        size_t s = job->src_rows ? (size_t)job->src_rows[i] : (size_t)i;
        copy(job->dst + d * row_bytes, job->src + s * row_bytes, row_bytes);
    }
#if KVD_STREAM
    if (job->stream) {
        _mm_sfence(); /* streaming stores are visible to every reader before we return */
    }
#endif
}

/* Rows are shared among threads in batches of about this many bytes. */
#define BATCH_BYTES (64 * 1024)

/* Copy every row of `job`, on `threads` OpenMP threads when the module was built with OpenMP. */
static void copy_job(const Job *job, int threads)
{
#if defined(_OPENMP)
    Py_ssize_t batch = job->row_bytes >= BATCH_BYTES ? 1 : (Py_ssize_t)(BATCH_BYTES / job->row_bytes);
    Py_ssize_t batches = (job->count + batch - 1) / batch;
    if (threads > 1 && batches > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (Py_ssize_t b = 0; b < batches; b++) {
            Py_ssize_t hi = (b + 1) * batch < job->count ? (b + 1) * batch : job->count;
            copy_range(job, b * batch, hi);
        }
        return;
    }
#else
    (void)threads;
#endif
    copy_range(job, 0, job->count);
}

/* An address: a non-negative int that fits a pointer (PyArg's "K" would wrap -1 around). */
static int address_arg(PyObject *obj, void *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "an address must be an int, not %.80s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        return 0;
    }
    if (value > UINTPTR_MAX) {
        PyErr_SetString(PyExc_OverflowError, "address does not fit a pointer");
        return 0;
    }
    *(uintptr_t *)out = (uintptr_t)value;
    return 1;
}

PyDoc_STRVAR(copy_rows_doc,
             "copy_rows(dst, dst_rows, dst_limit, src, src_rows, src_limit, count, row_bytes, stream=True, threads=1)\n"
             "--\n\n"
             "Copy `count` rows of `row_bytes` bytes: row `src_rows[i]` of the matrix at address `src`\n"
             "to row `dst_rows[i]` of the matrix at address `dst`. A row list is None (row i) or a\n"
             "C-contiguous buffer of 64-bit integers with `count` items; every row number must be\n"
             "below its matrix's row count (`dst_limit`, `src_limit`), checked before any byte\n"
             "moves (IndexError). `stream` writes with non-temporal stores where the CPU has them.\n"
             "`threads` > 1 shares the rows among that many OpenMP threads (if built with OpenMP).\n"
             "The rows must not overlap. The GIL is released while bytes move.");

static PyObject *copy_rows(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"dst",   "dst_rows",  "dst_limit", "src", "src_rows", "src_limit",
                               "count", "row_bytes", "stream", "threads", NULL};
    uintptr_t dst_address, src_address;
    long long dst_limit, src_limit;
    Py_ssize_t count, row_bytes;
    PyObject *dst_obj, *src_obj;
    int stream = 1, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&OLO&OLnn|pi:copy_rows", keywords, address_arg, &dst_address,
                                     &dst_obj, &dst_limit, address_arg, &src_address, &src_obj, &src_limit, &count,
                                     &row_bytes, &stream, &threads)) {
        return NULL;
    }
    if (count < 0 || row_bytes <= 0 || dst_limit < 0 || src_limit < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "count and the limits must be >= 0, row_bytes and threads > 0");
        return NULL;
    }
    if ((dst_address == 0 || src_address == 0) && count > 0) {
        PyErr_SetString(PyExc_ValueError, "null address");
        return NULL;
    }
    RowList dst_rows, src_rows;
    if (row_list(dst_obj, "dst_rows", &dst_rows) < 0) {
        return NULL;
    }
    if (row_list(src_obj, "src_rows", &src_rows) < 0) {
        release(&dst_rows);
        return NULL;
    }
    PyObject *result = NULL;
    if ((dst_rows.rows && dst_rows.count != count) || (src_rows.rows && src_rows.count != count)) {
        PyErr_Format(PyExc_ValueError, "row lists of %zd and %zd items for a count of %zd",
                     dst_rows.rows ? dst_rows.count : count, src_rows.rows ? src_rows.count : count, count);
    } else if (check_rows(&dst_rows, count, dst_limit, "dst_rows") == 0 &&
               check_rows(&src_rows, count, src_limit, "src_rows") == 0) {
        Job job = {(char *)dst_address, dst_rows.rows, (const char *)src_address,
                   src_rows.rows, count, (size_t)row_bytes, stream};
        Py_BEGIN_ALLOW_THREADS copy_job(&job, threads);
        Py_END_ALLOW_THREADS result = Py_NewRef(Py_None);
    }
    release(&dst_rows);
    release(&src_rows);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_rows", (PyCFunction)(void (*)(void))copy_rows, METH_VARARGS | METH_KEYWORDS, copy_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvdepot.gpu._rowcopy", "Row copies between host-memory row matrices.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowcopy(void)
{
    PyObject *m = PyModule_Create(&module);
#if defined(_OPENMP)
    int openmp = 1;
#else
    int openmp = 0;
#endif
    if (m != NULL && (PyModule_AddIntConstant(m, "STREAMING_STORES", KVD_STREAM) < 0 ||
                      PyModule_AddIntConstant(m, "OPENMP", openmp) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
