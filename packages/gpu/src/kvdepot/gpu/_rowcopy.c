/*
 * kvdepot.gpu._rowcopy: the CPU copy of KV blocks between a KV cache and a pool slot.
 *
 * What to copy comes from a copy table (kvdepot.gpu._table), one row per layer and segment:
 *
 *     (kv, kv_step, slot, slot_step, length)
 *
 * Block ids[j] of that row is the `length` bytes at address kv + ids[j] * kv_step, and its
 * place in the slot starts `slot + j * slot_step` bytes past the slot's first byte. A copy is
 * one memcpy per (table row, block), which loses to one long memcpy when blocks are a few
 * KiB at random addresses; three things win it back:
 *
 *   - Writes: every store to a line that is not cached first reads that line (read for
 *     ownership); a long memcpy avoids it with non-temporal stores, a memcpy per 4 KiB
 *     piece does not. Scatters write with non-temporal (streaming) stores: a scattered
 *     block is next read by a forward pass over the whole sequence, not from the cache.
 *   - Reads: every source piece of a gather starts in a cold page the hardware prefetcher
 *     has not reached; the lines of the next pieces are prefetched while one is copied.
 *   - Threads: one core keeps too few misses in flight to read at random places at full
 *     speed. With `threads` > 1 the pieces are shared out in batches over an OpenMP loop.
 *     The module links libgomp.so.1, and torch (imported first) has already loaded its
 *     own libgomp.so.1, so the loader reuses it. libgomp keeps one thread team per thread
 *     that starts parallel regions: called from the thread that runs torch's operators,
 *     these loops run on torch's intra-op team; called from any other thread, they start
 *     a second team, which makes libgomp stop spinning at the barriers of both (callers
 *     on their own thread pass threads=1). `openmp_library()` names the runtime the loops
 *     resolved to, so the caller can check.
 *
 * Every block id is checked, and every table row against the slot, before any byte moves.
 * The GIL is released while bytes move. Only the C library, SSE2 (x86-64's baseline) and
 * OpenMP are used; without SSE2 pieces are copied with memcpy, without OpenMP on one thread.
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
/* Pieces are shared among threads in batches of at least this many bytes. */
#define BATCH_MIN_BYTES (64 * 1024)
/* Columns of a copy table row. */
enum { KV, KV_STEP, SLOT, SLOT_STEP, LENGTH, COLUMNS };

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

static void prefetch(const char *src, size_t n)
{
#if defined(__GNUC__)
    n = n < PREFETCH_BYTES ? n : PREFETCH_BYTES;
    for (size_t k = 0; k < n; k += LINE) {
        __builtin_prefetch(src + k, 0, 3);
    }
#else
    (void)src;
    (void)n;
#endif
}

typedef struct {
    const int64_t *table;  /* [rows, COLUMNS], a private copy */
    Py_ssize_t rows;
    const int64_t *ids;    /* the chunk's block ids; positions before `skip` are not copied */
    Py_ssize_t skip;
    Py_ssize_t kept;       /* ids copied: num_ids - skip */
    char *slot;            /* the slot's first byte */
    size_t piece_bytes;    /* average bytes of one piece (row, block), for batches and prefetch */
    int to_slot;
    int stream;
} Job;

/* Piece k of the job: table row k / kept, block position skip + k % kept. */
static inline void piece(const Job *job, Py_ssize_t k, char **kv, char **slot, size_t *n)
{
    const int64_t *row = job->table + (k / job->kept) * COLUMNS;
    Py_ssize_t j = job->skip + k % job->kept;
    *kv = (char *)(uintptr_t)(row[KV] + job->ids[j] * row[KV_STEP]);
    *slot = job->slot + row[SLOT] + j * row[SLOT_STEP];
    *n = (size_t)row[LENGTH];
}

/* Copy pieces [lo, hi) of `job`; a gather prefetches the KV pieces a few pieces ahead. */
static void copy_range(const Job *job, Py_ssize_t lo, Py_ssize_t hi)
{
    void (*copy)(char *, const char *, size_t) = copy_plain;
#if KVD_STREAM
    if (job->stream) {
        copy = copy_stream;
    }
#endif
    char *kv, *slot;
    size_t n;
    /* Only a gather reads scattered pieces; a scatter reads the slot, which the hardware
       prefetcher follows. */
    Py_ssize_t ahead = 0;
    if (job->to_slot) {
        ahead = job->piece_bytes >= PREFETCH_BYTES ? 1 : (Py_ssize_t)(PREFETCH_BYTES / (job->piece_bytes + 1)) + 1;
        for (Py_ssize_t k = lo; k < lo + ahead && k < hi; k++) {
            piece(job, k, &kv, &slot, &n);
            prefetch(kv, n);
        }
    }
    for (Py_ssize_t k = lo; k < hi; k++) {
        if (ahead && k + ahead < hi) {
            piece(job, k + ahead, &kv, &slot, &n);
            prefetch(kv, n);
        }
        piece(job, k, &kv, &slot, &n);
        if (job->to_slot) {
            copy(slot, kv, n);
        } else {
            copy(kv, slot, n);
        }
    }
#if KVD_STREAM
    if (job->stream) {
        _mm_sfence(); /* streaming stores are visible to every reader before we return */
    }
#endif
}

/* Copy every piece of `job`, on `threads` OpenMP threads when the module was built with OpenMP.
   Each thread takes about two batches: long enough that the prefetches ahead of a gather
   stay in flight (a batch starts with a stall while its first pieces arrive), short enough
   that a thread the OS preempts leaves work for the others. */
static void copy_job(const Job *job, Py_ssize_t count, int threads)
{
#if defined(_OPENMP)
    if (threads > omp_get_num_procs()) {
        threads = omp_get_num_procs(); /* more would only wait; far more, and libgomp exits the process */
    }
    Py_ssize_t twice = 2 * (Py_ssize_t)threads;
    Py_ssize_t batch = job->piece_bytes >= BATCH_MIN_BYTES ? 1 : (Py_ssize_t)(BATCH_MIN_BYTES / (job->piece_bytes + 1)) + 1;
    Py_ssize_t even = count / twice + (count % twice != 0);
    batch = even > batch ? even : batch;
    Py_ssize_t batches = count / batch + (count % batch != 0);
    if ((Py_ssize_t)threads > batches) {
        threads = (int)batches;
    }
    if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (Py_ssize_t b = 0; b < batches; b++) {
            Py_ssize_t hi = (b + 1) * batch < count ? (b + 1) * batch : count;
            copy_range(job, b * batch, hi);
        }
        return;
    }
#else
    (void)threads;
#endif
    copy_range(job, 0, count);
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

/* The copy table as a private copy (PyMem_Malloc'd; the caller frees it): another thread may
   write the caller's array once the GIL is released. */
static int read_table(PyObject *obj, int64_t **out, Py_ssize_t *rows)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    const char *fmt = view.format ? view.format : "B";
    fmt += (*fmt == '<' || *fmt == '=' || *fmt == '@');
    int ok = view.itemsize == 8 && strlen(fmt) == 1 && strchr("ql", *fmt) != NULL;
    if (!ok || view.len % (COLUMNS * 8) != 0) {
        PyErr_Format(PyExc_TypeError, "table must be C-contiguous int64 rows of %d columns, not format '%s' of %zd "
                     "bytes in %zd bytes", COLUMNS, view.format ? view.format : "B", view.itemsize, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    *out = PyMem_Malloc(view.len > 0 ? (size_t)view.len : 1);
    if (*out == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    memcpy(*out, view.buf, (size_t)view.len);
    *rows = view.len / (COLUMNS * 8);
    PyBuffer_Release(&view);
    return 0;
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

/* Check every table row against the slot and every copied id against the KV cache, before any
   byte moves; set the job's average piece size. */
static int check_job(Job *job, Py_ssize_t num_ids, long long slot_bytes, long long num_blocks)
{
    long long total = 0;
    for (Py_ssize_t i = 0; i < job->rows; i++) {
        const int64_t *row = job->table + i * COLUMNS;
        int64_t end, kv_end;
        if (row[KV] <= 0 || row[KV_STEP] < 0 || row[SLOT] < 0 || row[SLOT_STEP] < 0 || row[LENGTH] < 0 ||
            __builtin_mul_overflow(row[SLOT_STEP], (int64_t)(num_ids > 0 ? num_ids - 1 : 0), &end) ||
            __builtin_add_overflow(end, row[SLOT], &end) || __builtin_add_overflow(end, row[LENGTH], &end) ||
            end > slot_bytes || __builtin_mul_overflow(row[KV_STEP], (int64_t)(num_blocks > 0 ? num_blocks - 1 : 0),
                                                       &kv_end) ||
            __builtin_add_overflow(kv_end, row[KV], &kv_end) || __builtin_add_overflow(kv_end, row[LENGTH], &kv_end)) {
            PyErr_Format(PyExc_IndexError, "table row %zd does not fit a slot of %lld bytes holding %zd blocks, or "
                         "its KV addresses overflow", i, slot_bytes, num_ids);
            return -1;
        }
        total += row[LENGTH];
    }
    for (Py_ssize_t j = job->skip; j < num_ids; j++) {
        if (job->ids[j] < 0 || job->ids[j] >= num_blocks) {
            PyErr_Format(PyExc_IndexError, "ids[%zd] = %lld is outside [0, %lld)", j, (long long)job->ids[j],
                         num_blocks);
            return -1;
        }
    }
    job->piece_bytes = job->rows > 0 ? (size_t)(total / job->rows) : 0;
    return 0;
}

/* Read one chunk's table and ids into `job` (its own copies: release them with free_job) and check
   them; `*count` is its number of pieces. */
static int prepare_job(Job *job, Py_ssize_t *count, PyObject *table_obj, PyObject *ids_obj, Py_ssize_t skip,
                       uintptr_t slot, long long slot_bytes, long long num_blocks, int to_slot, int stream)
{
    if (skip < 0 || slot_bytes < 0 || num_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "skip, slot_bytes and num_blocks must be >= 0");
        return -1;
    }
    int64_t *table = NULL, *ids = NULL;
    Py_ssize_t rows = 0, num_ids = 0;
    if (read_table(table_obj, &table, &rows) < 0) {
        return -1;
    }
    if (block_ids(ids_obj, &ids, &num_ids) < 0) {
        PyMem_Free(table);
        return -1;
    }
    *job = (Job){
        .table = table,
        .rows = rows,
        .ids = ids,
        .skip = skip < num_ids ? skip : num_ids,
        .kept = skip < num_ids ? num_ids - skip : 0,
        .slot = (char *)slot,
        .to_slot = to_slot,
        .stream = stream,
    };
    if (check_job(job, num_ids, slot_bytes, num_blocks) < 0) {
        return -1; /* the caller frees */
    }
    *count = rows * job->kept; /* no overflow: both fit in memory */
    return 0;
}

static void free_job(Job *job)
{
    PyMem_Free((void *)job->ids);
    PyMem_Free((void *)job->table);
    job->ids = job->table = NULL;
}

PyDoc_STRVAR(copy_chunk_doc,
             "copy_chunk(table, ids, skip, slot, slot_bytes, num_blocks, to_slot, stream=True, threads=1)\n"
             "--\n\n"
             "Copy one chunk between the KV cache and the slot of `slot_bytes` bytes at address `slot`:\n"
             "gather (`to_slot`) or scatter. `table` holds C-contiguous int64 rows (kv, kv_step, slot,\n"
             "slot_step, length): for each row and each position j >= skip of `ids` (a sequence of ints,\n"
             "each in [0, num_blocks)), the `length` bytes at address kv + ids[j] * kv_step go to, or come\n"
             "from, slot + row's slot + j * slot_step. Every id and every row is checked before any byte\n"
             "moves (IndexError). `stream` writes with non-temporal stores where the CPU has them.\n"
             "`threads` > 1 shares the pieces among that many OpenMP threads (when built with OpenMP).\n"
             "The GIL is released while bytes move.");

static PyObject *copy_chunk(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"table",   "ids",    "skip",    "slot", "slot_bytes", "num_blocks",
                               "to_slot", "stream", "threads", NULL};
    PyObject *table_obj, *ids_obj;
    Py_ssize_t skip;
    uintptr_t slot;
    long long slot_bytes, num_blocks;
    int to_slot, stream = 1, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOnO&LLp|pi:copy_chunk", keywords, &table_obj, &ids_obj, &skip,
                                     address_arg, &slot, &slot_bytes, &num_blocks, &to_slot, &stream, &threads)) {
        return NULL;
    }
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "threads must be > 0");
        return NULL;
    }
    Job job = {0};
    Py_ssize_t count = 0;
    if (prepare_job(&job, &count, table_obj, ids_obj, skip, slot, slot_bytes, num_blocks, to_slot, stream) < 0) {
        free_job(&job);
        return NULL;
    }
    if (count > 0) {
        Py_BEGIN_ALLOW_THREADS copy_job(&job, count, threads);
        Py_END_ALLOW_THREADS
    }
    free_job(&job);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_chunks_doc,
             "copy_chunks(chunks, num_blocks, to_slot, stream=True, threads=1)\n"
             "--\n\n"
             "copy_chunk for each (table, ids, skip, slot, slot_bytes) of the sequence `chunks`, with the\n"
             "GIL released once for all of them: a thread that must wait for the GIL after each release\n"
             "(up to the interpreter's switch interval while another thread runs Python) waits once.\n"
             "Every chunk is checked before any byte of any chunk moves.");

static PyObject *copy_chunks(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"chunks", "num_blocks", "to_slot", "stream", "threads", NULL};
    PyObject *chunks_obj;
    long long num_blocks;
    int to_slot, stream = 1, threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OLp|pi:copy_chunks", keywords, &chunks_obj, &num_blocks, &to_slot,
                                     &stream, &threads)) {
        return NULL;
    }
    if (threads < 1) {
        PyErr_SetString(PyExc_ValueError, "threads must be > 0");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(chunks_obj, "chunks must be a sequence of (table, ids, skip, slot, slot_bytes)");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Job *jobs = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(Job));
    Py_ssize_t *counts = PyMem_Calloc((size_t)(n > 0 ? n : 1), sizeof(Py_ssize_t));
    PyObject *result = NULL;
    if (jobs == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *table_obj, *ids_obj;
        Py_ssize_t skip;
        uintptr_t slot;
        long long slot_bytes;
        if (!PyTuple_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "chunks[%zd] must be a tuple (table, ids, skip, slot, slot_bytes)", i);
            goto done;
        }
        if (!PyArg_ParseTuple(items[i], "OOnO&L:copy_chunks", &table_obj, &ids_obj, &skip, address_arg, &slot,
                              &slot_bytes) ||
            prepare_job(&jobs[i], &counts[i], table_obj, ids_obj, skip, slot, slot_bytes, num_blocks, to_slot,
                        stream) < 0) {
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (counts[i] > 0) {
            copy_job(&jobs[i], counts[i], threads);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    if (jobs != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            free_job(&jobs[i]);
        }
    }
    PyMem_Free(jobs);
    PyMem_Free(counts);
    Py_DECREF(seq);
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
    {"copy_chunk", (PyCFunction)(void (*)(void))copy_chunk, METH_VARARGS | METH_KEYWORDS, copy_chunk_doc},
    {"copy_chunks", (PyCFunction)(void (*)(void))copy_chunks, METH_VARARGS | METH_KEYWORDS, copy_chunks_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvdepot.gpu._rowcopy", "Block copies between a KV cache and pool slots, by copy table.", -1,
    methods, NULL, NULL, NULL, NULL,
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
