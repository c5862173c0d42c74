/* RMSNorm (with the residual add before it) and RoPE for the float32 model on CPU.
 *
 * In torch each is 4-8 small ops a layer (pow, mean, add, rsqrt, mul, mul; mul, roll, mul,
 * add), each a few microseconds of dispatch at a decode step's few rows: ~2 ms of a ~20 ms
 * single-request step of smollm2, for microseconds of arithmetic. One call each here.
 *
 * kvn_rope gives torch's `x * cos + x.roll(d / 2, -1) * sin` (model.py's apply_rope) bit for
 * bit: the same two products and one sum, each rounded once. GCC turns a vector multiply
 * whose result feeds an add into one fused multiply-add (one rounding) unless it cannot see
 * the product, hence OPAQUE.
 *
 * kvn_rmsnorm sums the squares in another order than torch's mean does, so its results may
 * differ from torch's in the last bit (KERNEL_NUMERICS in cpu_attention.py says so to the
 * fingerprint); everything after the sum follows HF's order: x * rsqrt(mean + eps), then
 * times the weight.
 */
#include <math.h>
#include <stdint.h>

#include <immintrin.h>

#define OPAQUE(v) __asm__("" : "+x"(v))

enum { ROPE_D_MAX = 512 };

/* x [t][heads][d] in place, rows `stride` floats apart (q or k: a column slice of the fused
 * projection's output), heads contiguous; cos, sin [t][d], sin's first half negated. */
int kvn_rope(float *x, int64_t stride, const float *cos, const float *sin, int64_t t,
             int64_t heads, int64_t d, int nthreads) {
    if (d % 16 != 0 || d > ROPE_D_MAX || t < 0 || heads < 1) return -1;
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (t * heads >= 256)
    for (int64_t i = 0; i < t; i++) {
        const float *c = cos + i * d, *s = sin + i * d;
        for (int64_t h = 0; h < heads; h++) {
            float *r = x + i * stride + h * d, out[ROPE_D_MAX];
            for (int64_t j = 0; j < d; j += 8) {
                const int64_t rolled = j < half ? j + half : j - half;
                __m256 a = _mm256_mul_ps(_mm256_loadu_ps(r + j), _mm256_loadu_ps(c + j));
                __m256 b = _mm256_mul_ps(_mm256_loadu_ps(r + rolled), _mm256_loadu_ps(s + j));
                OPAQUE(a);
                OPAQUE(b);
                _mm256_storeu_ps(out + j, _mm256_add_ps(a, b));
            }
            for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(r + j, _mm256_loadu_ps(out + j));
        }
    }
    return 0;
}

/* x [t][n] (contiguous): with `residual` (else NULL), x += residual first, in place (the
 * sum is the next residual). Then out = w * (x * rsqrt(mean(x^2) + eps)). */
int kvn_rmsnorm(float *x, const float *residual, const float *w, float *out, int64_t t,
                int64_t n, float eps, int nthreads) {
    if (n % 8 != 0 || n < 8 || t < 0) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (t >= 32)
    for (int64_t i = 0; i < t; i++) {
        float *xr = x + i * n, *o = out + i * n;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j += 8) {
            __m256 v = _mm256_loadu_ps(xr + j);
            if (residual) {
                v = _mm256_add_ps(v, _mm256_loadu_ps(residual + i * n + j));
                _mm256_storeu_ps(xr + j, v);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        float sum = 0.0f;
        for (int k = 0; k < 8; k++) sum += lanes[k];
        /* As torch: mean (a true division), + eps, then rsqrt as 1 / sqrt, each rounded. */
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(sum / (float)n + eps));
        for (int64_t j = 0; j < n; j += 8) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + j), scale);
            OPAQUE(v);
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_loadu_ps(w + j), v));
        }
    }
    return 0;
}
