/* Paged attention, float32, for query rows of few tokens: decodes and short prefills over a
 * cached context. Reads K/V where they lie in the paged cache, without gathering them. The
 * cache holds float32, or bfloat16 / float16 (kv_dtype), which moves half the bytes from
 * memory. `rows` reads bfloat16 in place, a pair of vectors at a time (the even entries and
 * the odd ones of 32: two integer ops, no conversion; q is laid out to match); any other
 * 16-bit row is widened into float32 scratch first (exactly: every 16-bit value is a
 * float32), and summed as float32 rows with the same values would be.
 *
 * The caller splits a step's attention into items. Item i lists query tokens
 * qtok[qo[i] .. qo[i] + nq[i]) (rows of q and out) and keys: the first kv_len[i] tokens held by
 * blocks[bo[i] ..] (block_size tokens per block); its j-th query sees the first
 * qlim[qo[i] + j] of those keys (causal). A query's attention is the union of the items that
 * list it: a cascade's shared prefix is one item listing every row that shares it, and each
 * row's own blocks make another, so a shared prefix is read once for all its rows.
 *
 * Items are cut into chunks of CHUNK keys. Each (chunk, KV head) task computes, for its
 * queries' query heads, the softmax partials (max, sum of exponentials, exp-weighted V sum) in
 * parallel; the partials then merge per query head by log-sum-exp (FlashDecoding's split-KV).
 * Scores: q * scale . k. GQA: query head hh reads KV head hh / (hq / hkv).
 *
 * A task computes its partials one of two ways. With many query heads (a prefill's rows) a
 * vector holds query heads: each key's K and V entries are broadcast against them (`lanes`).
 * With at most ROWS_MAX query heads (a decode of hq / hkv = 3 to 6) that would
 * leave most lanes empty, so a vector holds 16 entries of d instead: a score is a dot product
 * folded across lanes, and each K and V row serves all the task's query heads at once
 * (`rows`; d a multiple of 16).
 * By lanes, when d is a multiple of 16, the V sums then hold d in the vector too (`pv_by_d`:
 * one load of a V row serves a tile of query heads, and no lane holds padding), summed in the
 * same order, so the results are the bits `lanes` alone gives.
 *
 * Layouts: q, out [T, hq, d]; k_cache, v_cache [N, block_size, hkv, d]; d a multiple of 8.
 * kv_dtype: KV_F32, KV_BF16 or KV_F16, the caches' element type.
 * Every row of q (0 .. T-1) must be listed by some item and see at least one key.
 * The inner loops run over the query heads a vector holds at once: 16 with AVX-512, 8 with
 * AVX2 + FMA (whichever the compiler targets; both builds give the same results).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#if defined(__AVX512F__)
#define KV_AVX512 1
enum { VL = 16 }; /* query heads per vector */
#elif defined(__AVX2__) && defined(__FMA__)
#define KV_AVX512 0
enum { VL = 8 };
#else
#error "kvmesh's CPU kernels need AVX-512 or AVX2 + FMA (cpu_kernels.py checks the CPU first)"
#endif

/* LANES: the padding of the partials' layout, the same in both builds. */
enum { LANES = 16, CHUNK = 128, TU = 8 /* keys (or d) per register tile */ };
/* `rows` takes tasks of at most ROWS_MAX query heads, with d a multiple of 16 up to D_MAX.
 * Measured on a Zen 4 (8 decodes over 1,024 keys, d 64, cycles a key and query head): rows
 * 34 / 31 / 28 / 27 at 3 / 4 / 6 / 8 heads, lanes 57 / 42 / 29 / 22 (one vector, its
 * lanes filling up): rows wins up to 6. */
enum { ROWS_MAX = 6, D_MAX = 256, PF = 8 };
/* How a task's V sums lie in its partials. By head ([nj][d]: a query head's sums are a row,
 * which `rows` and `pv_by_d` store a vector at a time) when d is a multiple of 16 up to D_MAX,
 * where every task goes through one of the two; else by d ([d][nj_pad]), as `lanes` sums
 * them, a vector of query heads at a time. (pv_by_d once wrote its rows by d too, an entry
 * at a time: 7% of the suffix case's time in bench/attention_kernel.py.) */
#define BY_HEAD(d) ((d) % 16 == 0 && (d) <= D_MAX)
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2 }; /* the caches' element type */

typedef struct {
    int item, chunk, head;
    int64_t part; /* offset of this task's partials: [nj_pad] max, [nj_pad] sum, then its V
                   * sums, [nj][d] or [d][nj_pad] (BY_HEAD) */
} Task;

typedef struct {
    const float *q;
    const char *k_cache, *v_cache; /* elements of kv_dtype, esize bytes each */
    int hq, hkv, d, bs, kv_dtype, esize;
    const int32_t *blocks, *kv_len, *bo, *qo, *nq, *qtok, *qlim;
    float scale;
    /* Each item's scaled queries, laid out for its path (fill_queries): KV head h's at
     * qts + qt_at[item] + h * nj_pad * d, filled once and read by every chunk's task. */
    float *qts;
    const int64_t *qt_at;
} Args;

/* Asks for the K rows of the TU keys from t (those below n), pf_bytes of each: `lanes` takes
 * TU keys a tile and reads their rows an entry at a time, so without this each tile waited
 * for its rows from memory. */
static inline void prefetch_tile(const float *const *krow, int t, int n, int pf_bytes) {
    for (int u = 0; u < TU && t + u < n; u++)
        for (int off = 0; off < pf_bytes; off += 64)
            _mm_prefetch((const char *)krow[t + u] + off, _MM_HINT_T0);
}

static int64_t pad16(int64_t n) { return (n + LANES - 1) / LANES * LANES; }

#if KV_AVX512
/* One vector of VL query heads (lane l of qt/s/lim/pm/pl/pacc; qt's and s's rows VL floats
 * apart, pacc's `stride` apart) against keys krow/vrow[0 .. n), which sit at positions
 * c0 .. c0+n-1 of the item: scores into s, then the partials (max, sum of exponentials,
 * exp-weighted V sums) into pm, pl, pacc. */
/* exp(x) for x <= 0 (scores minus their max), 16 lanes; below -87 (and -inf) -> 0. Cephes'
 * expf polynomial after Cody-Waite reduction (~1 ulp), scaled by 2^n with scalef. */
static inline __m512 exp512_nonpos(__m512 x) {
    __m512 low = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ);
    __m512 xc = _mm512_max_ps(x, low);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    y = _mm512_scalef_ps(y, n);
    return _mm512_mask_blend_ps(tiny, y, _mm512_setzero_ps());
}

static void lanes(const float *qt, float *s, int64_t stride, const int32_t *lim,
                  const float *const *krow, const float *const *vrow, int n, int c0, int d,
                  float *pm, float *pl, float *pacc, int pf_bytes, int with_pv) {
    __m512i limv = _mm512_loadu_si512(lim);
    __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int t0 = 0; t0 < n; t0 += TU) {
        __m512 acc[TU];
        for (int u = 0; u < TU; u++) acc[u] = _mm512_setzero_ps();
        prefetch_tile(krow, t0 + TU, n, pf_bytes);
        for (int dd = 0; dd < d; dd++) {
            __m512 qv = _mm512_loadu_ps(qt + dd * VL);
            for (int u = 0; u < TU; u++)
                acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(krow[t0 + u][dd]), qv, acc[u]);
        }
        int tu = n - t0 < TU ? n - t0 : TU;
        for (int u = 0; u < tu; u++) {
            __mmask16 seen = _mm512_cmplt_epi32_mask(_mm512_set1_epi32(c0 + t0 + u), limv);
            _mm512_storeu_ps(s + (t0 + u) * VL, _mm512_mask_blend_ps(seen, ninf, acc[u]));
        }
    }
    __m512 mx = ninf, sum = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t * VL));
    /* A lane with no visible key here keeps sum 0 and is skipped by the merge. */
    __m512 base = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, ninf, _CMP_EQ_OQ), mx,
                                       _mm512_setzero_ps());
    for (int t = 0; t < n; t++) {
        __m512 p = exp512_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s + t * VL), base));
        _mm512_storeu_ps(s + t * VL, p);
        sum = _mm512_add_ps(sum, p);
    }
    _mm512_storeu_ps(pm, mx);
    _mm512_storeu_ps(pl, sum);
    if (!with_pv) return; /* pv_by_d sums V instead */
    for (int d0 = 0; d0 < d; d0 += TU) {
        __m512 acc[TU];
        for (int u = 0; u < TU; u++) acc[u] = _mm512_setzero_ps();
        for (int t = 0; t < n; t++) {
            __m512 pv = _mm512_loadu_ps(s + t * VL);
            for (int u = 0; u < TU; u++)
                acc[u] = _mm512_fmadd_ps(_mm512_set1_ps(vrow[t][d0 + u]), pv, acc[u]);
        }
        for (int u = 0; u < TU; u++) _mm512_storeu_ps(pacc + (d0 + u) * stride, acc[u]);
    }
}
#endif

#if !KV_AVX512
/* exp(x) for x <= 0, 8 lanes: exp512_nonpos's steps, with 2^n built in the exponent bits
 * (n >= -126 here, so 2^n is normal and y * 2^n rounds as scalef does). */
static inline __m256 exp256_nonpos(__m256 x) {
    __m256 low = _mm256_set1_ps(-87.0f);
    __m256 tiny = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    __m256 xc = _mm256_max_ps(x, low);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(y, _mm256_setzero_ps(), tiny);
}

static void lanes(const float *qt, float *s, int64_t stride, const int32_t *lim,
                  const float *const *krow, const float *const *vrow, int n, int c0, int d,
                  float *pm, float *pl, float *pacc, int pf_bytes, int with_pv) {
    __m256i limv = _mm256_loadu_si256((const __m256i *)lim);
    __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int t0 = 0; t0 < n; t0 += TU) {
        __m256 acc[TU];
        for (int u = 0; u < TU; u++) acc[u] = _mm256_setzero_ps();
        prefetch_tile(krow, t0 + TU, n, pf_bytes);
        for (int dd = 0; dd < d; dd++) {
            __m256 qv = _mm256_loadu_ps(qt + dd * VL);
            for (int u = 0; u < TU; u++)
                acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(krow[t0 + u][dd]), qv, acc[u]);
        }
        int tu = n - t0 < TU ? n - t0 : TU;
        for (int u = 0; u < tu; u++) {
            __m256 seen = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(limv, _mm256_set1_epi32(c0 + t0 + u)));
            _mm256_storeu_ps(s + (t0 + u) * VL, _mm256_blendv_ps(ninf, acc[u], seen));
        }
    }
    __m256 mx = ninf, sum = _mm256_setzero_ps();
    for (int t = 0; t < n; t++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t * VL));
    /* A lane with no visible key here keeps sum 0 and is skipped by the merge. */
    __m256 base = _mm256_blendv_ps(mx, _mm256_setzero_ps(), _mm256_cmp_ps(mx, ninf, _CMP_EQ_OQ));
    for (int t = 0; t < n; t++) {
        __m256 p = exp256_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t * VL), base));
        _mm256_storeu_ps(s + t * VL, p);
        sum = _mm256_add_ps(sum, p);
    }
    _mm256_storeu_ps(pm, mx);
    _mm256_storeu_ps(pl, sum);
    if (!with_pv) return; /* pv_by_d sums V instead */
    for (int d0 = 0; d0 < d; d0 += TU) {
        __m256 acc[TU];
        for (int u = 0; u < TU; u++) acc[u] = _mm256_setzero_ps();
        for (int t = 0; t < n; t++) {
            __m256 pv = _mm256_loadu_ps(s + t * VL);
            for (int u = 0; u < TU; u++)
                acc[u] = _mm256_fmadd_ps(_mm256_set1_ps(vrow[t][d0 + u]), pv, acc[u]);
        }
        for (int u = 0; u < TU; u++) _mm256_storeu_ps(pacc + (d0 + u) * stride, acc[u]);
    }
}
#endif

/* 16 floats, as one AVX-512 vector or two AVX2 halves: `rows` is written once over these, and
 * both builds do the same operation on every lane in the same order, so they agree bit for bit
 * (exp included: exp256_nonpos is exp512_nonpos's twin). */
#if KV_AVX512
typedef __m512 v16;
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 v) { _mm512_storeu_ps(p, v); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
static inline v16 v16_exp_shifted(v16 x, float base) {
    return exp512_nonpos(_mm512_sub_ps(x, _mm512_set1_ps(base)));
}
/* Lanes i and i + 8 added: the first step of every horizontal sum. */
static inline __m256 v16_fold(v16 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* 32 bfloat16 values p[0 .. 32) as float32: the even-indexed ones (lane i: p[2i]) and the
 * odd ones (p[2i + 1]). A 32-bit lane holds a pair; its high half is the odd value's bits
 * already, its low half shifted up the even's: two integer ops, no conversion. */
static inline void v16_bf16_pair(const uint16_t *p, v16 *even, v16 *odd) {
    __m512i x = _mm512_loadu_si512(p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}
#else
typedef struct { __m256 lo, hi; } v16;
static inline v16 v16_load(const float *p) {
    return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline void v16_store(float *p, v16 v) {
    _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi);
}
static inline v16 v16_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_add(v16 a, v16 b) {
    return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}
static inline v16 v16_max(v16 a, v16 b) {
    return (v16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)};
}
static inline v16 v16_exp_shifted(v16 x, float base) {
    __m256 b = _mm256_set1_ps(base);
    return (v16){exp256_nonpos(_mm256_sub_ps(x.lo, b)), exp256_nonpos(_mm256_sub_ps(x.hi, b))};
}
static inline __m256 v16_fold(v16 v) { return _mm256_add_ps(v.lo, v.hi); }
static inline void v16_bf16_pair(const uint16_t *p, v16 *even, v16 *odd) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)p);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(p + 16));
    __m256i mask = _mm256_set1_epi32((int)0xFFFF0000u);
    *even = (v16){_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)),
                  _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
    *odd = (v16){_mm256_castsi256_ps(_mm256_and_si256(lo, mask)),
                 _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
}
#endif

/* The sum of v's 16 lanes, in one fixed tree: (i + i+8), then (i + i+4), (i + i+2), (0 + 1). */
static inline float v16_sum(v16 v) {
    __m256 x = v16_fold(v);
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* The exp-weighted V sums of a `lanes` task, with vectors over head_dim instead of over query
 * heads: query heads j0 .. j0+nq (nq <= PV_Q) against d entries dc*16 .. (dc+nv)*16
 * (nv <= PV_V). P[j][t] sits where `lanes` left it, s[j / VL * VL * CHUNK + t * VL + j % VL].
 * Each output is summed over t in the order `lanes` sums it (fma(p, v, acc), the product's
 * factors swapped), so the result is the same bits; but a key's V row is loaded once for
 * PV_Q query heads instead of one entry at a time for each vector of query heads, and no lane
 * holds padding.
 * A tile's accumulators fill most of the vector registers: 24 of AVX-512's 32; AVX2's 16 hold
 * 2 x 2 v16 (8 halves) with room for the V row and p (6 x 4 spilled there: measured on 8
 * tokens over 2,056 keys, bench/attention_kernel.py, 7% slower than `lanes`'s own V sums,
 * where 2 x 2 is 10% faster than them). */
#if KV_AVX512
enum { PV_Q = 6, PV_V = 4 };
#else
enum { PV_Q = 2, PV_V = 2 };
#endif
enum { PV_PF = 16 /* keys ahead */ };
static inline __attribute__((always_inline)) void pv_tile(
    const float *s, const float *const *vrow, int n, int j0, int nq, int dc, int nv, int d,
    float *pacc, int pf) {
    v16 acc[PV_Q][PV_V];
    const float *pj[PV_Q];
    for (int i = 0; i < nq; i++) {
        int j = j0 + i;
        pj[i] = s + (int64_t)(j / VL) * VL * CHUNK + j % VL;
        for (int c = 0; c < nv; c++) acc[i][c] = v16_set1(0.0f);
    }
    for (int t = 0; t < n; t++) {
        v16 v[PV_V];
        if (pf && t + PV_PF < n) /* the first tile's pass over these d entries */
            for (int c = 0; c < nv; c++)
                _mm_prefetch((const char *)(vrow[t + PV_PF] + 16 * (dc + c)), _MM_HINT_T0);
        for (int c = 0; c < nv; c++) v[c] = v16_load(vrow[t] + 16 * (dc + c));
        for (int i = 0; i < nq; i++) {
            v16 p = v16_set1(pj[i][t * VL]);
            for (int c = 0; c < nv; c++) acc[i][c] = v16_fma(p, v[c], acc[i][c]);
        }
    }
    for (int i = 0; i < nq; i++) /* a query head's V sums are a row of d (BY_HEAD) */
        for (int c = 0; c < nv; c++) v16_store(pacc + (int64_t)(j0 + i) * d + 16 * (dc + c), acc[i][c]);
}

/* Every query head's V sums, j < nj, d a multiple of 16 (see pv_tile). With pf, the first
 * tile of query heads asks for V rows PV_PF keys ahead (rows in memory, not widened ones). */
static void pv_by_d(const float *s, const float *const *vrow, int n, int nj, int d, float *pacc,
                    int pf) {
    const int nd = d / 16;
    for (int dc = 0; dc < nd; dc += PV_V)
        for (int j0 = 0; j0 < nj; j0 += PV_Q) {
            int nq = nj - j0 < PV_Q ? nj - j0 : PV_Q, nv = nd - dc < PV_V ? nd - dc : PV_V;
            if (nq == PV_Q && nv == PV_V) /* the common tile, unrolled with constant bounds */
                pv_tile(s, vrow, n, j0, PV_Q, dc, PV_V, d, pacc, pf && j0 == 0);
            else
                pv_tile(s, vrow, n, j0, nq, dc, nv, d, pacc, pf && j0 == 0);
        }
}

/* Where entry dd of a head_dim vector sits in pair order: within each run of 32 entries, the
 * 16 even ones first, then the 16 odd ones (how v16_bf16_pair hands a bfloat16 row over). */
static inline int pair_slot(int dd) { return dd / 32 * 32 + dd % 2 * 16 + dd % 32 / 2; }

/* The partials of NJ (<= ROWS_MAX) query heads, rows of qrow [NJ][d] (scaled), against keys
 * krow/vrow[0 .. n) at positions c0 .. c0+n-1 of the item; query head j sees positions below
 * lim[j]. `s` holds NJ * CHUNK floats. Writes pm[j], pl[j] and pacc[j * d + dd] (BY_HEAD).
 * The rows are float32 (bf16 = 0), or bfloat16 read a pair of 16-wide vectors at a time
 * (bf16 = 1, d a multiple of 32: qrow is then in pair order, and no row is ever widened
 * in memory). With pf_bytes > 0 (a unit's first KV head) it also asks for the K and V slot
 * rows PF keys ahead, pf_bytes of each (every KV head's): a decode streams its keys from
 * memory, and without this the misses came one key at a time; the unit's other heads then
 * find their entries in cache.
 * All NJ query heads go through a key together (NJ a constant: one function per count), so
 * each K and V row is loaded (and prefetched) once for them, and the NJ dot products and the
 * NJ x PV_R V sums are independent chains. One query head at a time, each V sum waited for
 * its previous key's FMA, and every load and prefetch came NJ times: 8 decodes over 256
 * cached keys took ~20% longer (bench/attention_kernel.py). Every output is summed over the
 * same terms in the same order as then, so the bits are the same. */
#if KV_AVX512
enum { PV_R = 4 }; /* 16-float vectors of d a V-sum pass holds per query head */
#else
enum { PV_R = 2 }; /* AVX2's 16 registers: two halves a v16 */
#endif
static inline __attribute__((always_inline)) void rows_of(
    const float *qrow, float *s, const int NJ, int64_t njp, const int32_t *lim,
    const float *const *krow, const float *const *vrow, int n, int c0, int d, float *pm,
    float *pl, float *pacc, int pf_bytes, const int bf16) {
    const int nd = d / 16;
    for (int t = 0; t < CHUNK; t++) { /* past n, and past a query's limit: no key */
        if (t >= n) {
            for (int j = 0; j < NJ; j++) s[j * CHUNK + t] = -INFINITY;
            continue;
        }
        if (t + PF < n)
            for (int off = 0; off < pf_bytes; off += 64) {
                _mm_prefetch((const char *)krow[t + PF] + off, _MM_HINT_T0);
                _mm_prefetch((const char *)vrow[t + PF] + off, _MM_HINT_T1);
            }
        v16 dot[ROWS_MAX];
        for (int j = 0; j < NJ; j++) dot[j] = v16_set1(0.0f);
        if (bf16)
            for (int c = 0; c < nd; c += 2) {
                v16 even, odd;
                v16_bf16_pair((const uint16_t *)krow[t] + 16 * c, &even, &odd);
                for (int j = 0; j < NJ; j++) {
                    const float *q = qrow + j * d + 16 * c;
                    dot[j] = v16_fma(v16_load(q + 16), odd, v16_fma(v16_load(q), even, dot[j]));
                }
            }
        else
            for (int c = 0; c < nd; c++) {
                v16 k = v16_load(krow[t] + 16 * c);
                for (int j = 0; j < NJ; j++)
                    dot[j] = v16_fma(v16_load(qrow + j * d + 16 * c), k, dot[j]);
            }
        for (int j = 0; j < NJ; j++)
            s[j * CHUNK + t] = c0 + t >= lim[j] ? -INFINITY : v16_sum(dot[j]);
    }
    for (int j = 0; j < NJ; j++) {
        float *sj = s + j * CHUNK;
        v16 mv = v16_load(sj);
        for (int t = 16; t < CHUNK; t += 16) mv = v16_max(mv, v16_load(sj + t));
        float m[16], mx = -INFINITY;
        v16_store(m, mv);
        for (int l = 0; l < 16; l++) mx = m[l] > mx ? m[l] : mx;
        /* No visible key here: sum 0, skipped by the merge (exp(-inf - 0) is 0 below). */
        const float base = mx == -INFINITY ? 0.0f : mx;
        v16 sum = v16_set1(0.0f);
        for (int t = 0; t < CHUNK; t += 16) {
            v16 p = v16_exp_shifted(v16_load(sj + t), base);
            v16_store(sj + t, p);
            sum = v16_add(sum, p);
        }
        pm[j] = mx;
        pl[j] = v16_sum(sum);
    }
    /* V sums, PV_R vectors of d at a time (PV_R even: a bfloat16 pair stays together). */
    for (int cb = 0; cb < nd; cb += PV_R) {
        const int nv = nd - cb < PV_R ? nd - cb : PV_R;
        v16 acc[ROWS_MAX][PV_R];
        for (int j = 0; j < NJ; j++)
            for (int c = 0; c < PV_R; c++) acc[j][c] = v16_set1(0.0f);
        v16 v[PV_R];
        for (int c = 0; c < PV_R; c++) v[c] = v16_set1(0.0f); /* past nv: never summed */
        for (int t = 0; t < n; t++) {
            if (bf16)
                for (int c = 0; c < PV_R; c += 2) {
                    if (c < nv)
                        v16_bf16_pair((const uint16_t *)vrow[t] + 16 * (cb + c), &v[c], &v[c + 1]);
                }
            else
                for (int c = 0; c < PV_R; c++)
                    if (c < nv) v[c] = v16_load(vrow[t] + 16 * (cb + c));
            for (int j = 0; j < NJ; j++) {
                v16 p = v16_set1(s[j * CHUNK + t]);
                for (int c = 0; c < PV_R; c++)
                    if (c < nv) acc[j][c] = v16_fma(p, v[c], acc[j][c]);
            }
        }
        for (int j = 0; j < NJ; j++) {
            float out[16 * PV_R];
            for (int c = 0; c < PV_R; c++)
                if (c < nv) v16_store(out + 16 * c, acc[j][c]);
            for (int dd = 16 * cb; dd < 16 * (cb + nv); dd++) /* BY_HEAD */
                pacc[(int64_t)j * d + dd] = out[(bf16 ? pair_slot(dd) : dd) - 16 * cb];
        }
    }
}

/* rows_of for nj query heads, a constant in each case (so its arrays stay in registers). */
static inline __attribute__((always_inline)) void rows_by_nj(
    const float *qrow, float *s, int nj, int64_t njp, const int32_t *lim,
    const float *const *krow, const float *const *vrow, int n, int c0, int d, float *pm,
    float *pl, float *pacc, int pf_bytes, const int bf16) {
#define ROWS_OF(NJ) \
    rows_of(qrow, s, NJ, njp, lim, krow, vrow, n, c0, d, pm, pl, pacc, pf_bytes, bf16)
    switch (nj) {
    case 1: ROWS_OF(1); break;
    case 2: ROWS_OF(2); break;
    case 3: ROWS_OF(3); break;
    case 4: ROWS_OF(4); break;
    case 5: ROWS_OF(5); break;
    default: ROWS_OF(6); break;
    }
#undef ROWS_OF
}

static void rows(const float *qrow, float *s, int nj, int64_t njp, const int32_t *lim,
                 const float *const *krow, const float *const *vrow, int n, int c0, int d,
                 float *pm, float *pl, float *pacc, int pf_bytes) {
    rows_by_nj(qrow, s, nj, njp, lim, krow, vrow, n, c0, d, pm, pl, pacc, pf_bytes, 0);
}

static void rows_bf16(const float *qrow, float *s, int nj, int64_t njp, const int32_t *lim,
                      const float *const *krow, const float *const *vrow, int n, int c0, int d,
                      float *pm, float *pl, float *pacc, int pf_bytes) {
    rows_by_nj(qrow, s, nj, njp, lim, krow, vrow, n, c0, d, pm, pl, pacc, pf_bytes, 1);
}

/* n 16-bit K or V entries at src (bfloat16 or float16) as float32 at dst; n a multiple of 8.
 * Both conversions are exact. */
static void widen(const uint16_t *src, float *dst, int n, int kv_dtype) {
    for (int i = 0; i < n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        __m256 f = kv_dtype == KV_BF16
                       ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                       : _mm256_cvtph_ps(h);
        _mm256_storeu_ps(dst + i, f);
    }
}

/* Whether item `it`'s tasks go through `rows`. */
static int takes_rows(const Args *a, int it) {
    return a->nq[it] * (a->hq / a->hkv) <= ROWS_MAX && a->d % 16 == 0 && a->d <= D_MAX;
}

/* Item `it`'s queries of KV head h, times the scale, into qt as its path reads them: by lanes
 * [nj_pad / VL][d][VL] (blocks of VL query heads, each block's rows contiguous, so that a
 * vector's pass reads its own few KiB; padding 0), by rows [nj][d] (bfloat16 rows read in
 * place: d in pair order). Once per item and KV head: filled in each chunk's task, the same
 * values took 7% of the suffix case's time (bench/attention_kernel.py). */
static void fill_queries(const Args *a, int it, int h, float *qt) {
    const int g = a->hq / a->hkv, d = a->d, nj = a->nq[it] * g;
    const int by_rows = takes_rows(a, it);
    const int pairs = by_rows && a->kv_dtype == KV_BF16 && d % 32 == 0;
    const int32_t *qtok = a->qtok + a->qo[it];
    if (!by_rows) memset(qt, 0, sizeof(float) * (size_t)(d * pad16(nj)));
    for (int j = 0; j < nj; j++) {
        const float *qv = a->q + ((int64_t)qtok[j / g] * a->hq + h * g + j % g) * d;
        if (!by_rows) {
            float *col = qt + j / VL * d * VL + j % VL;
            for (int dd = 0; dd < d; dd++) col[dd * VL] = qv[dd] * a->scale;
        } else if (pairs) {
            for (int dd = 0; dd < d; dd++) qt[j * d + pair_slot(dd)] = qv[dd] * a->scale;
        } else {
            for (int dd = 0; dd < d; dd++) qt[j * d + dd] = qv[dd] * a->scale;
        }
    }
}

/* One task: the partials of item `it`'s queries, query heads of KV head h, over keys
 * [c0, c1) of the item. `scratch` holds CHUNK * nj_pad floats, then (a 16-bit cache)
 * 2 * CHUNK * d for the chunk's K and V rows widened to float32. */
static void run_task(const Args *a, const Task *tk, float *parts, float *scratch) {
    const int g = a->hq / a->hkv, d = a->d, h = tk->head, it = tk->item;
    const int nj = a->nq[it] * g;
    const int64_t njp = pad16(nj);
    const int c0 = tk->chunk * CHUNK;
    const int c1 = c0 + CHUNK < a->kv_len[it] ? c0 + CHUNK : a->kv_len[it];
    const int n = c1 - c0;
    const int by_rows = takes_rows(a, it);
    /* `rows` reads bfloat16 rows where they lie (d in pair order); any other 16-bit row is
     * widened into scratch first. */
    const int pairs = by_rows && a->kv_dtype == KV_BF16 && d % 32 == 0;
    const int in_place = a->kv_dtype == KV_F32 || pairs;
    const float *qt = a->qts + a->qt_at[it] + h * njp * d; /* fill_queries */
    /* By lanes, s is blocks of VL query heads, each block's rows contiguous, as qt. */
    float *s = scratch; /* by lanes [njp / VL][CHUNK][VL], by rows [nj][CHUNK]: scores, then
                         * probabilities */
    int32_t lim[njp];
    /* Row addresses; a bfloat16 row read in place is held as a float pointer too (rows_bf16
     * reads it as uint16_t). */
    const float *krow[CHUNK], *vrow[CHUNK];
    float *wide = s + (int64_t)CHUNK * njp; /* a 16-bit cache's rows as float32: K, then V */
    const int32_t *qlim = a->qlim + a->qo[it];

    /* `lanes` reads whole vectors, padding included; `rows` only the nj query heads. */
    for (int64_t j = 0; j < (by_rows ? nj : njp); j++)
        lim[j] = j < nj ? qlim[j / g] : c1; /* padding lanes see every key; dropped later */
    const int32_t *blocks = a->blocks + a->bo[it];
    const int64_t row_bytes = (int64_t)d * a->esize, slot_bytes = a->hkv * row_bytes;
    /* Key c0 + t sits in block (c0 + t) / bs at offset (c0 + t) % bs, stepped key by key. */
    for (int t = 0, b = c0 / a->bs, o = c0 % a->bs; t < n; t++) {
        int64_t at = ((int64_t)blocks[b] * a->bs + o) * slot_bytes + h * row_bytes;
        if (in_place) {
            krow[t] = (const float *)(a->k_cache + at);
            vrow[t] = (const float *)(a->v_cache + at);
        } else {
            /* The first KV head's pass asks for whole slot rows PF keys ahead, as `rows` does
             * for a float32 cache; the others then find theirs in cache. */
            if (h == 0 && t + PF < n) {
                int k2 = c0 + t + PF; /* the key PF ahead: block k2 / bs, offset k2 % bs */
                int64_t at2 = ((int64_t)blocks[k2 / a->bs] * a->bs + k2 % a->bs) * slot_bytes;
                for (int64_t off = 0; off < slot_bytes; off += 64) {
                    _mm_prefetch(a->k_cache + at2 + off, _MM_HINT_T0);
                    _mm_prefetch(a->v_cache + at2 + off, _MM_HINT_T0);
                }
            }
            float *kw = wide + (int64_t)t * d, *vw = wide + (int64_t)(CHUNK + t) * d;
            widen((const uint16_t *)(a->k_cache + at), kw, d, a->kv_dtype);
            widen((const uint16_t *)(a->v_cache + at), vw, d, a->kv_dtype);
            krow[t] = kw, vrow[t] = vw;
        }
        if (++o == a->bs) o = 0, b++;
    }
    for (int t = n; t < CHUNK; t++) /* past n: copies of key 0, so tiles load valid memory */
        krow[t] = krow[0], vrow[t] = vrow[0];

    float *pm = parts + tk->part, *pl = pm + njp, *pacc = pl + njp;
    if (by_rows) {
        int pf_bytes = h == 0 && in_place ? (int)slot_bytes : 0; /* widened: prefetched above */
        (pairs ? rows_bf16 : rows)(qt, s, nj, njp, lim, krow, vrow, n, c0, d, pm, pl, pacc,
                                   pf_bytes);
        return;
    }
    /* Vectors past the last query head hold only padding, which the merge never reads. */
    const int by_d = BY_HEAD(d);
    for (int64_t j0 = 0; j0 < nj; j0 += VL) /* the first vector's pass brings K in */
        lanes(qt + j0 * d, s + j0 * CHUNK, njp, lim + j0, krow, vrow, n, c0, d, pm + j0, pl + j0,
              pacc + j0, j0 == 0 && in_place ? (int)row_bytes : 0, !by_d);
    if (by_d) pv_by_d(s, vrow, n, nj, d, pacc, in_place);
}

/* out = softmax(q . K) V for every row, over the keys its items give it.
 * Returns 0, or -1 on bad sizes (d % 8, hq % hkv), an unknown kv_dtype or a failed
 * allocation. */
int kva_paged_attention(const float *q, const void *k_cache, const void *v_cache, float *out,
                        const int32_t *blocks, int T, int hq, int hkv, int d, int bs, int n_items,
                        const int32_t *kv_len, const int32_t *bo, const int32_t *qo,
                        const int32_t *nq, const int32_t *qtok, const int32_t *qlim, float scale,
                        int nthreads, int kv_dtype) {
    if (d % TU != 0 || hkv < 1 || hq % hkv != 0 || bs < 1 || T < 0) return -1;
    if (kv_dtype != KV_F32 && kv_dtype != KV_BF16 && kv_dtype != KV_F16) return -1;
    const int g = hq / hkv;
    Args a = {q, k_cache, v_cache, hq, hkv, d, bs, kv_dtype, kv_dtype == KV_F32 ? 4 : 2,
              blocks, kv_len, bo, qo, nq, qtok, qlim, scale, NULL, NULL};
    int64_t n_tasks = 0, part_floats = 0, max_njp = 0, qt_floats = 0;
    int64_t *qt_at = malloc(sizeof(int64_t) * (size_t)(n_items ? n_items : 1));
    if (!qt_at) return -1;
    for (int i = 0; i < n_items; i++) {
        int64_t njp = pad16((int64_t)nq[i] * g);
        int64_t chunks = (kv_len[i] + CHUNK - 1) / CHUNK;
        n_tasks += chunks * hkv;
        part_floats += chunks * hkv * njp * (d + 2);
        if (njp > max_njp) max_njp = njp;
        qt_at[i] = qt_floats;
        qt_floats += hkv * njp * d;
    }
    float *qts = malloc(sizeof(float) * (size_t)(qt_floats ? qt_floats : 1));
    a.qts = qts, a.qt_at = qt_at;
    Task *tasks = malloc(sizeof(Task) * (size_t)(n_tasks ? n_tasks : 1));
    /* Units of work, each a run of tasks: unit u is tasks [units[u], units[u + 1]). A chunk of
     * an item taken by `rows` is one unit (all its KV heads: its slots are read whole, in
     * order); any other task is a unit of its own. */
    int64_t *units = malloc(sizeof(int64_t) * (size_t)(n_tasks + 1));
    float *parts = malloc(sizeof(float) * (size_t)(part_floats ? part_floats : 1));
    float *state = malloc(sizeof(float) * (size_t)T * hq * (d + 2)); /* max, sum, acc[d] */
    if (!tasks || !units || !parts || !state || !qts) {
        free(tasks), free(units), free(parts), free(state), free(qts), free(qt_at);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t ih = 0; ih < (int64_t)n_items * hkv; ih++) {
        int i = (int)(ih / hkv), h = (int)(ih % hkv);
        fill_queries(&a, i, h, qts + qt_at[i] + h * pad16((int64_t)nq[i] * g) * d);
    }
    int64_t nt = 0, nu = 0, off = 0;
    for (int i = 0; i < n_items; i++) {
        int64_t njp = pad16((int64_t)nq[i] * g);
        int whole_chunks = takes_rows(&a, i);
        for (int c = 0; c * CHUNK < kv_len[i]; c++)
            for (int h = 0; h < hkv; h++) {
                if (h == 0 || !whole_chunks) units[nu++] = nt;
                tasks[nt++] = (Task){i, c, h, off};
                off += njp * (d + 2);
            }
    }
    units[nu] = nt;

    const size_t scratch_floats =
        (size_t)CHUNK * max_njp + (kv_dtype == KV_F32 ? 0 : (size_t)2 * CHUNK * d);
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *scratch = malloc(sizeof(float) * (scratch_floats ? scratch_floats : 1));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < nu; u++) {
            if (!scratch) continue;
            for (int64_t t = units[u]; t < units[u + 1]; t++)
                run_task(&a, &tasks[t], parts, scratch);
        }
        free(scratch);
    }
    free(units), free(qts), free(qt_at);
    if (failed) {
        free(tasks), free(parts), free(state);
        return -1;
    }

    /* Merge the partials per query head; heads of one KV head are merged by one thread. */
    float *smax = state, *ssum = state + (int64_t)T * hq, *sacc = ssum + (int64_t)T * hq;
    for (int64_t r = 0; r < (int64_t)T * hq; r++) smax[r] = -INFINITY, ssum[r] = 0.0f;
    memset(sacc, 0, sizeof(float) * (size_t)T * hq * d);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int h = 0; h < hkv; h++) {
        const int by_head = BY_HEAD(d);
        for (int64_t t = 0; t < nt; t++) {
            const Task *tk = &tasks[t];
            if (tk->head != h) continue;
            int it = tk->item, nj = nq[it] * g;
            int64_t njp = pad16(nj);
            const float *pm = parts + tk->part, *pl = pm + njp, *pacc = pl + njp;
            for (int j = 0; j < nj; j++) {
                if (pl[j] == 0.0f) continue; /* no visible key in this chunk */
                int64_t r = (int64_t)qtok[qo[it] + j / g] * hq + h * g + j % g;
                float m = fmaxf(smax[r], pm[j]);
                float a_old = smax[r] == -INFINITY ? 0.0f : expf(smax[r] - m);
                float a_new = expf(pm[j] - m);
                ssum[r] = ssum[r] * a_old + pl[j] * a_new;
                const float *pj = by_head ? pacc + (int64_t)j * d : pacc + j;
                const int64_t step = by_head ? 1 : njp;
                for (int dd = 0; dd < d; dd++)
                    sacc[r * d + dd] = sacc[r * d + dd] * a_old + pj[dd * step] * a_new;
                smax[r] = m;
            }
        }
    }
    for (int64_t r = 0; r < (int64_t)T * hq; r++)
        for (int dd = 0; dd < d; dd++) out[r * d + dd] = sacc[r * d + dd] / ssum[r];
    free(tasks), free(parts), free(state);
    return 0;
}
