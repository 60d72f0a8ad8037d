/*
 * kvdepot.gpu._rowcopy: copy KV blocks between a KV cache seen as one row matrix and a
 * pool slot.
 *
 * The CPU copy path (kvdepot.gpu._flat) sees every KV storage as rows of one matrix: row
 * `pattern[p, r] + block_id * block_rows[p]` holds row `r` of a block in plane (layer) `p`,
 * and a slot holds a chunk's rows plane by plane. numpy and torch copy each row with
 * memcpy, which loses to one long memcpy when rows are a few KiB at random addresses:
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
 *     `openmp_library()` names the runtime the loops resolved to, so the caller can check.
 *
 * Row numbers are computed here from the block ids, with no index array built per call
 * in Python (that cost about 10% of a 2 MiB chunk's copy). The GIL is released while
 * bytes move. Every row is checked against its matrix before any byte moves. Only the C library, SSE2 (x86-64's baseline) and OpenMP are
 * used; without SSE2 rows are copied with memcpy, without OpenMP on one thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(_OPENMP)
#include <dlfcn.h>
#include <omp.h>
#endif

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

/* A C-contiguous buffer of 64-bit integers, or an error naming `name`. */
typedef struct {
    Py_buffer view;
    const int64_t *items;
    Py_ssize_t count;
} Int64s;

static int int64s(PyObject *obj, const char *name, Int64s *out)
{
    out->view.obj = NULL;
    if (PyObject_GetBuffer(obj, &out->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *fmt = out->view.format ? out->view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') {
        fmt++;
    }
    if (out->view.itemsize != 8 || strlen(fmt) != 1 || strchr("ql", *fmt) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must hold 64-bit signed integers, not format '%s' of %zd bytes", name,
                     out->view.format ? out->view.format : "B", out->view.itemsize);
        PyBuffer_Release(&out->view);
        out->view.obj = NULL;
        return -1;
    }
    out->items = (const int64_t *)out->view.buf;
    out->count = out->view.len / 8;
    return 0;
}

static void release(Int64s *ints)
{
    if (ints->view.obj != NULL) {
        PyBuffer_Release(&ints->view);
        ints->view.obj = NULL;
    }
}

typedef struct {
    const char *kv;          /* row 0 of the KV matrix */
    char *slot;              /* the slot's first row */
    const int64_t *ids;      /* block ids, in slot order */
    Py_ssize_t num_ids;
    const int64_t *pattern;  /* [planes, rows_per_block]: KV rows of block 0 */
    const int64_t *block_rows; /* [planes]: KV rows from one block to the next */
    Py_ssize_t rows_per_block;
    Py_ssize_t plane_rows;   /* slot rows from one plane to the next */
    Py_ssize_t count;        /* planes * num_ids * rows_per_block, set by check_job */
    size_t row_bytes;
    int to_slot;
    int stream;
} Job;

/* The KV row and the slot row of the job's row `k` (plane-major, then block, then row). */
static inline void job_rows(const Job *job, Py_ssize_t k, size_t *kv_row, size_t *slot_row)
{
    Py_ssize_t per_plane = job->num_ids * job->rows_per_block;
    Py_ssize_t p = k / per_plane, in_plane = k % per_plane;
    Py_ssize_t j = in_plane / job->rows_per_block, r = in_plane % job->rows_per_block;
    *kv_row = (size_t)(job->pattern[p * job->rows_per_block + r] + job->ids[j] * job->block_rows[p]);
    *slot_row = (size_t)(p * job->plane_rows + in_plane);
}

/* Copy rows [lo, hi) of `job`; a gather prefetches the KV rows a few rows ahead. */
static void copy_range(const Job *job, Py_ssize_t lo, Py_ssize_t hi)
{
    void (*copy)(char *, const char *, size_t) = copy_plain;
#if KVD_STREAM
    if (job->stream) {
        copy = copy_stream;
    }
#endif
    size_t row_bytes = job->row_bytes, kv_row, slot_row;
    /* Only a gather reads scattered rows; a scatter reads the slot, which the hardware
       prefetcher follows. */
    Py_ssize_t ahead = 0;
    if (job->to_slot) {
        ahead = row_bytes >= PREFETCH_BYTES ? 1 : (Py_ssize_t)(PREFETCH_BYTES / row_bytes);
        for (Py_ssize_t k = lo; k < lo + ahead && k < hi; k++) {
            job_rows(job, k, &kv_row, &slot_row);
            prefetch_row(job->kv + kv_row * row_bytes, row_bytes);
        }
    }
    for (Py_ssize_t k = lo; k < hi; k++) {
        if (ahead && k + ahead < hi) {
            job_rows(job, k + ahead, &kv_row, &slot_row);
            prefetch_row(job->kv + kv_row * row_bytes, row_bytes);
        }
        job_rows(job, k, &kv_row, &slot_row);
        char *slot = job->slot + slot_row * row_bytes;
        char *kv = (char *)job->kv + kv_row * row_bytes;
        if (job->to_slot) {
            copy(slot, kv, row_bytes);
        } else {
            copy(kv, slot, row_bytes);
        }
    }
#if KVD_STREAM
    if (job->stream) {
        _mm_sfence(); /* streaming stores are visible to every reader before we return */
    }
#endif
}

/* Rows are shared among threads in batches of at least this many bytes. */
#define BATCH_MIN_BYTES (64 * 1024)

/* Copy every row of `job`, on `threads` OpenMP threads when the module was built with OpenMP.
   Each thread takes about two batches: long enough that the prefetches ahead of a gather
   stay in flight (a batch starts with a stall while its first rows arrive; 64 KiB batches
   measured 5% slower than 1 MiB ones for a 2 MiB gather on 2 threads), short enough that
   a thread the OS preempts leaves work for the others. */
static void copy_job(const Job *job, int threads)
{
#if defined(_OPENMP)
    if (threads > omp_get_num_procs()) {
        threads = omp_get_num_procs(); /* more would only wait; far more, and libgomp exits the process */
    }
    Py_ssize_t twice = 2 * (Py_ssize_t)threads;
    Py_ssize_t batch = job->row_bytes >= BATCH_MIN_BYTES ? 1 : (Py_ssize_t)(BATCH_MIN_BYTES / job->row_bytes);
    Py_ssize_t even = job->count / twice + (job->count % twice != 0);
    batch = even > batch ? even : batch;
    Py_ssize_t batches = job->count / batch + (job->count % batch != 0);
    if ((Py_ssize_t)threads > batches) {
        threads = (int)batches;
    }
    if (threads > 1) {
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
    if (value == 0 || value > UINTPTR_MAX) {
        PyErr_SetString(PyExc_ValueError, "an address must be a non-null pointer");
        return 0;
    }
    *(uintptr_t *)out = (uintptr_t)value;
    return 1;
}

/* Block ids from a sequence of ints, into `*out` (PyMem_Malloc'd; the caller frees it). */
static int block_ids(PyObject *obj, int64_t **out, Py_ssize_t *count)
{
    PyObject *seq = PySequence_Fast(obj, "ids must be a sequence of ints");
    if (seq == NULL) {
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *ids = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (ids == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < n; j++) {
        if (!PyLong_Check(items[j])) {
            PyErr_Format(PyExc_TypeError, "ids[%zd] must be an int, not %.80s", j, Py_TYPE(items[j])->tp_name);
            break;
        }
        ids[j] = PyLong_AsLongLong(items[j]);
        if (ids[j] == -1 && PyErr_Occurred()) {
            break;
        }
    }
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        PyMem_Free(ids);
        return -1;
    }
    *out = ids;
    *count = n;
    return 0;
}

/* Count the job's rows and check that every one lies inside its matrix, before any byte moves. */
static int check_job(Job *job, Py_ssize_t planes, long long kv_rows, long long slot_rows)
{
    Py_ssize_t per_plane, count, span;
    if (__builtin_mul_overflow(job->num_ids, job->rows_per_block, &per_plane) ||
        __builtin_mul_overflow(per_plane, planes, &count) ||
        __builtin_mul_overflow(planes - 1, job->plane_rows, &span) || __builtin_add_overflow(span, per_plane, &span)) {
        PyErr_SetString(PyExc_OverflowError, "the copy's row numbers overflow 64 bits");
        return -1;
    }
    if (job->plane_rows < per_plane) {
        PyErr_Format(PyExc_ValueError, "plane_rows %zd is under the %zd rows of one plane", job->plane_rows, per_plane);
        return -1;
    }
    if (job->num_ids > 0 && span > slot_rows) {
        PyErr_Format(PyExc_IndexError, "%zd planes of %zd blocks do not fit a slot of %lld rows", planes, job->num_ids,
                     slot_rows);
        return -1;
    }
    for (Py_ssize_t p = 0; p < planes; p++) {
        int64_t step = job->block_rows[p];
        int64_t low = INT64_MAX, high = INT64_MIN;
        for (Py_ssize_t r = 0; r < job->rows_per_block; r++) {
            int64_t row = job->pattern[p * job->rows_per_block + r];
            low = row < low ? row : low;
            high = row > high ? row : high;
        }
        for (Py_ssize_t j = 0; j < job->num_ids; j++) {
            int64_t id = job->ids[j], first, last;
            if (step < 0 || low < 0 || id < 0 || __builtin_mul_overflow(id, step, &first) ||
                __builtin_add_overflow(first, high, &last) || last >= kv_rows) {
                PyErr_Format(PyExc_IndexError, "ids[%zd] = %lld: plane %zd's rows of that block are outside a matrix of "
                             "%lld rows", j, (long long)id, p, kv_rows);
                return -1;
            }
        }
    }
    job->count = count;
    return 0;
}

PyDoc_STRVAR(copy_blocks_doc,
             "copy_blocks(kv, kv_rows, slot, slot_rows, ids, pattern, block_rows, plane_rows, row_bytes, to_slot,\n"
             "            stream=True, threads=1)\n"
             "--\n\n"
             "Copy blocks between a KV cache seen as a matrix of `kv_rows` rows of `row_bytes` bytes at\n"
             "address `kv` and a slot of `slot_rows` rows at address `slot`: gather (`to_slot`) or scatter.\n"
             "Row r of block ids[j] in plane p is KV row pattern[p, r] + ids[j] * block_rows[p] and slot\n"
             "row p * plane_rows + j * rows_per_block + r. `ids` is a sequence of ints; `pattern` (planes x\n"
             "rows_per_block) and `block_rows` (planes) are C-contiguous int64 buffers. Every row is checked\n"
             "against its matrix before any byte moves (IndexError). `stream` writes with non-temporal\n"
             "stores where the CPU has them. `threads` > 1 shares the rows among that many OpenMP threads\n"
             "(when built with OpenMP). The GIL is released while bytes move.");

static PyObject *copy_blocks(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"kv",         "kv_rows",   "slot",    "slot_rows", "ids",     "pattern", "block_rows",
                               "plane_rows", "row_bytes", "to_slot", "stream",    "threads", NULL};
    uintptr_t kv, slot;
    long long kv_rows, slot_rows;
    Py_ssize_t plane_rows, row_bytes;
    PyObject *ids_obj, *pattern_obj, *block_rows_obj;
    int to_slot, stream = 1, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&LO&LOOOnnp|pi:copy_blocks", keywords, address_arg, &kv,
                                     &kv_rows, address_arg, &slot, &slot_rows, &ids_obj, &pattern_obj,
                                     &block_rows_obj, &plane_rows, &row_bytes, &to_slot, &stream, &threads)) {
        return NULL;
    }
    if (kv_rows < 0 || slot_rows < 0 || plane_rows < 0 || row_bytes <= 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError, "row counts must be >= 0, row_bytes and threads > 0");
        return NULL;
    }
    Int64s pattern = {.view = {.obj = NULL}}, block_rows = {.view = {.obj = NULL}};
    int64_t *ids = NULL, *geometry = NULL;
    Py_ssize_t num_ids = 0, planes = 0;
    PyObject *result = NULL;
    if (int64s(pattern_obj, "pattern", &pattern) < 0 || int64s(block_rows_obj, "block_rows", &block_rows) < 0 ||
        block_ids(ids_obj, &ids, &num_ids) < 0) {
        goto done;
    }
    planes = block_rows.count;
    if (planes < 1 || pattern.count < planes || pattern.count % planes != 0 ||
        (pattern.view.ndim >= 2 && pattern.view.shape[0] != planes)) {
        PyErr_Format(PyExc_ValueError, "pattern of %zd rows does not split into %zd planes", pattern.count, planes);
        goto done;
    }
    /* Private copies: another thread may write the caller's arrays once the GIL is released. */
    geometry = PyMem_Malloc((size_t)(pattern.count + planes) * sizeof(int64_t));
    if (geometry == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(geometry, pattern.items, (size_t)pattern.count * sizeof(int64_t));
    memcpy(geometry + pattern.count, block_rows.items, (size_t)planes * sizeof(int64_t));
    Job job = {
        .kv = (const char *)kv,
        .slot = (char *)slot,
        .ids = ids,
        .num_ids = num_ids,
        .pattern = geometry,
        .block_rows = geometry + pattern.count,
        .rows_per_block = pattern.count / planes,
        .plane_rows = plane_rows,
        .row_bytes = (size_t)row_bytes,
        .to_slot = to_slot,
        .stream = stream,
    };
    release(&pattern);
    release(&block_rows);
    if (check_job(&job, planes, kv_rows, slot_rows) < 0) {
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS copy_job(&job, threads);
    Py_END_ALLOW_THREADS result = Py_NewRef(Py_None);
done:
    PyMem_Free(ids);
    PyMem_Free(geometry);
    release(&pattern);
    release(&block_rows);
    return result;
}

PyDoc_STRVAR(openmp_library_doc, "openmp_library()\n--\n\n"
                                 "The file of the OpenMP runtime the copies run on, or None without OpenMP.");

static PyObject *openmp_library(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
#if defined(_OPENMP)
    Dl_info info;
    if (dladdr((void *)&omp_get_max_threads, &info) && info.dli_fname != NULL) {
        return PyUnicode_DecodeFSDefault(info.dli_fname);
    }
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"openmp_library", openmp_library, METH_NOARGS, openmp_library_doc},
    {"copy_blocks", (PyCFunction)(void (*)(void))copy_blocks, METH_VARARGS | METH_KEYWORDS, copy_blocks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvdepot.gpu._rowcopy", "Block copies between a KV cache row matrix and pool slots.", -1, methods, NULL, NULL, NULL, NULL,
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
