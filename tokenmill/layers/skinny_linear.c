/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias) for few rows M (decode steps), float32.
 *
 * Decode-sized matmuls are weight-streaming: every weight byte is used M times and then never again in the
 * step, so the speed limit is memory bandwidth. torch/MKL's GEMV reaches about half of it on small CPUs (and
 * less for 2 <= M <= 8); this kernel streams each weight row exactly once per call: OpenMP splits the
 * output features N, a thread takes 4 weight rows at a time and computes their dot products with every row
 * of x while the rows sit in L1 (4 independent FMA chains per x row for ILP). GCC vector extensions keep it
 * portable (AVX2/AVX-512/NEON via -march=native).
 */
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

void skinny_linear_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int num_threads) {
    const int64_t K8 = K & ~(int64_t)7;
    const int64_t nblocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * 4;
        const int64_t nr = N - n0 < 4 ? N - n0 : 4;
        const float *w0 = w + n0 * K;
        const float *w1 = w0 + (nr > 1 ? K : 0), *w2 = w0 + (nr > 2 ? 2 * K : 0), *w3 = w0 + (nr > 3 ? 3 * K : 0);
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t k = 0; k < K8; k += 8) {
                const v8f xv = load8(xm + k);
                a0 += load8(w0 + k) * xv;
                a1 += load8(w1 + k) * xv;
                a2 += load8(w2 + k) * xv;
                a3 += load8(w3 + k) * xv;
            }
            float s[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};
            for (int64_t k = K8; k < K; k++) {
                s[0] += w0[k] * xm[k];
                s[1] += w1[k] * xm[k];
                s[2] += w2[k] * xm[k];
                s[3] += w3[k] * xm[k];
            }
            for (int64_t r = 0; r < nr; r++) y[m * N + n0 + r] = s[r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
}
