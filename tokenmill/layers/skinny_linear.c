/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation, with a fixed reduction order per output.
 *
 * Two uses:
 * - Decode-sized matmuls (few rows) are weight-streaming: every weight byte is used M times and then never
 *   again in the step, so the limit is memory bandwidth. torch/MKL's GEMV reaches about half of it on small
 *   CPUs (and less for 2 <= M <= 8); here each weight row is streamed once per call.
 * - Batch-invariant mode (--batch-invariant) runs every matmul here: y[m, n] is always reduced the same way
 *   (8 lane partial sums over k in steps of 8, a fixed tree to add them, the K tail in order, then the bias),
 *   whatever M is, where row m sits, and how rows are tiled or split between threads. So a token's outputs
 *   do not depend on what else is in the batch.
 *
 * Tiling: OpenMP splits (chunk of 64 rows of x) x (4 rows of w). Inside, blocks of 3 x-rows by 4 w-rows keep
 * 12 vector accumulators in registers (7 loads per 12 FMAs), x's chunk stays in L2 and the 4 w rows in L1.
 * GCC vector extensions keep it portable (AVX2/AVX-512/NEON via -march=native); FMA contraction applies to
 * every path alike because every path is the same code (the micro-kernel below, instantiated per row count).
 */
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline v8f load8_bf16(const uint16_t *p) {
    uint16_t h[8];
    memcpy(h, p, sizeof h);
    v8f v;
    for (int i = 0; i < 8; i++) {
        uint32_t u = (uint32_t)h[i] << 16;
        memcpy(&v[i], &u, 4);
    }
    return v;
}

static inline float bf16f(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#define MC 64 /* rows of x per chunk */
#define NR 4  /* rows of w per block */

/* MR rows of x (stride K) against NR rows of w: out[m][r] = dot(x_m, w_r) in the fixed order. */
#define DEFINE_MICRO(NAME, MR, T, LOAD8, LOAD1)                                                            \
static inline void NAME(const T *x, const T *const *w, int64_t K, float out[][NR]) {                       \
    const int64_t K8 = K & ~(int64_t)7;                                                                    \
    v8f acc[MR][NR];                                                                                       \
    for (int m = 0; m < MR; m++)                                                                           \
        for (int r = 0; r < NR; r++) acc[m][r] = (v8f){0};                                                 \
    for (int64_t k = 0; k < K8; k += 8) {                                                                  \
        v8f wv[NR];                                                                                        \
        for (int r = 0; r < NR; r++) wv[r] = LOAD8(w[r] + k);                                              \
        for (int m = 0; m < MR; m++) {                                                                     \
            const v8f xv = LOAD8(x + m * K + k);                                                           \
            for (int r = 0; r < NR; r++) acc[m][r] += wv[r] * xv;                                          \
        }                                                                                                  \
    }                                                                                                      \
    for (int m = 0; m < MR; m++)                                                                           \
        for (int r = 0; r < NR; r++) {                                                                     \
            float s = hsum8(acc[m][r]);                                                                    \
            for (int64_t k = K8; k < K; k++) s += LOAD1(w[r][k]) * LOAD1(x[m * K + k]);                    \
            out[m][r] = s;                                                                                 \
        }                                                                                                  \
}

#define IDENT(x) (x)
DEFINE_MICRO(micro3_f32, 3, float, load8, IDENT)
DEFINE_MICRO(micro1_f32, 1, float, load8, IDENT)
DEFINE_MICRO(micro3_bf16, 3, uint16_t, load8_bf16, bf16f)
DEFINE_MICRO(micro1_bf16, 1, uint16_t, load8_bf16, bf16f)

#define DEFINE_LINEAR(NAME, T, MICRO3, MICRO1, STORE, LOAD1)                                               \
void NAME(const T *x, const T *w, const T *bias, T *y, int64_t M, int64_t N, int64_t K, int num_threads) { \
    const int64_t nchunks = (M + MC - 1) / MC, nblocks = (N + NR - 1) / NR;                                \
    _Pragma("omp parallel for collapse(2) schedule(static) num_threads(num_threads)")                      \
    for (int64_t c = 0; c < nchunks; c++) {                                                                \
        for (int64_t b = 0; b < nblocks; b++) {                                                            \
            const int64_t n0 = b * NR, nr = N - n0 < NR ? N - n0 : NR;                                     \
            const T *wr[NR];                                                                               \
            for (int r = 0; r < NR; r++) wr[r] = w + (n0 + (r < nr ? r : 0)) * K; /* pad: repeat row 0 */  \
            const int64_t m_end = (c + 1) * MC < M ? (c + 1) * MC : M;                                     \
            float out[3][NR];                                                                              \
            int64_t m = c * MC;                                                                            \
            for (; m + 3 <= m_end; m += 3) {                                                               \
                MICRO3(x + m * K, wr, K, out);                                                             \
                for (int i = 0; i < 3; i++)                                                                \
                    for (int64_t r = 0; r < nr; r++)                                                       \
                        y[(m + i) * N + n0 + r] = STORE(out[i][r] + (bias ? LOAD1(bias[n0 + r]) : 0.0f));  \
            }                                                                                              \
            for (; m < m_end; m++) {                                                                       \
                MICRO1(x + m * K, wr, K, out);                                                             \
                for (int64_t r = 0; r < nr; r++)                                                           \
                    y[m * N + n0 + r] = STORE(out[0][r] + (bias ? LOAD1(bias[n0 + r]) : 0.0f));            \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_LINEAR(skinny_linear_f32, float, micro3_f32, micro1_f32, IDENT, IDENT)
DEFINE_LINEAR(skinny_linear_bf16, uint16_t, micro3_bf16, micro1_bf16, f2bf16, bf16f)
