/* Quantized-weight matmuls for CPU: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias), x and y float32.
 *
 * Weight formats (one byte or half a byte per value, row-major [N, K] with K contiguous):
 *   QFMT_INT8   int8 values, one float scale per output row (row_scale, applied to the dot product)
 *   QFMT_FP8    E4M3 bytes; a float scale per output row, or per (row, group of `group` K values)
 *   QFMT_MXFP4  E2M1 nibbles (two per byte, low nibble first), one E8M0 byte scale per 32 values
 *   QFMT_NVFP4  E2M1 nibbles, one E4M3 byte scale per 16 values, times a per-tensor float `global_scale`
 *
 * There is no native low-precision arithmetic on AVX2 CPUs, so the kernels stream the narrow weights (the
 * point: decode is bound by the bytes it reads) and widen them in registers.
 *
 * qlinear_f32 (float activations): for 1-2 rows of x (decode) int8 / per-channel fp8 rows are widened and
 * used at once (fused_*); otherwise a thread dequantizes 4 output rows into an L1-resident float buffer once
 * and takes their dot products with every row of x (3 x 4 independent FMA chains), x walked in L2-sized
 * tiles. E4M3 decodes with integer bit moves (the byte's exponent|mantissa at float bit 20 is the value times
 * 2^-120, subnormals included); E2M1 through a 16-entry byte shuffle to twice its value as a small integer.
 *
 * int8_linear_iq (integer activations): int8 weights times activations quantized per row, products summed
 * exactly in integers. Used by w8a8 (int8 activations) and by int8 weight-only decode (16-bit activations),
 * where it halves the instructions per weight of the float path.
 *
 * Weight rows are always walked one after the other: short narrow rows read as 4 interleaved streams defeat
 * the hardware prefetcher. GCC vector extensions keep the float paths portable; AVX2 intrinsics where GCC
 * would scalarize (8-byte widening, byte shuffles, vpmaddwd), with scalar fallbacks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

enum { QFMT_INT8 = 0, QFMT_FP8 = 1, QFMT_MXFP4 = 2, QFMT_NVFP4 = 3 };

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef int8_t v8s8 __attribute__((vector_size(8)));

#define NR 4          /* weight rows per block */
#define L2_TILE_BYTES (192 * 1024)

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

#ifdef __AVX2__
/* GCC scalarizes widening conversions of 8-byte vectors, so the x86 path spells them out. */
static inline v8i widen_s8(const uint8_t *p) { return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline v8i widen_s8(const uint8_t *p) { v8s8 b; memcpy(&b, p, 8); return __builtin_convertvector(b, v8i); }
#endif

/* 8 int8 -> 8 floats */
static inline v8f int8x8(const uint8_t *p) { return __builtin_convertvector(widen_s8(p), v8f); }

/* 8 E4M3 bytes -> 8 floats. The byte sign-extended and shifted left by 20 puts the sign at bit 31 and
 * exponent|mantissa at bits 26..20 (the mask drops the sign copies in between): the value times 2^-120. */
static inline v8f fp8x8(const uint8_t *p) {
    const v8i u = (widen_s8(p) << 20) & (int32_t)0x87f00000;
    v8f f; memcpy(&f, &u, sizeof f);
    return f * 0x1p120f;
}

static inline float fp8_to_float(uint8_t b) {
    uint32_t u = ((uint32_t)(b & 0x7f) << 20) | ((uint32_t)(b & 0x80) << 24);
    float f; memcpy(&f, &u, 4);
    return f * 0x1p120f;
}

/* E2M1 code -> twice its value, as int8 (0, 1, 2, 3, 4, 6, 8, 12 and negatives): exact small integers, the
 * factor 1/2 goes into the block scale. */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 8 bytes = 16 E2M1 nibbles (low nibble first) -> 16 floats (twice the values) */
static inline void fp4x16(const uint8_t *p, float *out) {
#ifdef __AVX2__
    const __m128i lut = _mm_loadu_si128((const __m128i *)E2M1_X2);
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    const __m128i v = _mm_unpacklo_epi8(lo, hi); /* elements 0..15 in order */
    _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    _mm256_storeu_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
#else
    for (int i = 0; i < 8; i++) {
        out[2 * i] = E2M1_X2[p[i] & 0xf];
        out[2 * i + 1] = E2M1_X2[p[i] >> 4];
    }
#endif
}

/* E8M0 exponent byte -> 2^(e - 127), halved (see E2M1_X2) */
static inline float e8m0_half(uint8_t e) {
    if (e < 2) return ldexpf(1.0f, (int)e - 128); /* below the normal float range */
    const uint32_t u = (uint32_t)(e - 1) << 23;
    float f; memcpy(&f, &u, 4);
    return f;
}

/* Dequantize one weight row into out[K] (row scale excluded: the caller applies it to the dot product). */
static void dequant_row(int fmt, const uint8_t *w, const void *scales, int64_t K, int64_t group,
                        float global_scale, float *out) {
    const int64_t K8 = K & ~(int64_t)7;
    if (fmt == QFMT_INT8) {
        for (int64_t k = 0; k < K8; k += 8) store8(out + k, int8x8(w + k));
        for (int64_t k = K8; k < K; k++) out[k] = (float)(int8_t)w[k];
    } else if (fmt == QFMT_FP8) {
        const float *s = (const float *)scales;
        if (s == NULL || group <= 0) {
            for (int64_t k = 0; k < K8; k += 8) store8(out + k, fp8x8(w + k));
            for (int64_t k = K8; k < K; k++) out[k] = fp8_to_float(w[k]);
        } else {
            for (int64_t k0 = 0, g = 0; k0 < K; k0 += group, g++) {
                const int64_t k1 = k0 + group < K ? k0 + group : K;
                const float sc = s[g];
                int64_t k = k0;
                for (; k + 8 <= k1; k += 8) store8(out + k, fp8x8(w + k) * sc);
                for (; k < k1; k++) out[k] = fp8_to_float(w[k]) * sc;
            }
        }
    } else { /* FP4: K is a multiple of the block size (checked by the caller) */
        const uint8_t *s = (const uint8_t *)scales;
        const int64_t bs = fmt == QFMT_MXFP4 ? 32 : 16;
        const float gs = 0.5f * global_scale;
        for (int64_t k0 = 0, g = 0; k0 < K; k0 += bs, g++) {
            const float sc = fmt == QFMT_MXFP4 ? e8m0_half(s[g]) : fp8_to_float(s[g]) * gs;
            for (int64_t k = k0; k < k0 + bs; k += 16) {
                fp4x16(w + k / 2, out + k);
                store8(out + k, load8(out + k) * sc);
                store8(out + k + 8, load8(out + k + 8) * sc);
            }
        }
    }
}

/* Weight-streaming dot products for few rows of x (decode): int8 or per-channel fp8 rows widened in
 * registers and used straight away, no buffer. acc[m][r] for mr (1 or 2) rows of x, NR weight rows, walked
 * one row after the other (short narrow rows read as interleaved streams defeat the hardware prefetcher). */
#define FUSED_KERNEL(NAME, WIDEN)                                                                          \
    static inline void NAME(const uint8_t *const *w, int64_t K, const float *x, int64_t ldx, int mr,        \
                            float acc[2][NR]) {                                                             \
        for (int r = 0; r < NR; r++) {                                                                      \
            v8f a0 = {0}, a1 = {0}, b0 = {0}, b1 = {0};                                                     \
            if (mr == 2) {                                                                                  \
                for (int64_t k = 0; k < K; k += 8) {                                                        \
                    const v8f wv = WIDEN(w[r] + k);                                                         \
                    a0 += wv * load8(x + k);                                                                \
                    a1 += wv * load8(x + ldx + k);                                                          \
                }                                                                                           \
            } else {                                                                                        \
                int64_t k = 0;                                                                              \
                for (; k + 16 <= K; k += 16) {                                                              \
                    a0 += WIDEN(w[r] + k) * load8(x + k);                                                   \
                    b0 += WIDEN(w[r] + k + 8) * load8(x + k + 8);                                           \
                }                                                                                           \
                for (; k < K; k += 8) a0 += WIDEN(w[r] + k) * load8(x + k);                                 \
            }                                                                                               \
            acc[0][r] = hsum8(a0 + b0);                                                                     \
            acc[1][r] = hsum8(a1 + b1);                                                                     \
        }                                                                                                   \
    }
FUSED_KERNEL(fused_int8, int8x8)
FUSED_KERNEL(fused_fp8, fp8x8)

static inline int64_t row_bytes(int fmt, int64_t K) { return fmt >= QFMT_MXFP4 ? K / 2 : K; }

static inline const void *row_scales(int fmt, const void *scales, int64_t n, int64_t K, int64_t group) {
    if (scales == NULL) return NULL;
    if (fmt == QFMT_FP8) return group > 0 ? (const float *)scales + n * ((K + group - 1) / group) : NULL;
    if (fmt == QFMT_MXFP4) return (const uint8_t *)scales + n * (K / 32);
    if (fmt == QFMT_NVFP4) return (const uint8_t *)scales + n * (K / 16);
    return NULL;
}

/* acc[m][r] = dot(x row m, buffer row r) for mr (1..3) rows of x against NR buffer rows. */
#define DOT_KERNEL(MR)                                                                                    \
    static inline void dot_##MR(const float *b, int64_t K, const float *x, int64_t ldx, float acc[3][NR]) {\
        v8f a[MR][NR];                                                                                    \
        for (int m = 0; m < MR; m++)                                                                      \
            for (int r = 0; r < NR; r++) a[m][r] = (v8f){0};                                              \
        const int64_t K8 = K & ~(int64_t)7;                                                               \
        for (int64_t k = 0; k < K8; k += 8) {                                                             \
            v8f xv[MR];                                                                                   \
            for (int m = 0; m < MR; m++) xv[m] = load8(x + m * ldx + k);                                  \
            for (int r = 0; r < NR; r++) {                                                                \
                const v8f wv = load8(b + r * K + k);                                                      \
                for (int m = 0; m < MR; m++) a[m][r] += wv * xv[m];                                       \
            }                                                                                             \
        }                                                                                                 \
        for (int m = 0; m < MR; m++)                                                                      \
            for (int r = 0; r < NR; r++) {                                                                \
                float s = hsum8(a[m][r]);                                                                 \
                for (int64_t k = K8; k < K; k++) s += b[r * K + k] * x[m * ldx + k];                      \
                acc[m][r] = s;                                                                            \
            }                                                                                             \
    }
DOT_KERNEL(1)
DOT_KERNEL(2)
DOT_KERNEL(3)

#define FUSED_MAX_M 2

void quantize_rows_i16(const float *x, int64_t M, int64_t K, int32_t qmax, int16_t *q, float *scales);

#ifdef __AVX2__
#define LOADI16(p) _mm256_loadu_si256((const __m256i *)(p))
/* acc + the pairwise int32 sums of w * x (16 int16 each) */
#define MADD_ACC(acc, w, x) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (x)))

/* 8 bytes = 16 E2M1 codes -> 16 int16 holding twice the values */
static inline __m256i fp4x16_i16(const uint8_t *p) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)E2M1_X2);
    const __m128i b = _mm_loadl_epi64((const __m128i *)p);
    const __m128i m = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, m));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi));
}

/* FP4 decode rows against 1-2 rows of x on a 16-bit grid (xq, scales xs): each block's products are summed
 * exactly in int32 (vpmaddwd), then scaled by the block scale into a float accumulator. */
static void fp4_rows_iq(int fmt, const uint8_t *w, const uint8_t *scales, int64_t n0, int64_t nr,
                        const int16_t *xq, const float *xs, int64_t M, int64_t K, float global_scale,
                        const float *bs, float *y, int64_t N) {
    const int mx = fmt == QFMT_MXFP4;
    const int64_t bsz = mx ? 32 : 16, nblk = K / bsz;
    const float gs = 0.5f * global_scale;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *wr = w + (n0 + r) * (K / 2), *sr = scales + (n0 + r) * nblk;
        for (int64_t m = 0; m < M; m += 2) {
            const int two = M - m >= 2;
            const int16_t *x0 = xq + m * K, *x1 = two ? x0 + K : x0;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (int64_t b = 0; b < nblk; b++) {
                const __m256 sc = _mm256_set1_ps(mx ? e8m0_half(sr[b]) : fp8_to_float(sr[b]) * gs);
                const int64_t k = b * bsz;
                const __m256i w0 = fp4x16_i16(wr + k / 2);
                __m256i p0 = _mm256_madd_epi16(w0, LOADI16(x0 + k));
                __m256i p1 = two ? _mm256_madd_epi16(w0, LOADI16(x1 + k)) : p0;
                if (mx) {
                    const __m256i w1 = fp4x16_i16(wr + k / 2 + 8);
                    p0 = MADD_ACC(p0, w1, LOADI16(x0 + k + 16));
                    if (two) p1 = MADD_ACC(p1, w1, LOADI16(x1 + k + 16));
                }
                a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), sc, a0);
                if (two) a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), sc, a1);
            }
            y[m * N + n0 + r] = hsum8((v8f)a0) * xs[m] + bs[r];
            if (two) y[(m + 1) * N + n0 + r] = hsum8((v8f)a1) * xs[m + 1] + bs[r];
        }
    }
}
#define HAVE_FP4_IQ 1
#else
#define HAVE_FP4_IQ 0
#endif

static void fused_block(int fmt, const uint8_t *w, int64_t rb, int64_t n0, int64_t nr, const float *x, int64_t M,
                        int64_t K, const float *rs, const float *bs, float *y, int64_t N) {
    const uint8_t *rows[NR];
    for (int r = 0; r < NR; r++) rows[r] = w + (n0 + (r < nr ? r : 0)) * rb;
    for (int64_t m = 0; m < M; m += 2) {
        const int mr = M - m >= 2 ? 2 : 1;
        float acc[2][NR];
        if (fmt == QFMT_INT8) fused_int8(rows, K, x + m * K, K, mr, acc);
        else fused_fp8(rows, K, x + m * K, K, mr, acc);
        for (int i = 0; i < mr; i++)
            for (int64_t r = 0; r < nr; r++) y[(m + i) * N + n0 + r] = acc[i][r] * rs[r] + bs[r];
    }
}

void qlinear_f32(int fmt, const float *x, int64_t M, const uint8_t *w, const void *scales, const float *row_scale,
                 int64_t N, int64_t K, int64_t group, float global_scale, const float *bias, float *y,
                 int allow_fused, int num_threads) {
    const int64_t nblocks = (N + NR - 1) / NR;
    const int64_t rb = row_bytes(fmt, K);
    /* The fused path sums each dot product in another order than the buffered one; batch-invariant callers
     * pass allow_fused = 0 so that a row's result never depends on M. */
    const int fused = allow_fused && M <= FUSED_MAX_M && K % 8 == 0 &&
                      (fmt == QFMT_INT8 || (fmt == QFMT_FP8 && group <= 0));
    const int fused_fp4 = HAVE_FP4_IQ && allow_fused && M <= FUSED_MAX_M && (fmt == QFMT_MXFP4 || fmt == QFMT_NVFP4);
    int16_t *xq = NULL;
    float *xs = NULL;
    if (fused_fp4) {
        xq = aligned_alloc(64, ((M * K * sizeof(int16_t)) + 63) & ~(size_t)63);
        xs = malloc(M * sizeof(float));
        quantize_rows_i16(x, M, K, 32767, xq, xs);
    }
    int64_t mt = L2_TILE_BYTES / (4 * K);
    mt = mt < 3 ? 3 : mt - mt % 3;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = (fused || fused_fp4) ? NULL : aligned_alloc(64, ((NR * K * sizeof(float)) + 63) & ~(size_t)63);
        for (int64_t m0 = 0; m0 < M; m0 += mt) {
            const int64_t m1 = m0 + mt < M ? m0 + mt : M;
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < nblocks; blk++) {
                const int64_t n0 = blk * NR;
                const int64_t nr = N - n0 < NR ? N - n0 : NR;
                float rs[NR], bs[NR];
                for (int64_t r = 0; r < NR; r++) {
                    rs[r] = (r < nr && row_scale) ? row_scale[n0 + r] : 1.0f;
                    bs[r] = (r < nr && bias) ? bias[n0 + r] : 0.0f;
                }
                if (fused) {
                    fused_block(fmt, w, rb, n0, nr, x + m0 * K, m1 - m0, K, rs, bs, y + m0 * N, N);
                    continue;
                }
#if HAVE_FP4_IQ
                if (fused_fp4) {
                    fp4_rows_iq(fmt, w, (const uint8_t *)scales, n0, nr, xq + m0 * K, xs + m0, m1 - m0, K,
                                global_scale, bs, y + m0 * N, N);
                    continue;
                }
#endif
                for (int64_t r = 0; r < NR; r++) {
                    if (r < nr)
                        dequant_row(fmt, w + (n0 + r) * rb, row_scales(fmt, scales, n0 + r, K, group), K, group,
                                    global_scale, buf + r * K);
                    else
                        memset(buf + r * K, 0, K * sizeof(float));
                }
                for (int64_t m = m0; m < m1;) {
                    float acc[3][NR];
                    const int64_t left = m1 - m;
                    const int mr = left >= 3 ? 3 : (int)left;
                    if (mr == 3) dot_3(buf, K, x + m * K, K, acc);
                    else if (mr == 2) dot_2(buf, K, x + m * K, K, acc);
                    else dot_1(buf, K, x + m * K, K, acc);
                    for (int i = 0; i < mr; i++)
                        for (int64_t r = 0; r < nr; r++) y[(m + i) * N + n0 + r] = acc[i][r] * rs[r] + bs[r];
                    m += mr;
                }
            }
        }
        free(buf);
    }
    free(xq);
    free(xs);
}

/* Full dequantization to float32 [N, K] (row scales applied): the large-batch path and the tests. */
void qdequant_f32(int fmt, const uint8_t *w, const void *scales, const float *row_scale, int64_t N, int64_t K,
                  int64_t group, float global_scale, float *out, int num_threads) {
    const int64_t rb = row_bytes(fmt, K);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        float *o = out + n * K;
        dequant_row(fmt, w + n * rb, row_scales(fmt, scales, n, K, group), K, group, global_scale, o);
        if (row_scale) {
            const float s = row_scale[n];
            for (int64_t k = 0; k < K; k++) o[k] *= s;
        }
    }
}

/* ---------------------------------------------------------------------------------------------------- */
/* INT8 weights x integer activations: exact int32 products (AVX2 vpmaddwd: 16 multiply-adds per
 * instruction, on int8 weights widened to int16), so no per-weight float conversion.
 * Activations are quantized per row of x, symmetric, to [-qmax, qmax]: qmax = 127 for w8a8, 32767 for the
 * int8 weight-only path (a 16-bit grid, finer than bf16's rounding of the same activations). Partial sums
 * are moved to int64 every KCHUNK values so they never overflow int32 (16 lanes x 2 products x 127 x 32767
 * x KCHUNK / 16 < 2^31). */

#define KCHUNK 2048

/* Round half to even, like torch.round. */
static inline int32_t round_even(float v) { return (int32_t)nearbyintf(v); }

/* max |x[k]| (NaNs skipped, as fmaxf does). In 8 lanes: a libm fmaxf call per value cost more than the
 * whole 1-row matmul of a small layer. */
static float abs_max(const float *x, int64_t K) {
    const int64_t K8 = K & ~(int64_t)7;
    v8f m = {0};
    for (int64_t k = 0; k < K8; k += 8) {
        const v8i a = (v8i)load8(x + k) & 0x7fffffff, gt = (v8f)a > m;
        m = (v8f)((a & gt) | ((v8i)m & ~gt));
    }
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = m[i] > amax ? m[i] : amax;
    for (int64_t k = K8; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    return amax;
}

/* Per-row symmetric quantization of x [M, K] to int16 values in [-qmax, qmax] and their scales. */
void quantize_rows_i16(const float *x, int64_t M, int64_t K, int32_t qmax, int16_t *q, float *scales) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        const float amax = abs_max(xm, K);
        const float s = amax > 0.0f ? amax / (float)qmax : 1.0f;
        const float inv = 1.0f / s;
        int16_t *qm = q + m * K;
        for (int64_t k = 0; k < K; k++) {
            int32_t v = round_even(xm[k] * inv);
            qm[k] = (int16_t)(v > qmax ? qmax : v < -qmax ? -qmax : v);
        }
        scales[m] = s;
    }
}

#ifdef __AVX2__
static inline int32_t hsum_i32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
    return _mm_cvtsi128_si32(h);
}
#endif

/* acc[i][r] += dot(xq rows m..m+MR-1, weight rows r) over k in [k0, k1); weights int8 (W8) or already
 * widened to int16 in L1 (W16). Specialized per (weights, MR) so the accumulators stay in registers. */
#ifdef __AVX2__
#define LOAD_W8(p, k) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const int8_t *)(p) + (k))))
#define LOAD_W16(p, k) LOADI16((const int16_t *)(p) + (k))
/* Weight rows are walked one after the other (not interleaved): short int8 rows read as 4 interleaved
 * streams defeat the hardware prefetcher (measured ~1.4x slower at decode). */
#define IDOT(NAME, LOADW, WIDE, MR)                                                                        \
    static void NAME(const void *const *w, const int16_t *xq, int64_t ldx, int64_t k0, int64_t k1,         \
                     int64_t acc[2][NR]) {                                                                \
        int64_t k = k0;                                                                                    \
        for (int r = 0; r < NR; r++) {                                                                     \
            __m256i a[MR][2];                                                                              \
            for (int i = 0; i < MR; i++) a[i][0] = a[i][1] = _mm256_setzero_si256();                       \
            for (k = k0; k + 32 <= k1; k += 32) {                                                          \
                const __m256i w0 = LOADW(w[r], k), w1 = LOADW(w[r], k + 16);                              \
                for (int i = 0; i < MR; i++) {                                                             \
                    const int16_t *xi = xq + i * ldx + k;                                                  \
                    a[i][0] = MADD_ACC(a[i][0], w0, LOADI16(xi));                                          \
                    a[i][1] = MADD_ACC(a[i][1], w1, LOADI16(xi + 16));                                     \
                }                                                                                          \
            }                                                                                              \
            for (; k + 16 <= k1; k += 16) {                                                                \
                const __m256i w0 = LOADW(w[r], k);                                                         \
                for (int i = 0; i < MR; i++)                                                               \
                    a[i][0] = MADD_ACC(a[i][0], w0, LOADI16(xq + i * ldx + k));                            \
            }                                                                                              \
            for (int i = 0; i < MR; i++) acc[i][r] += hsum_i32(_mm256_add_epi32(a[i][0], a[i][1]));        \
        }                                                                                                  \
        idot_tail(w, WIDE, xq, ldx, MR, k, k1, acc);                                                       \
    }
#endif

static inline void idot_tail(const void *const *w, int wide, const int16_t *xq, int64_t ldx, int mr, int64_t k,
                             int64_t k1, int64_t acc[2][NR]) {
    for (; k < k1; k++)
        for (int r = 0; r < NR; r++) {
            const int32_t wv = wide ? ((const int16_t *)w[r])[k] : ((const int8_t *)w[r])[k];
            for (int i = 0; i < mr; i++) acc[i][r] += (int64_t)wv * xq[i * ldx + k];
        }
}

#ifdef __AVX2__
IDOT(idot_w8_1, LOAD_W8, 0, 1)
IDOT(idot_w8_2, LOAD_W8, 0, 2)
IDOT(idot_w16_1, LOAD_W16, 1, 1)
IDOT(idot_w16_2, LOAD_W16, 1, 2)
#endif

static void idot_block(const void *const *w, int wide, const int16_t *xq, int64_t ldx, int mr, int64_t k0,
                       int64_t k1, int64_t acc[2][NR]) {
#ifdef __AVX2__
    if (wide) (mr == 2 ? idot_w16_2 : idot_w16_1)(w, xq, ldx, k0, k1, acc);
    else (mr == 2 ? idot_w8_2 : idot_w8_1)(w, xq, ldx, k0, k1, acc);
#else
    idot_tail(w, wide, xq, ldx, mr, k0, k1, acc);
#endif
}

#define WIDEN_MIN_M 5 /* from this many rows of x on, widen each weight block to int16 once, in L1 */

void int8_linear_iq(const float *x, int64_t M, int32_t qmax, const int8_t *w, const float *w_scale, int64_t N,
                    int64_t K, const float *bias, float *y, int num_threads) {
    int16_t *xq = aligned_alloc(64, ((M * K * sizeof(int16_t)) + 63) & ~(size_t)63);
    float *xs = malloc(M * sizeof(float));
    quantize_rows_i16(x, M, K, qmax, xq, xs);
    const int64_t nblocks = (N + NR - 1) / NR;
    const int wide = M >= WIDEN_MIN_M;
#pragma omp parallel num_threads(num_threads)
    {
        int16_t *buf = wide ? aligned_alloc(64, ((NR * K * sizeof(int16_t)) + 63) & ~(size_t)63) : NULL;
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < nblocks; blk++) {
            const int64_t n0 = blk * NR;
            const int64_t nr = N - n0 < NR ? N - n0 : NR;
            const void *rows[NR];
            for (int64_t r = 0; r < NR; r++) {
                const int8_t *src = w + (n0 + (r < nr ? r : 0)) * K;
                if (wide) {
                    for (int64_t k = 0; k < K; k++) buf[r * K + k] = src[k];
                    rows[r] = buf + r * K;
                } else {
                    rows[r] = src;
                }
            }
            for (int64_t m = 0; m < M; m += 2) {
                const int mr = M - m >= 2 ? 2 : 1;
                int64_t acc[2][NR] = {{0}};
                for (int64_t k0 = 0; k0 < K; k0 += KCHUNK)
                    idot_block(rows, wide, xq + m * K, K, mr, k0, k0 + KCHUNK < K ? k0 + KCHUNK : K, acc);
                for (int i = 0; i < mr; i++)
                    for (int64_t r = 0; r < nr; r++)
                        y[(m + i) * N + n0 + r] = (float)acc[i][r] * (xs[m + i] * w_scale[n0 + r]) +
                                                  (bias ? bias[n0 + r] : 0.0f);
            }
        }
        free(buf);
    }
    free(xs);
    free(xq);
}
