/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias), fp32 accumulation, with a fixed reduction order per output.
 *
 * Two kernels (see cpu_linear.py for which runs when):
 * - skinny_linear_*: straight from the row-major weight, for few rows (decode is weight-streaming: every
 *   weight byte is used M times and then never again in the step, so the limit is memory bandwidth; torch's
 *   GEMV reaches about half of it on small CPUs). Each weight row is streamed once per call.
 * - panel_linear_* (below): from a copy packed once into 16-column panels, a register-blocked GEMM for any
 *   row count.
 * Both fix the reduction order of every output element whatever M is, where row m sits, and how rows are
 * tiled or split between threads, so batch-invariant mode (--batch-invariant) runs every matmul through one of
 * them. skinny: 8 lane partial sums over k in steps of 8, a fixed tree to add them, the K tail in order, then
 * the bias.
 *
 * skinny tiling: OpenMP splits (chunk of 64 rows of x) x (4 rows of w). Inside, blocks of 3 x-rows by 4 w-rows
 * keep 12 vector accumulators in registers (7 loads per 12 FMAs), x's chunk stays in L2 and the 4 w rows in L1.
 * GCC vector extensions keep it portable (AVX2/AVX-512/NEON via -march=native); FMA contraction applies to
 * every path alike because every path is the same code (the micro-kernel below, instantiated per row count).
 */
#include <omp.h>

#include "cpu_vec.h"

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
DEFINE_MICRO(micro3_bf16, 3, uint16_t, load8_bf16, bf16_to_f32)
DEFINE_MICRO(micro1_bf16, 1, uint16_t, load8_bf16, bf16_to_f32)

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
DEFINE_LINEAR(skinny_linear_bf16, uint16_t, micro3_bf16, micro1_bf16, f32_to_bf16, bf16_to_f32)

/* ---- Packed panels: the batch-invariant GEMM for any row count ------------------------------------------
 * With --batch-invariant every matmul must reduce each output the same way whatever the row count, so prefill
 * chunks and batched decode cannot use MKL/oneDNN (their blocking depends on the shape). This kernel gets GEMM
 * speed under that rule: the weight is packed once into panels of NP output columns, wp[p][k][0..NP), and a
 * micro-kernel of MR rows x NP columns keeps 2*MR vector accumulators in registers, broadcasting one x value
 * per row and loading NP weights per k (the classic register-blocked GEMM shape). y[m, n] is then always
 * acc = fma(x[m,k], w[n,k], acc) for k = 0..K-1 in order, then + bias: the same sequence of operations for
 * every m, every row count and every tiling, since each remainder kernel (MR = 1..6) is the same code.
 * x and y are float32 (bf16 inputs are widened by the caller); weights are float32 or bfloat16 panels. */
#define NP 16
#define PMR 6   /* rows per micro-kernel */
#define PMC 48  /* rows per thread work item (x's chunk stays in L2) */

/* Keeps the two weight vectors in registers: left alone, GCC folds them into every FMA as memory operands,
 * which costs MR extra loads per k and makes the loop load-bound instead of FMA-bound. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define PIN(a, b) __asm__("" : "+x"(a), "+x"(b))
#else
#define PIN(a, b) ((void)0)
#endif

#define DEFINE_PANEL_MICRO(NAME, MR, WT, LOADW)                                                            \
static inline void NAME(const float *x, int64_t K, const WT *wp, const float *bias, float *y, int64_t N,   \
                        int ncols) {                                                                       \
    v8f a0[MR], a1[MR];                                                                                    \
    for (int m = 0; m < MR; m++) a0[m] = a1[m] = (v8f){0};                                                 \
    for (int64_t k = 0; k < K; k++) {                                                                      \
        v8f w0 = LOADW(wp + k * NP), w1 = LOADW(wp + k * NP + 8);                                          \
        PIN(w0, w1);                                                                                       \
        for (int m = 0; m < MR; m++) {                                                                     \
            const float xs = x[m * K + k]; const v8f xb = {xs, xs, xs, xs, xs, xs, xs, xs};                                                        \
            a0[m] += xb * w0;                                                                              \
            a1[m] += xb * w1;                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    for (int m = 0; m < MR; m++) {                                                                         \
        float out[NP];                                                                                     \
        memcpy(out, &a0[m], sizeof a0[m]);                                                                 \
        memcpy(out + 8, &a1[m], sizeof a1[m]);                                                             \
        for (int c = 0; c < ncols; c++) y[m * N + c] = out[c] + (bias ? bias[c] : 0.0f);                   \
    }                                                                                                      \
}

/* One or two rows against PW panels at once: a single panel gives only 2*MR independent FMA chains, too few to
 * hide the FMA latency when the weights stream from memory (decode). Each output's sequence of operations is
 * the one above, so results are identical to it. */
#define DEFINE_PANEL_WIDE(NAME, MR, PW, WT, LOADW)                                                         \
static inline void NAME(const float *x, int64_t K, const WT *wp, const float *bias, float *y, int64_t N) { \
    v8f a[MR][2 * PW];                                                                                     \
    for (int m = 0; m < MR; m++)                                                                           \
        for (int j = 0; j < 2 * PW; j++) a[m][j] = (v8f){0};                                               \
    for (int64_t k = 0; k < K; k++) {                                                                      \
        v8f xb[MR];                                                                                        \
        for (int m = 0; m < MR; m++) {                                                                     \
            const float xs = x[m * K + k];                                                                 \
            xb[m] = (v8f){xs, xs, xs, xs, xs, xs, xs, xs};                                                 \
        }                                                                                                  \
        for (int j = 0; j < 2 * PW; j++) {                                                                 \
            const v8f w = LOADW(wp + (j >> 1) * K * NP + k * NP + (j & 1) * 8);                            \
            for (int m = 0; m < MR; m++) a[m][j] += xb[m] * w;                                             \
        }                                                                                                  \
    }                                                                                                      \
    for (int m = 0; m < MR; m++)                                                                           \
        for (int j = 0; j < 2 * PW; j++) {                                                                 \
            float out[8];                                                                                  \
            memcpy(out, &a[m][j], sizeof out);                                                             \
            for (int c = 0; c < 8; c++) y[m * N + j * 8 + c] = out[c] + (bias ? bias[j * 8 + c] : 0.0f);   \
        }                                                                                                  \
}

/* M <= 2 rows: each thread takes a contiguous run of panels, PW at a time; the last, partial panel (N not a
 * multiple of NP) goes through the plain micro-kernel, which stores only its valid columns. */
#define DEFINE_PANEL_FEW(NAME, WT)                                                                         \
static void NAME##_few(const float *x, const WT *wp, const float *bias, float *y, int64_t M, int64_t N,    \
                       int64_t K, int num_threads) {                                                       \
    const int64_t full = N / NP, npanels = (N + NP - 1) / NP;                                              \
    _Pragma("omp parallel num_threads(num_threads)")                                                       \
    {                                                                                                      \
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();                                \
        const int64_t p0 = full * t / nt, p1 = full * (t + 1) / nt;                                        \
        int64_t p = p0;                                                                                    \
        for (; p + 4 <= p1; p += 4) {                                                                      \
            if (M == 1) NAME##_w1x4(x, K, wp + p * K * NP, bias ? bias + p * NP : 0, y + p * NP, N);       \
            else NAME##_w2x2(x, K, wp + p * K * NP, bias ? bias + p * NP : 0, y + p * NP, N),              \
                 NAME##_w2x2(x, K, wp + (p + 2) * K * NP, bias ? bias + (p + 2) * NP : 0, y + (p + 2) * NP, N); \
        }                                                                                                  \
        for (; p < p1; p++) {                                                                              \
            if (M == 1) NAME##_m1(x, K, wp + p * K * NP, bias ? bias + p * NP : 0, y + p * NP, N, NP);     \
            else NAME##_m2(x, K, wp + p * K * NP, bias ? bias + p * NP : 0, y + p * NP, N, NP);            \
        }                                                                                                  \
        if (t == nt - 1 && npanels > full) {                                                               \
            const int nc = (int)(N - full * NP);                                                           \
            if (M == 1) NAME##_m1(x, K, wp + full * K * NP, bias ? bias + full * NP : 0, y + full * NP, N, nc); \
            else NAME##_m2(x, K, wp + full * K * NP, bias ? bias + full * NP : 0, y + full * NP, N, nc);   \
        }                                                                                                  \
    }                                                                                                      \
}

#define DEFINE_PANEL_LINEAR(NAME, WT, LOADW)                                                               \
DEFINE_PANEL_MICRO(NAME##_m6, 6, WT, LOADW)                                                                \
DEFINE_PANEL_MICRO(NAME##_m5, 5, WT, LOADW)                                                                \
DEFINE_PANEL_MICRO(NAME##_m4, 4, WT, LOADW)                                                                \
DEFINE_PANEL_MICRO(NAME##_m3, 3, WT, LOADW)                                                                \
DEFINE_PANEL_MICRO(NAME##_m2, 2, WT, LOADW)                                                                \
DEFINE_PANEL_MICRO(NAME##_m1, 1, WT, LOADW)                                                                \
DEFINE_PANEL_WIDE(NAME##_w1x4, 1, 4, WT, LOADW)                                                            \
DEFINE_PANEL_WIDE(NAME##_w2x2, 2, 2, WT, LOADW)                                                            \
DEFINE_PANEL_FEW(NAME, WT)                                                                                 \
void NAME(const float *x, const WT *wp, const float *bias, float *y, int64_t M, int64_t N, int64_t K,       \
          int num_threads) {                                                                               \
    if (M <= 2) {                                                                                          \
        NAME##_few(x, wp, bias, y, M, N, K, num_threads);                                                  \
        return;                                                                                            \
    }                                                                                                      \
    const int64_t nchunks = (M + PMC - 1) / PMC, npanels = (N + NP - 1) / NP;                              \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                  \
    for (int64_t p = 0; p < npanels; p++) {                                                                \
        for (int64_t c = 0; c < nchunks; c++) {                                                            \
            const int64_t n0 = p * NP, m_end = (c + 1) * PMC < M ? (c + 1) * PMC : M;                      \
            const int nc = N - n0 < NP ? (int)(N - n0) : NP;                                               \
            const WT *w = wp + p * K * NP;                                                                 \
            const float *b = bias ? bias + n0 : 0;                                                         \
            int64_t m = c * PMC;                                                                           \
            for (; m + PMR <= m_end; m += PMR) NAME##_m6(x + m * K, K, w, b, y + m * N + n0, N, nc);       \
            switch (m_end - m) {                                                                           \
            case 5: NAME##_m5(x + m * K, K, w, b, y + m * N + n0, N, nc); break;                           \
            case 4: NAME##_m4(x + m * K, K, w, b, y + m * N + n0, N, nc); break;                           \
            case 3: NAME##_m3(x + m * K, K, w, b, y + m * N + n0, N, nc); break;                           \
            case 2: NAME##_m2(x + m * K, K, w, b, y + m * N + n0, N, nc); break;                           \
            case 1: NAME##_m1(x + m * K, K, w, b, y + m * N + n0, N, nc); break;                           \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_PANEL_LINEAR(panel_linear_f32, float, load8)
DEFINE_PANEL_LINEAR(panel_linear_bf16, uint16_t, load8_bf16)
