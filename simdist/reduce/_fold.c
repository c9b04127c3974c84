/* simdist's native fold kernel: see simdist/reduce/native.py for what it computes and how it is checked.
   Built at install as the optional extension simdist.reduce._simdist_fold (setup.py), else on first use into a
   cache. No -ffast-math, -ffp-contract=off: IEEE adds, no fused multiply-add. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
#error "simdist's fold kernel needs float expressions evaluated in their own type (FLT_EVAL_METHOD == 0)"
#endif

/* Bits <-> values through memcpy: buffers hold raw bits, a NaN is never stored from a float register. */
static inline float f32_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static inline uint32_t bits_f32(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline double f64_of(uint64_t u) { double x; memcpy(&x, &u, 8); return x; }
static inline uint64_t bits_f64(double x) { uint64_t u; memcpy(&u, &x, 8); return u; }

static inline int nan32(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
static inline int nan64(uint64_t u) { return (u & 0x7FFFFFFFFFFFFFFFull) > 0x7FF0000000000000ull; }
static inline int nan16(uint16_t h) { return (h & 0x7FFFu) > 0x7C00u; }

/* fp32/fp64: the receiving rank's (local) NaN quieted, else the partial's, else the default NaN */
static inline uint32_t rule32(uint32_t v, uint32_t l, uint32_t a) {
    if (!nan32(v)) return v;
    return nan32(l) ? (l | 0x00400000u) : nan32(a) ? (a | 0x00400000u) : 0xFFC00000u;
}
static inline uint64_t rule64(uint64_t v, uint64_t l, uint64_t a) {
    if (!nan64(v)) return v;
    return nan64(l) ? (l | 0x0008000000000000ull) : nan64(a) ? (a | 0x0008000000000000ull) : 0xFFF8000000000000ull;
}

/* bf16: widening is exact; narrowing is c10's round to nearest even, every NaN 0x7FC0 */
static inline float bf16_wide(uint16_t h) { return f32_of((uint32_t)h << 16); }
static inline uint16_t bf16_narrow(float x) {
    uint32_t u = bits_f32(x);
    if (nan32(u)) return 0x7FC0u;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp16 <-> fp32, exact widening and IEEE round-to-nearest-even narrowing (a NaN narrows to a NaN whose bits
   are the caller's to set: f16_result) */
static inline float f16_wide(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return f32_of(sign | 0x7F800000u | (m << 13));
    if (e != 0) return f32_of(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return f32_of(sign);
    uint32_t shift = 0;
    while (!(m & 0x400u)) { m <<= 1; shift++; }
    return f32_of(sign | ((113u - shift) << 23) | ((m & 0x3FFu) << 13));
}
static inline uint16_t f16_narrow(uint32_t u) {
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t ax = u & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return 0x7E00u;                     /* NaN */
    if (ax >= 0x477FF000u) return sign | 0x7C00u;            /* >= 65520 (and inf): infinity */
    if (ax >= 0x38800000u)                                     /* >= 2^-14: a normal half */
        return sign | (uint16_t)(((ax + 0x0FFFu + ((ax >> 13) & 1u)) >> 13) - (112u << 10));
    if (ax <= 0x33000000u) return sign;                        /* <= 2^-25: zero (2^-25 ties to even) */
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u, shift = 126u - (ax >> 23);
    uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}
static inline uint16_t f16_result(float v, uint16_t l, uint16_t a) {
    uint32_t u = bits_f32(v);
    if (!nan32(u)) return f16_narrow(u);
    int negative = nan16(l) ? (l >> 15) : nan16(a) ? (a >> 15) : 1;
    return negative ? 0xFE00u : 0x7E00u;
}

/* NaN results of a hop, walked again with the rule (see FOLD) */
static inline uint32_t slow32(uint32_t l, uint32_t a, int mul) {
    return rule32(bits_f32(mul ? f32_of(l) * f32_of(a) : f32_of(l) + f32_of(a)), l, a);
}
static inline uint64_t slow64(uint64_t l, uint64_t a, int mul) {
    return rule64(bits_f64(mul ? f64_of(l) * f64_of(a) : f64_of(l) + f64_of(a)), l, a);
}
static inline uint16_t slowbf(uint16_t l, uint16_t a, int mul) {
    return bf16_narrow(mul ? bf16_wide(l) * bf16_wide(a) : bf16_wide(l) + bf16_wide(a));
}
static inline uint16_t slowhf(uint16_t l, uint16_t a, int mul) {
    return f16_result(mul ? f16_wide(l) * f16_wide(a) : f16_wide(l) + f16_wide(a), l, a);
}

static inline int isnanbf(uint16_t h) { return (h & 0x7FFFu) > 0x7F80u; }

#define BLOCK 1024 /* elements folded together: the partial stays in L1 over the hops */
#define SHORT 8     /* shorter chunks (of a repeating order) are folded element by element */
#define BAIL 8      /* code bit: NaN bits are the eager path's (torch's), so stop at a NaN result */

/* One hop over a run of elements, acc[e] = local[e] (op) acc[e], without the NaN rule (vectorised): a NaN is
   absorbing, so the elements whose fold ends NaN are walked again with the rule (SLOW) */
#define FAST(NAME, ATTR, T, EXPR)                                                           \
    ATTR static void NAME(T *restrict acc, const T *restrict local, int64_t len) {         \
        for (int64_t e = 0; e < len; e++) { T l = local[e], a = acc[e]; acc[e] = (EXPR); } \
    }

/* Fold elements [lo, lo + len) of one reduction: hop j reads member rows[h_j + p] (h_j = j, or n-1-j when
   descending); first the plain fold, then the elements that end NaN walked again with the rule -- or, for a
   reduction whose NaN bits are torch's (bail), 1 at the first NaN: the caller runs the eager path. */
#define FOLD(NAME, ATTR, T, ADD, MUL, SLOW, ISNAN)                                                   \
    ATTR static int NAME(const int64_t *plan, int64_t p, int mul, int bail, const char *const *members, \
                         T *out, int64_t lo, int64_t len) {                                          \
        const int64_t n = plan[0], descending = plan[4];                                             \
        const int64_t *rows = plan + 5;                                                              \
        const T *first = (const T *)members[rows[(descending ? n - 1 : 0) + p]] + lo;                \
        T *acc = out + lo;                                                                           \
        memcpy(acc, first, (size_t)len * sizeof(T));                                                \
        for (int64_t j = 1; j < n; j++) {                                                            \
            const T *local = (const T *)members[rows[(descending ? n - 1 - j : j) + p]] + lo;        \
            if (mul) MUL(acc, local, len); else ADD(acc, local, len);                                \
        }                                                                                            \
        int any = 0;                                                                                 \
        for (int64_t e = 0; e < len; e++) any |= ISNAN(acc[e]);                                      \
        if (!any || bail) return any;                                                                \
        for (int64_t e = 0; e < len; e++) {                                                          \
            if (!ISNAN(acc[e])) continue;                                                            \
            T w = first[e];                                                                          \
            for (int64_t j = 1; j < n; j++)                                                          \
                w = SLOW(((const T *)members[rows[(descending ? n - 1 - j : j) + p]])[lo + e], w, mul); \
            acc[e] = w;                                                                              \
        }                                                                                            \
        return 0;                                                                                    \
    }

/* Chunks of a few elements (the textbook ring's one-element chunks): element by element, each chunk's hop
   members looked up in a table (period x n); then, as in FOLD, the NaN results walked again with the rule,
   or with bail 1 if there is one. */
static inline uint32_t fast32(uint32_t l, uint32_t a, int mul) {
    return bits_f32(mul ? f32_of(l) * f32_of(a) : f32_of(l) + f32_of(a));
}
static inline uint64_t fast64(uint64_t l, uint64_t a, int mul) {
    return bits_f64(mul ? f64_of(l) * f64_of(a) : f64_of(l) + f64_of(a));
}
static inline uint16_t fasthf(uint16_t l, uint16_t a, int mul) {
    return f16_narrow(bits_f32(mul ? f16_wide(l) * f16_wide(a) : f16_wide(l) + f16_wide(a)));
}
#define TABLE 1024 /* hop-member pointers kept on the stack */
#define ELEMENTS(NAME, T, FASTS, SLOW, ISNAN)                                                                \
    static int NAME(const int64_t *plan, int mul, int bail, const char *const *members, T *out) {            \
        const int64_t n = plan[0], numel = plan[1], length = plan[2], period = plan[3], descending = plan[4]; \
        const int64_t *rows = plan + 5;                                                                       \
        const T *stack_table[TABLE];                                                                          \
        const T **table = n * period <= TABLE ? stack_table : malloc((size_t)(n * period) * sizeof(T *));   \
        if (table == NULL) return 1;                                                                          \
        for (int64_t p = 0; p < period; p++)                                                                  \
            for (int64_t j = 0; j < n; j++)                                                                   \
                table[p * n + j] = (const T *)members[rows[(descending ? n - 1 - j : j) + p]];                \
        int any = 0;                                                                                          \
        for (int64_t pass = 0; pass < 2; pass++) {                                                            \
            for (int64_t lo = 0, p = 0; lo < numel; lo += length, p = p + 1 == period ? 0 : p + 1) {          \
                const T *const *hop = table + p * n;                                                          \
                const int64_t end = numel - lo < length ? numel : lo + length;                               \
                for (int64_t e = lo; e < end; e++) {                                                          \
                    if (pass == 1 && !ISNAN(out[e])) continue;                                                \
                    T w = hop[0][e];                                                                          \
                    if (pass == 0) {                                                                          \
                        for (int64_t j = 1; j < n; j++) w = FASTS(hop[j][e], w, mul);                         \
                        any |= ISNAN(w);                                                                      \
                    } else {                                                                                  \
                        for (int64_t j = 1; j < n; j++) w = SLOW(hop[j][e], w, mul);                          \
                    }                                                                                         \
                    out[e] = w;                                                                               \
                }                                                                                             \
            }                                                                                                 \
            if (!any || bail) break;                                                                          \
        }                                                                                                     \
        if (table != stack_table) free(table);                                                                \
        return any && bail;                                                                                   \
    }
ELEMENTS(elements32, uint32_t, fast32, slow32, nan32)
ELEMENTS(elements64, uint64_t, fast64, slow64, nan64)
ELEMENTS(elementsbf, uint16_t, slowbf, slowbf, isnanbf)
ELEMENTS(elementshf, uint16_t, fasthf, slowhf, nan16)

/* The fold of one block for every dtype, compiled once per instruction set (S: the name's suffix) */
#define VARIANT(S, ATTR)                                                                                  \
    FAST(add32##S, ATTR, uint32_t, bits_f32(f32_of(l) + f32_of(a)))                                       \
    FAST(mul32##S, ATTR, uint32_t, bits_f32(f32_of(l) * f32_of(a)))                                       \
    FAST(add64##S, ATTR, uint64_t, bits_f64(f64_of(l) + f64_of(a)))                                       \
    FAST(mul64##S, ATTR, uint64_t, bits_f64(f64_of(l) * f64_of(a)))                                       \
    FAST(addbf##S, ATTR, uint16_t, bf16_narrow(bf16_wide(l) + bf16_wide(a)))                              \
    FAST(mulbf##S, ATTR, uint16_t, bf16_narrow(bf16_wide(l) * bf16_wide(a)))                              \
    FAST(addhf##S, ATTR, uint16_t, f16_narrow(bits_f32(f16_wide(l) + f16_wide(a))))                       \
    FAST(mulhf##S, ATTR, uint16_t, f16_narrow(bits_f32(f16_wide(l) * f16_wide(a))))                       \
    FOLD(fold32##S, ATTR, uint32_t, add32##S, mul32##S, slow32, nan32)                                    \
    FOLD(fold64##S, ATTR, uint64_t, add64##S, mul64##S, slow64, nan64)                                    \
    FOLD(foldbf##S, ATTR, uint16_t, addbf##S, mulbf##S, slowbf, isnanbf)                                  \
    FOLD(foldhf##S, ATTR, uint16_t, addhf##S, mulhf##S, slowhf, nan16)                                    \
    ATTR static int block##S(const int64_t *plan, int code, int64_t p, const char *const *members,       \
                             char *out, int64_t b, int64_t len) {                                        \
        const int mul = code & 1, bail = (code & BAIL) != 0;                                             \
        switch ((code & 7) >> 1) {                                                                       \
        case 0: return fold32##S(plan, p, mul, bail, members, (uint32_t *)out, b, len);                  \
        case 1: return fold64##S(plan, p, mul, bail, members, (uint64_t *)out, b, len);                  \
        case 2: return foldbf##S(plan, p, mul, bail, members, (uint16_t *)out, b, len);                  \
        default: return foldhf##S(plan, p, mul, bail, members, (uint16_t *)out, b, len);                 \
        }                                                                                                \
    }

VARIANT(_base, )
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2 1
VARIANT(_avx2, __attribute__((target("avx2"))))
#endif

typedef int (*block_fn)(const int64_t *, int, int64_t, const char *const *, char *, int64_t, int64_t);
static block_fn fold_block = block_base; /* block_avx2 where the CPU has it (module init) */

/* plan: [n, numel, length, period, descending, rows[0 .. n + period - 2]] (FoldPlan's fields); 1 if it bailed */
static int fold_item(const int64_t *plan, int code, const char *const *members, char *out) {
    const int64_t numel = plan[1], length = plan[2], period = plan[3];
    if (length < SHORT && period > 1) {
        const int mul = code & 1, bail = (code & BAIL) != 0;
        switch ((code & 7) >> 1) {
        case 0: return elements32(plan, mul, bail, members, (uint32_t *)out);
        case 1: return elements64(plan, mul, bail, members, (uint64_t *)out);
        case 2: return elementsbf(plan, mul, bail, members, (uint16_t *)out);
        default: return elementshf(plan, mul, bail, members, (uint16_t *)out);
        }
    }
    const block_fn block = fold_block;
    for (int64_t lo = 0, chunk = 0; lo < numel; lo += length, chunk++) {
        const int64_t end = numel - lo < length ? numel : lo + length, p = chunk % period;
        for (int64_t b = lo; b < end; b += BLOCK)
            if (block(plan, code, p, members, out, b, end - b < BLOCK ? end - b : BLOCK)) return 1;
    }
    return 0;
}

/* INTO: fold each block of the plan into a scratch block (in L1), then copy it into every out at the same elements.
   A block reads the members only at its own elements, so an out may be a member (never a partial overlap: the
   caller checks). Only for the FOLD path without bail: it cannot stop midway with some outs written.
   The scratch block starts 1 KiB past the first member's offset within a 4 KiB page (64-byte aligned): large
   tensors share one page offset, and a block of 4 KiB spans every L1 set once, so a scratch block at their offset
   competes for the same sets and its stores alias their loads (4K aliasing). Left to where it fell on the
   thread's stack, that cost up to 20 % of a 64 MiB all-reduce, more on some rank threads than others. */
#define PAGE 4096
static void fold_into_outs(const int64_t *plan, int code, const char *const *members, const char **shifted,
                           char *const *outs, int64_t nout, int64_t size) {
    const int64_t n = plan[0], numel = plan[1], length = plan[2], period = plan[3];
    union { uint64_t align; char bytes[BLOCK * 8 + PAGE]; } raw;
    const uintptr_t want = ((uintptr_t)members[0] + 1024) & (PAGE - 64), base = (uintptr_t)raw.bytes;
    char *const scratch = raw.bytes + ((want - base) & (PAGE - 1));
    const block_fn block = fold_block;
    for (int64_t lo = 0, chunk = 0; lo < numel; lo += length, chunk++) {
        const int64_t end = numel - lo < length ? numel : lo + length, p = chunk % period;
        for (int64_t b = lo; b < end; b += BLOCK) {
            const int64_t len = end - b < BLOCK ? end - b : BLOCK;
            for (int64_t r = 0; r < n; r++) shifted[r] = members[r] + b * size;
            block(plan, code, p, shifted, scratch, 0, len);
            for (int64_t o = 0; o < nout; o++) memcpy(outs[o] + b * size, scratch, (size_t)(len * size));
        }
    }
}

/* every out either is a member or overlaps no member and no other out (ranges of nbytes each) */
static int outs_separate(const char *const *members, int64_t n, char *const *outs, int64_t nout, int64_t nbytes) {
    for (int64_t o = 0; o < nout; o++) {
        for (int64_t r = 0; r < n; r++) {
            const char *a = outs[o], *m = members[r];
            if (a != m && (a < m ? m - a : a - m) < nbytes) return 0;
        }
        for (int64_t q = 0; q < o; q++) {
            const char *a = outs[o], *m = outs[q];
            if (a == m || (a < m ? m - a : a - m) < nbytes) return 0;
        }
    }
    return 1;
}

/* -- the Python entry point: fold(plan, code, members, out, mode) -> bool ---------------------------------- */

#define COPIES 1 /* stacked members: every member row of out receives the result */
#define FLAT 2   /* listed members: contiguous tensors of any shape, read in memory order */
#define INTO 4   /* listed members, out a sequence of tensors: the result written into each of them, block by block
                    (an in-place all-reduce: one read of each member, one write of each out) */

#define MAX_DIMS 64

static PyObject *s_data_ptr, *s_shape, *s_stride, *s_dtype, *s_is_cpu, *s_is_contiguous, *s_requires_grad;

static int pointer_of(PyObject *t, char **ptr) {
    PyObject *v = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (v == NULL) return -1;
    *ptr = (char *)PyLong_AsVoidPtr(v);
    Py_DECREF(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* a tuple of ints (torch.Size, a stride tuple) into values[]; its length, or -1 */
static int ints_of(PyObject *tuple, int64_t *values) {
    if (tuple == NULL) return -1;
    Py_ssize_t len = PyTuple_Check(tuple) ? PyTuple_GET_SIZE(tuple) : -1;
    if (len < 0 || len > MAX_DIMS) { Py_DECREF(tuple); return -1; }
    for (Py_ssize_t i = 0; i < len; i++) values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i));
    Py_DECREF(tuple);
    return PyErr_Occurred() ? -1 : (int)len;
}

static int geometry_of(PyObject *t, int64_t *shape, int64_t *stride) {
    int ndim = ints_of(PyObject_GetAttr(t, s_shape), shape);
    if (ndim < 0 || ints_of(PyObject_CallMethodNoArgs(t, s_stride), stride) != ndim) return -1;
    return ndim;
}

static int flag_of(PyObject *value) { /* consumes value: 1, 0, or -1 */
    if (value == NULL) return -1;
    int flag = PyObject_IsTrue(value);
    Py_DECREF(value);
    return flag;
}

/* The fewest trailing dimensions holding numel elements, contiguous; their first index, or -1. */
static int member_dims(const int64_t *shape, const int64_t *stride, int ndim, int64_t numel) {
    int inner = ndim;
    int64_t count = 1;
    while (inner > 1 && count < numel) count *= shape[--inner];
    if (count != numel) return -1;
    for (int64_t d = ndim - 1, expected = 1; d >= inner; d--) {
        if (shape[d] != 1 && stride[d] != expected) return -1;
        expected *= shape[d];
    }
    return inner;
}

typedef struct {
    const int64_t *plan;
    int code, ndim, inner, copies;
    int64_t size, items;
    const char *base;
    char *out;
    int64_t shape[MAX_DIMS], stride[MAX_DIMS], out_stride[MAX_DIMS];
} strided_job;

/* every batch item of a stacked [n, *batch, *member] tensor (odometer over the batch dimensions) */
static int run_strided(strided_job *job, const char **members) {
    const int64_t n = job->plan[0], numel = job->plan[1], size = job->size;
    int64_t index[MAX_DIMS] = {0}, offset = 0, out_offset = 0;
    for (int64_t item = 0; item < job->items; item++) {
        for (int64_t r = 0; r < n; r++) members[r] = job->base + (r * job->stride[0] + offset) * size;
        if (job->copies) {
            char *first = job->out + out_offset * size;
            if (fold_item(job->plan, job->code, members, first)) return 1;
            for (int64_t r = 1; r < n; r++)
                memcpy(first + r * job->out_stride[0] * size, first, (size_t)(numel * size));
        } else if (fold_item(job->plan, job->code, members, job->out + item * numel * size)) {
            return 1;
        }
        for (int d = job->inner - 1; d >= 1; d--) {
            if (++index[d] < job->shape[d]) { offset += job->stride[d]; out_offset += job->out_stride[d]; break; }
            offset -= (job->shape[d] - 1) * job->stride[d];
            out_offset -= (job->shape[d] - 1) * job->out_stride[d];
            index[d] = 0;
        }
    }
    return 0;
}

static PyObject *py_fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const int64_t SIZES[4] = {4, 8, 2, 2};
    if (nargs != 5 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "fold(plan: bytes, code: int, members, out, mode: int)");
        return NULL;
    }
    const int64_t *plan = (const int64_t *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t plan_len = PyBytes_GET_SIZE(args[0]) / 8;
    long code = PyLong_AsLong(args[1]);
    long mode = PyLong_AsLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    const int copies = (mode & COPIES) != 0, flat = (mode & FLAT) != 0, into = (mode & INTO) != 0;
    if (code < 0 || code > 15 || plan_len < 5 || plan_len != 5 + plan[0] + plan[3] - 1 || plan[1] <= 0)
        Py_RETURN_FALSE;
    const int64_t n = plan[0], numel = plan[1], period = plan[3], size = SIZES[(code & 7) >> 1];
    const char *stack_members[64];
    const char **members = n <= 64 ? stack_members : PyMem_Malloc((size_t)n * sizeof(char *));
    if (members == NULL) return PyErr_NoMemory();
    int done = 0;
    char *out;
    if (PyList_Check(args[2]) || PyTuple_Check(args[2])) {
        /* n contiguous CPU tensors of one dtype and shape (1-d unless the plan is uniform or FLAT): one
           reduction into out (contiguous, numel elements) */
        PyObject *seq = args[2];
        Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
        PyObject **items = PySequence_Fast_ITEMS(seq);
        PyObject *dtype = NULL, *shape = NULL;
        PyObject *outs_seq = NULL;
        Py_ssize_t nout = 0;
        char *stack_outs[64];
        char **outs = stack_outs;
        int ok = count == n && !copies;
        if (ok && into) {
            /* the FOLD path without bail only (see fold_into_outs) */
            ok = (code & BAIL) == 0 && !(plan[2] < SHORT && period > 1)
                 && (PyList_Check(args[3]) || PyTuple_Check(args[3]));
            if (ok) {
                outs_seq = args[3];
                nout = PySequence_Fast_GET_SIZE(outs_seq);
                outs = nout <= 64 ? stack_outs : PyMem_Malloc((size_t)nout * sizeof(char *));
                ok = outs != NULL;
            }
        } else if (ok) {
            ok = pointer_of(args[3], &out) == 0;
        }
        for (Py_ssize_t r = 0; ok && r < count; r++) {
            PyObject *t = items[r], *t_dtype = PyObject_GetAttr(t, s_dtype), *t_shape = PyObject_GetAttr(t, s_shape);
            ok = t_dtype != NULL && t_shape != NULL && flag_of(PyObject_GetAttr(t, s_is_cpu)) == 1
                 && flag_of(PyObject_GetAttr(t, s_requires_grad)) == 0
                 && flag_of(PyObject_CallMethodNoArgs(t, s_is_contiguous)) == 1
                 && pointer_of(t, (char **)&members[r]) == 0;
            if (ok && r == 0) {
                int64_t dims[MAX_DIMS], total = 1;
                int ndim = ints_of((Py_INCREF(t_shape), t_shape), dims);
                for (int d = 0; d < ndim; d++) total *= dims[d];
                ok = ndim >= 0 && total == numel && (ndim == 1 || period == 1 || flat);
                dtype = t_dtype; shape = t_shape;
                Py_INCREF(dtype); Py_INCREF(shape);
            } else if (ok) {
                ok = t_dtype == dtype && PyObject_RichCompareBool(t_shape, shape, Py_EQ) == 1;
            }
            Py_XDECREF(t_dtype);
            Py_XDECREF(t_shape);
        }
        /* INTO: every out a contiguous CPU tensor of the members' dtype and element count; an out that is the
           member at its own index (an in-place all-reduce passes each rank's tensor as both) was checked above */
        for (Py_ssize_t o = 0; ok && into && o < nout; o++) {
            PyObject *t = PySequence_Fast_ITEMS(outs_seq)[o];
            if (o < count && t == items[o]) {
                outs[o] = (char *)members[o];
                continue;
            }
            PyObject *t_dtype = PyObject_GetAttr(t, s_dtype);
            int64_t dims[MAX_DIMS], total = 1;
            int ndim = ints_of(PyObject_GetAttr(t, s_shape), dims);
            for (int d = 0; d < ndim; d++) total *= dims[d];
            ok = t_dtype != NULL && t_dtype == dtype && ndim >= 0 && total == numel
                 && flag_of(PyObject_GetAttr(t, s_is_cpu)) == 1
                 && flag_of(PyObject_CallMethodNoArgs(t, s_is_contiguous)) == 1 && pointer_of(t, &outs[o]) == 0;
            Py_XDECREF(t_dtype);
        }
        Py_XDECREF(dtype);
        Py_XDECREF(shape);
        if (ok && into) {
            const char *stack_shifted[64];
            const char **shifted = n <= 64 ? stack_shifted : PyMem_Malloc((size_t)n * sizeof(char *));
            ok = shifted != NULL && outs_separate(members, n, outs, nout, numel * size);
            if (ok) {
                Py_BEGIN_ALLOW_THREADS
                fold_into_outs(plan, (int)code, members, shifted, outs, nout, size);
                Py_END_ALLOW_THREADS
                done = 1;
            }
            if (shifted != NULL && shifted != stack_shifted) PyMem_Free(shifted);
        } else if (ok) {
            Py_BEGIN_ALLOW_THREADS
            done = !fold_item(plan, (int)code, members, out);
            Py_END_ALLOW_THREADS
        }
        if (outs != stack_outs) PyMem_Free(outs);
    } else {
        /* one stacked [n, *batch, *member] tensor; out: contiguous [*batch, *member], or with copies a tensor of
           the members' shape whose every member row receives the result (its member dimensions contiguous) */
        strided_job job;
        int64_t out_shape[MAX_DIMS];
        job.plan = plan; job.code = (int)code; job.copies = copies; job.size = size;
        job.ndim = geometry_of(args[2], job.shape, job.stride);
        int ok = job.ndim >= 2 && job.shape[0] == n && pointer_of(args[2], (char **)&job.base) == 0
                 && pointer_of(args[3], &job.out) == 0;
        job.inner = ok ? member_dims(job.shape, job.stride, job.ndim, numel) : -1;
        ok = ok && job.inner >= 1;
        if (ok && copies) {
            ok = geometry_of(args[3], out_shape, job.out_stride) == job.ndim
                 && member_dims(out_shape, job.out_stride, job.ndim, numel) == job.inner;
            for (int d = 0; ok && d < job.ndim; d++) ok = out_shape[d] == job.shape[d];
        } else {
            memset(job.out_stride, 0, sizeof(job.out_stride)); /* out is contiguous: items follow each other */
        }
        if (ok) {
            job.items = 1;
            for (int d = 1; d < job.inner; d++) job.items *= job.shape[d];
            Py_BEGIN_ALLOW_THREADS
            done = !run_strided(&job, members);
            Py_END_ALLOW_THREADS
        }
    }
    if (members != stack_members) PyMem_Free(members);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(done);
}

static int avx2_supported(void) {
#ifdef HAVE_AVX2
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* variant(name=None) -> the variant in use ("base" or "avx2"); with a name, switch to it (tests run both) */
static PyObject *py_variant(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    PyObject *previous = PyUnicode_FromString(fold_block == block_base ? "base" : "avx2");
    if (nargs == 0 || args[0] == Py_None || previous == NULL) return previous;
    const char *name = PyUnicode_AsUTF8(args[0]);
    if (name == NULL) { Py_DECREF(previous); return NULL; }
    if (strcmp(name, "base") == 0) {
        fold_block = block_base;
#ifdef HAVE_AVX2
    } else if (strcmp(name, "avx2") == 0 && avx2_supported()) {
        fold_block = block_avx2;
#endif
    } else {
        Py_DECREF(previous);
        PyErr_Format(PyExc_ValueError, "no kernel variant %s on this machine", name);
        return NULL;
    }
    return previous;
}

static PyMethodDef methods[] = {
    {"fold", (PyCFunction)(void (*)(void))py_fold, METH_FASTCALL, "A FoldPlan's fold with gloo's hop rule."},
    {"variant", (PyCFunction)(void (*)(void))py_variant, METH_FASTCALL, "The instruction set variant in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_simdist_fold", NULL, -1, methods};

PyMODINIT_FUNC PyInit__simdist_fold(void) {
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_shape = PyUnicode_InternFromString("shape");
    s_stride = PyUnicode_InternFromString("stride");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_requires_grad = PyUnicode_InternFromString("requires_grad");
    if (!s_data_ptr || !s_shape || !s_stride || !s_dtype || !s_is_cpu || !s_is_contiguous || !s_requires_grad)
        return NULL;
#ifdef HAVE_AVX2
    if (avx2_supported()) fold_block = block_avx2;
#endif
    PyObject *m = PyModule_Create(&module);
#ifndef SIMDIST_FOLD_SOURCE
#define SIMDIST_FOLD_SOURCE "unknown"
#endif
    /* the SHA-256 of this file as built (setup.py, simdist.reduce.native): a kernel built from another version
       of the source is not loaded against this one's Python side */
    if (m && PyModule_AddStringConstant(m, "SOURCE_SHA256", SIMDIST_FOLD_SOURCE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
