/* y = x @ W^T with W kept as GGUF's quantized blocks, for small batches on CPU.
 *
 * A decode step reads every weight once; in float32 that is 4 bytes per weight and a CPU
 * step is bound by memory bandwidth. Kept as Q4_1 a weight is 0.625 bytes. Each weight is
 * dequantized in registers to exactly the float32 value gguf's numpy dequantizer gives
 * (d*q and d*q + m round once either way: d*q is exact in float32) and the products are
 * summed in float32, so results differ from a float32 GEMM over the dequantized matrix only
 * in summation order.
 *
 * GGUF block layouts (a row of W = K/32 blocks; d, m are IEEE half):
 *   Q4_0: d, qs[16]     w[j] = d * ((qs[j] & 15) - 8), w[j+16] = d * ((qs[j] >> 4) - 8)
 *   Q4_1: d, m, qs[16]  w[j] = d * (qs[j] & 15) + m,   w[j+16] = d * (qs[j] >> 4) + m
 *   Q8_0: d, qs[32]     w[j] = d * (int8) qs[j]
 *
 * kvq_repack turns them into panels of 16 rows so that one vector holds one k of 16 output
 * rows: the kernel broadcasts x[i, k] and accumulates y[i, n0:n0+16] with no horizontal sums,
 * and dequantizes each weight once per 16 rows of x. Per panel, per 32-wide group g:
 *   d[16] half; m[16] half (Q4_1 only);
 *   Q4_x: q[16][16] bytes, q[j][r] = nibble j of row r | nibble j+16 of row r << 4;
 *   Q8_0: q[32][16] int8, q[j][r] = weight j of row r.
 * Rows past N in the last panel are zero. x is float32 [M, K], y float32 [M, N], row-major.
 *
 * Built by workers/cpu_kernels.py with `cc -O3 -march=native -fopenmp`: AVX-512 code where the
 * compiler targets AVX-512F, else AVX2 + FMA code (8-wide: a panel is two vectors; a pass over
 * x takes 5-8 rows through one vector at a time so the accumulators fit in 16 registers, or
 * 1-4 rows through both at once, since so few rows would leave the FMA units waiting on each
 * output's chain of adds; from 9 rows on, each panel is dequantized once into a buffer and
 * the rows go through it 6 at a time, as a float32 GEMM's register tile would). Every pass
 * sums every output in the same order, so the two builds give bit-identical results, and a
 * row's result does not depend on the rows beside it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__F16C__)
#define KV_AVX512 1
enum { MAX_ROWS = 16 /* x rows per pass */ };
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV_AVX512 0
enum { MAX_ROWS = 8 };
#else
#error "kvmesh's CPU kernels need AVX-512 or AVX2 + FMA (cpu_kernels.py checks the CPU first)"
#endif

enum { KVQ_Q4_0 = 2, KVQ_Q4_1 = 3, KVQ_Q8_0 = 8 }; /* ggml type ids */
enum { PANEL = 16, GROUP = 32 };

/* The vector width this library was built for: 512 (AVX-512) or 256 (AVX2 + FMA). */
int kvmesh_isa_bits(void) { return KV_AVX512 ? 512 : 256; }

static int block_bytes(int type) {
    switch (type) {
    case KVQ_Q4_0: return 18;
    case KVQ_Q4_1: return 20;
    case KVQ_Q8_0: return 34;
    default: return 0;
    }
}

/* Bytes of one panel's record for one group. */
static int64_t record_bytes(int type) {
    switch (type) {
    case KVQ_Q4_0: return 2 * PANEL + PANEL * 16;
    case KVQ_Q4_1: return 4 * PANEL + PANEL * 16;
    case KVQ_Q8_0: return 2 * PANEL + PANEL * 32;
    default: return 0;
    }
}

/* Bytes kvq_repack writes for an [n, k] weight; 0 for an unknown type or k % 32 != 0. */
int64_t kvq_packed_bytes(int type, int64_t n, int64_t k) {
    if (block_bytes(type) == 0 || k % GROUP != 0) return 0;
    return (n + PANEL - 1) / PANEL * (k / GROUP) * record_bytes(type);
}

/* GGUF blocks of W [n, k] -> panels (kvq_packed_bytes(type, n, k) bytes at out). */
int kvq_repack(int type, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    int64_t total = kvq_packed_bytes(type, n, k);
    if (total == 0) return -1;
    memset(out, 0, (size_t)total);
    int bb = block_bytes(type);
    int64_t nb = k / GROUP, rec = record_bytes(type);
    for (int64_t r = 0; r < n; r++) {
        int64_t p = r / PANEL, lane = r % PANEL;
        for (int64_t g = 0; g < nb; g++) {
            const uint8_t *b = w + (r * nb + g) * bb;
            uint8_t *o = out + (p * nb + g) * rec;
            memcpy(o + 2 * lane, b, 2); /* d */
            if (type == KVQ_Q8_0) {
                for (int j = 0; j < 32; j++) o[2 * PANEL + j * PANEL + lane] = b[2 + j];
                continue;
            }
            int scales = type == KVQ_Q4_1 ? 2 : 1;
            if (type == KVQ_Q4_1) memcpy(o + 2 * PANEL + 2 * lane, b + 2, 2); /* m */
            /* A GGUF byte j already holds nibbles j and j+16 of this row. */
            for (int j = 0; j < 16; j++) o[2 * scales * PANEL + j * PANEL + lane] = b[2 * scales + j];
        }
    }
    return 0;
}

#if KV_AVX512
/* y[0:mb, n0:n0+16] for one panel; mb <= MAX_ROWS. Constant type and mb per call site. */
static inline __attribute__((always_inline)) void panel(int type, const float *x, int64_t k,
                                                        const uint8_t *pw, int mb, float *y,
                                                        int64_t n, int64_t n0) {
    int64_t nb = k / GROUP, rec = record_bytes(type);
    __m512 acc[MAX_ROWS];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        const uint8_t *o = pw + g * rec;
        const float *xg = x + g * GROUP;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        if (type == KVQ_Q8_0) {
            const uint8_t *q = o + 2 * PANEL;
            for (int j = 0; j < 32; j++) {
                __m128i qb = _mm_loadu_si128((const __m128i *)(q + j * PANEL));
                __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qb)));
                for (int i = 0; i < mb; i++)
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xg[i * k + j]), w, acc[i]);
            }
            continue;
        }
        __m512 m;
        const uint8_t *q;
        if (type == KVQ_Q4_1) {
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 2 * PANEL)));
            q = o + 4 * PANEL;
        } else {
            m = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)); /* d*(q-8) = d*q - 8d, all exact */
            q = o + 2 * PANEL;
        }
        for (int j = 0; j < 16; j++) {
            __m512i qb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * PANEL)));
            __m512i qlo = _mm512_and_si512(qb, _mm512_set1_epi32(15));
            __m512i qhi = _mm512_srli_epi32(qb, 4);
            __m512 wlo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(qlo), m); /* d*q exact */
            __m512 whi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(qhi), m);
            for (int i = 0; i < mb; i++) {
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xg[i * k + j]), wlo, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xg[i * k + j + 16]), whi, acc[i]);
            }
        }
    }
    int64_t left = n - n0;
    __mmask16 mask = left >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    for (int i = 0; i < mb; i++) _mm512_mask_storeu_ps(y + i * n + n0, mask, acc[i]);
}

#else
/* Rows i < mb of y (row stride n) get acc[i]'s first min(left, 8) lanes. */
static inline __attribute__((always_inline)) void store8(const __m256 *acc, int mb, float *y,
                                                         int64_t n, int64_t left) {
    if (left >= 8) {
        for (int i = 0; i < mb; i++) _mm256_storeu_ps(y + i * n, acc[i]);
        return;
    }
    float tmp[8];
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(tmp, acc[i]);
        memcpy(y + i * n, tmp, sizeof(float) * (size_t)left);
    }
}

/* y[0:mb, n0:n0+16] for one panel; mb <= MAX_ROWS. Constant type and mb per call site.
 * Each 8-row half of the panel is a pass over k; per output the order of the sums (g, then j
 * with its low and high nibble) is the AVX-512 kernel's. */
static inline __attribute__((always_inline)) void panel(int type, const float *x, int64_t k,
                                                        const uint8_t *pw, int mb, float *y,
                                                        int64_t n, int64_t n0) {
    int64_t nb = k / GROUP, rec = record_bytes(type);
    for (int h = 0; h < 2; h++) {
        int64_t left = n - n0 - 8 * h;
        if (left <= 0) break; /* rows past N only */
        __m256 acc[MAX_ROWS];
        for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < nb; g++) {
            const uint8_t *o = pw + g * rec;
            const float *xg = x + g * GROUP;
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16 * h)));
            if (type == KVQ_Q8_0) {
                const uint8_t *q = o + 2 * PANEL + 8 * h;
                for (int j = 0; j < 32; j++) {
                    __m128i qb = _mm_loadl_epi64((const __m128i *)(q + j * PANEL));
                    __m256 w = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qb)));
                    for (int i = 0; i < mb; i++)
                        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(xg[i * k + j]), w, acc[i]);
                }
                continue;
            }
            __m256 m;
            const uint8_t *q;
            if (type == KVQ_Q4_1) {
                m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2 * PANEL + 16 * h)));
                q = o + 4 * PANEL + 8 * h;
            } else {
                m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)); /* d*(q-8) = d*q - 8d, all exact */
                q = o + 2 * PANEL + 8 * h;
            }
            for (int j = 0; j < 16; j++) {
                __m256i qb = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j * PANEL)));
                __m256i qlo = _mm256_and_si256(qb, _mm256_set1_epi32(15));
                __m256i qhi = _mm256_srli_epi32(qb, 4);
                __m256 wlo = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(qlo), m); /* d*q exact */
                __m256 whi = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(qhi), m);
                for (int i = 0; i < mb; i++) {
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(xg[i * k + j]), wlo, acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(xg[i * k + j + 16]), whi, acc[i]);
                }
            }
        }
        store8(acc, mb, y + n0 + 8 * h, n, left);
    }
}

/* One group of a panel, both 8-row halves at once (`panel_both`, `dequantize_panel`). */
typedef struct {
    __m256 d0, d1, m0, m1; /* per half: scale, and the offset (m; -8d for Q4_0; unused Q8_0) */
    const uint8_t *q;      /* the group's quants */
} Group;

static inline __attribute__((always_inline)) Group group_at(int type, const uint8_t *o) {
    Group gr;
    gr.d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
    gr.d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16)));
    gr.m0 = gr.m1 = _mm256_setzero_ps();
    gr.q = o + 2 * PANEL;
    if (type == KVQ_Q4_1) {
        gr.m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2 * PANEL)));
        gr.m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 2 * PANEL + 16)));
        gr.q = o + 4 * PANEL;
    } else if (type == KVQ_Q4_0) {
        gr.m0 = _mm256_mul_ps(gr.d0, _mm256_set1_ps(-8.0f)); /* d*(q-8) = d*q - 8d, all exact */
        gr.m1 = _mm256_mul_ps(gr.d1, _mm256_set1_ps(-8.0f));
    }
    return gr;
}

/* Q8_0: the weights of column j, halves 0 and 1: w[0], w[1]. */
static inline __attribute__((always_inline)) void q8_column(const Group *gr, int j, __m256 *w) {
    __m128i qb = _mm_loadu_si128((const __m128i *)(gr->q + j * PANEL));
    w[0] = _mm256_mul_ps(gr->d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qb)));
    w[1] = _mm256_mul_ps(gr->d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(qb, 8))));
}

/* Q4_x: the weights of columns j (w[0], w[1]: halves 0 and 1) and j + 16 (w[2], w[3]). */
static inline __attribute__((always_inline)) void q4_columns(const Group *gr, int j, __m256 *w) {
    __m128i qb = _mm_loadu_si128((const __m128i *)(gr->q + j * PANEL));
    __m256i q0 = _mm256_cvtepu8_epi32(qb);
    __m256i q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(qb, 8));
    __m256i low = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(gr->d0, _mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), gr->m0);
    w[1] = _mm256_fmadd_ps(gr->d1, _mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), gr->m1);
    w[2] = _mm256_fmadd_ps(gr->d0, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), gr->m0);
    w[3] = _mm256_fmadd_ps(gr->d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), gr->m1);
}

/* y[0:mb, n0:n0+16] for one panel, both 8-row halves in one pass over k; mb <= 4. A pass of
 * few rows is bound by the latency of each output's chain of multiply-adds, not by their
 * throughput: the two halves' chains run side by side (8 at 4 rows, enough to fill both FMA
 * units), and each x[i, k] broadcast serves both. Same order of sums as `panel`. */
static inline __attribute__((always_inline)) void panel_both(int type, const float *x, int64_t k,
                                                             const uint8_t *pw, int mb, float *y,
                                                             int64_t n, int64_t n0) {
    int64_t nb = k / GROUP, rec = record_bytes(type);
    __m256 lo[4], hi[4]; /* outputs n0..n0+7 and n0+8..n0+15 of row i */
    for (int i = 0; i < mb; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < nb; g++) {
        Group gr = group_at(type, pw + g * rec);
        const float *xg = x + g * GROUP;
        if (type == KVQ_Q8_0) {
            for (int j = 0; j < 32; j++) {
                __m256 w[2];
                q8_column(&gr, j, w);
                for (int i = 0; i < mb; i++) {
                    __m256 xi = _mm256_set1_ps(xg[i * k + j]);
                    lo[i] = _mm256_fmadd_ps(xi, w[0], lo[i]);
                    hi[i] = _mm256_fmadd_ps(xi, w[1], hi[i]);
                }
            }
            continue;
        }
        for (int j = 0; j < 16; j++) {
            __m256 w[4];
            q4_columns(&gr, j, w);
            for (int i = 0; i < mb; i++) {
                __m256 xl = _mm256_set1_ps(xg[i * k + j]), xh = _mm256_set1_ps(xg[i * k + j + 16]);
                lo[i] = _mm256_fmadd_ps(xl, w[0], lo[i]);
                lo[i] = _mm256_fmadd_ps(xh, w[2], lo[i]);
                hi[i] = _mm256_fmadd_ps(xl, w[1], hi[i]);
                hi[i] = _mm256_fmadd_ps(xh, w[3], hi[i]);
            }
        }
    }
    store8(lo, mb, y + n0, n, n - n0);
    if (n - n0 > 8) store8(hi, mb, y + n0 + 8, n, n - n0 - 8);
}

/* A panel's weights dequantized to float32 (exactly as `panel` makes them), in the order each
 * output sums them: for group g, step s holds 16 outputs' weights for column g*32 + col(s),
 * where Q4_x steps go j, j+16 (s = 2j, 2j+1) and Q8_0 steps go j (s = j). */
static inline __attribute__((always_inline)) void dequantize_panel(int type, const uint8_t *pw,
                                                                   int64_t k, float *w) {
    int64_t nb = k / GROUP, rec = record_bytes(type);
    for (int64_t g = 0; g < nb; g++, w += GROUP * PANEL) {
        Group gr = group_at(type, pw + g * rec);
        __m256 c[4];
        for (int j = 0; j < (type == KVQ_Q8_0 ? 32 : 16); j++) {
            float *s = w + (type == KVQ_Q8_0 ? j : 2 * j) * PANEL;
            if (type == KVQ_Q8_0) {
                q8_column(&gr, j, c);
            } else {
                q4_columns(&gr, j, c);
                _mm256_storeu_ps(s + PANEL, c[2]);
                _mm256_storeu_ps(s + PANEL + 8, c[3]);
            }
            _mm256_storeu_ps(s, c[0]);
            _mm256_storeu_ps(s + 8, c[1]);
        }
    }
}

/* y[0:mb, n0:n0+16] from a dequantized panel (`dequantize_panel`); mb <= TILE_ROWS. The
 * classic register tile of a float32 GEMM: per step two weight vectors and mb broadcasts feed
 * 2*mb independent chains of multiply-adds (12 at 6 rows: enough to hide their latency), with
 * no dequantization left in the loop. Same order of sums as `panel`. */
enum { TILE_ROWS = 6 };
static inline __attribute__((always_inline)) void tile(int type, const float *x, int64_t k,
                                                       const float *w, int mb, float *y,
                                                       int64_t n, int64_t n0) {
    __m256 lo[TILE_ROWS], hi[TILE_ROWS];
    for (int i = 0; i < mb; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    /* One step: the weights of column `col` (of this group) times each row's x[col]. */
#define TILE_STEP(wp, col)                                                               \
    do {                                                                                 \
        __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps((wp) + 8);                \
        for (int i = 0; i < mb; i++) {                                                   \
            __m256 xi = _mm256_set1_ps(xc[i * k + (col)]);                               \
            lo[i] = _mm256_fmadd_ps(xi, w0, lo[i]);                                      \
            hi[i] = _mm256_fmadd_ps(xi, w1, hi[i]);                                      \
        }                                                                                \
    } while (0)
    for (const float *xc = x; xc < x + k; xc += GROUP, w += GROUP * PANEL) {
        if (type == KVQ_Q8_0) {
#pragma GCC unroll 32
            for (int j = 0; j < 32; j++) TILE_STEP(w + j * PANEL, j);
        } else {
#pragma GCC unroll 16
            for (int j = 0; j < 16; j++) {
                TILE_STEP(w + 2 * j * PANEL, j);
                TILE_STEP(w + (2 * j + 1) * PANEL, j + 16);
            }
        }
    }
#undef TILE_STEP
    store8(lo, mb, y + n0, n, n - n0);
    if (n - n0 > 8) store8(hi, mb, y + n0 + 8, n, n - n0 - 8);
}

#endif

#define PANEL_MB(T, MB)                                                                  \
    case MB: panel(T, xm, k, pw, MB, ym, n, n0); break;
#define BOTH_MB(T, MB)                                                                   \
    case MB: panel_both(T, xm, k, pw, MB, ym, n, n0); break;

#if KV_AVX512
#define PANEL_CASES(T)                                                                   \
    PANEL_MB(T, 16) PANEL_MB(T, 15) PANEL_MB(T, 14) PANEL_MB(T, 13)                      \
    PANEL_MB(T, 12) PANEL_MB(T, 11) PANEL_MB(T, 10) PANEL_MB(T, 9)                       \
    PANEL_MB(T, 8) PANEL_MB(T, 7) PANEL_MB(T, 6) PANEL_MB(T, 5)                          \
    PANEL_MB(T, 4) PANEL_MB(T, 3) PANEL_MB(T, 2) PANEL_MB(T, 1)
#else
/* 1-4 rows take both halves of a panel in one pass (`panel_both`), 5-8 rows one at a time. */
#define PANEL_CASES(T)                                                                   \
    PANEL_MB(T, 8) PANEL_MB(T, 7) PANEL_MB(T, 6) PANEL_MB(T, 5)                          \
    BOTH_MB(T, 4) BOTH_MB(T, 3) BOTH_MB(T, 2) BOTH_MB(T, 1)
#endif

/* The direct passes (`panel`, `panel_both`) over rows m0.. of x for one panel. */
#define DIRECT_ROWS(T)                                                                   \
    for (int64_t m0 = 0; m0 < m; m0 += MAX_ROWS) {                                       \
        const float *xm = x + m0 * k;                                                    \
        float *ym = y + m0 * n;                                                          \
        switch (m - m0 < MAX_ROWS ? (int)(m - m0) : MAX_ROWS) {                          \
            PANEL_CASES(T)                                                               \
        }                                                                                \
    }

#if KV_AVX512
#define PANEL_ROWS(T) DIRECT_ROWS(T)
#else
/* From this many rows of x a panel is dequantized once into a per-thread buffer and the rows
 * run through `tile`; fewer rows take the direct passes, which dequantize per pass but skip
 * the buffer's stores and loads. Measured on a Zen 3 core (share of its FMA peak), direct
 * against tiled: 8 rows 61% / 44%, 12 rows 58% / 70%, 16 rows 63% / 74%, 64+ rows 63-64% /
 * 83-85%. */
enum { TILED_FROM = 9 };

/* This thread's buffer for one dequantized panel (k * PANEL floats), kept between calls: a
 * buffer allocated per call would be mmapped and unmapped each time (past glibc's threshold),
 * costing page faults and, with several threads, TLB shootdowns. NULL if out of memory. */
static float *panel_buffer(int64_t k) {
    static _Thread_local float *buf;
    static _Thread_local int64_t cap;
    if (cap < k) {
        free(buf);
        buf = aligned_alloc(32, (size_t)k * PANEL * sizeof(float)); /* a multiple of 32 */
        cap = buf ? k : 0;
    }
    return buf;
}

#define TILE_MB(T, MB)                                                                   \
    case MB: tile(T, xm, k, wf, MB, ym, n, n0); break;
/* Rows of x for one panel: tiled over the dequantized panel, or the direct passes. */
#define PANEL_ROWS(T)                                                                    \
    float *wf = m >= TILED_FROM ? panel_buffer(k) : NULL;                                \
    if (wf == NULL) {                                                                    \
        DIRECT_ROWS(T)                                                                   \
        continue;                                                                        \
    }                                                                                    \
    dequantize_panel(T, pw, k, wf);                                                      \
    /* Tiles of at most TILE_ROWS rows, as even as they go (16 = 6 + 5 + 5). */          \
    int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;                                     \
    for (int64_t t = 0, m0 = 0; t < tiles; t++) {                                        \
        int mb = (int)((m - m0 + tiles - t - 1) / (tiles - t));                          \
        const float *xm = x + m0 * k;                                                    \
        float *ym = y + m0 * n;                                                          \
        switch (mb) {                                                                    \
            TILE_MB(T, 6) TILE_MB(T, 5) TILE_MB(T, 4)                                    \
            TILE_MB(T, 3) TILE_MB(T, 2) TILE_MB(T, 1)                                    \
        }                                                                                \
        m0 += mb;                                                                        \
    }
#endif

/* Panels are independent: each thread takes a run of them. */
#define MATMUL_TYPE(T)                                                                   \
    static void matmul_##T(const float *x, int64_t m, int64_t k, const uint8_t *w,       \
                           int64_t n, float *y, int nthreads) {                          \
        int64_t panels = (n + PANEL - 1) / PANEL, stride = (k / GROUP) * record_bytes(T); \
        _Pragma("omp parallel for schedule(static) num_threads(nthreads)")               \
        for (int64_t p = 0; p < panels; p++) {                                           \
            const uint8_t *pw = w + p * stride;                                          \
            int64_t n0 = p * PANEL;                                                      \
            PANEL_ROWS(T)                                                                \
        }                                                                                \
    }

MATMUL_TYPE(KVQ_Q4_0)
MATMUL_TYPE(KVQ_Q4_1)
MATMUL_TYPE(KVQ_Q8_0)

/* y [m, n] = x [m, k] @ W^T, W as kvq_repack panels; 0, or -1 for an unknown type / bad k. */
int kvq_matmul(int type, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
               float *y, int nthreads) {
    if (kvq_packed_bytes(type, n, k) == 0) return -1;
    switch (type) {
    case KVQ_Q4_0: matmul_KVQ_Q4_0(x, m, k, w, n, y, nthreads); return 0;
    case KVQ_Q4_1: matmul_KVQ_Q4_1(x, m, k, w, n, y, nthreads); return 0;
    default: matmul_KVQ_Q8_0(x, m, k, w, n, y, nthreads); return 0;
    }

}
