/* The small per-layer ops of a decoder layer, each one pass over its rows: residual add + RMSNorm,
 * SiLU-and-multiply, and rotary embedding in place; and the greedy sampler's argmax over the logits.
 *
 * Why: in a decode step these touch a few KB each, yet through torch each costs 5-50 us (a composite of
 * elementwise kernels, each with dispatch and an OpenMP fork) — about a third of a single-stream step on a
 * small model. Here each is one call. Every row is computed on its own in a fixed order, so the results do
 * not depend on the batch (batch-invariant mode needs nothing more). bf16 follows torch's rounding points:
 * each torch op computes in fp32 and rounds its output to bf16, so the same roundings happen here.
 */
#include "cpu_vec.h"

/* bf16 rounding of a float result, kept as float */
static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define PARALLEL_MIN 65536 /* elements: below this an OpenMP fork costs more than it saves */

/* x, residual, res_out, out: [T, H]; with residual != 0: res_out = x + residual, then
 * out = w * norm(res_out); else out = w * norm(x). norm(r) = r / sqrt(mean(r^2) + eps), in fp32.
 * w has type WT; NROUND rounds norm(r) before the product: Llama's RMSNorm rounds it to the model dtype
 * (w bf16), Gemma's multiplies in fp32 by its float32 (1 + w) and rounds once (NROUND = IDENT, WT float). */
#define DEFINE_ADD_RMS_NORM(NAME, T_, WT, LOAD, ROUND, STORE, LOAD8, ROUND8, STORE8, LOADW, LOADW8, NROUND, NROUND8) \
void NAME(const T_ *x, const T_ *residual, T_ *res_out, const WT *w, T_ *out, int64_t T, int64_t H,         \
          float eps, int num_threads) {                                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (T * H >= PARALLEL_MIN)")      \
    for (int64_t t = 0; t < T; t++) {                                                                     \
        const T_ *xr = x + t * H;                                                                         \
        const T_ *ri = residual ? residual + t * H : 0;                                                   \
        T_ *rr = residual ? res_out + t * H : 0;                                                          \
        T_ *o = out + t * H;                                                                              \
        const int64_t H8 = H & ~(int64_t)7;                                                               \
        v8f ssv = {0}; /* lane j sums the squares of elements i = j mod 8, in order */                    \
        for (int64_t i = 0; i < H8; i += 8) {                                                             \
            v8f v = LOAD8(xr + i);                                                                        \
            if (rr) {                                                                                     \
                v = ROUND8(v + LOAD8(ri + i));                                                            \
                STORE8(rr + i, v);                                                                        \
            }                                                                                             \
            ssv += v * v;                                                                                 \
        }                                                                                                 \
        float ss[8];                                                                                      \
        memcpy(ss, &ssv, sizeof ss);                                                                      \
        for (int64_t i = H8; i < H; i++) {                                                                \
            float v = LOAD(xr[i]);                                                                        \
            if (rr) {                                                                                     \
                v = ROUND(v + LOAD(ri[i]));                                                               \
                rr[i] = STORE(v);                                                                         \
            }                                                                                             \
            ss[i & 7] += v * v;                                                                           \
        }                                                                                                 \
        const float ms = (((ss[0] + ss[4]) + (ss[1] + ss[5])) + ((ss[2] + ss[6]) + (ss[3] + ss[7]))) / H;  \
        const float inv = 1.0f / sqrtf(ms + eps);                                                         \
        const T_ *src = rr ? rr : xr;                                                                     \
        int64_t i = 0;                                                                                    \
        for (; i < H8; i += 8) STORE8(o + i, LOADW8(w + i) * NROUND8(LOAD8(src + i) * inv));             \
        for (; i < H; i++) o[i] = STORE(LOADW(w[i]) * NROUND(LOAD(src[i]) * inv));                        \
    }                                                                                                     \
}

/* x: [T, 2I] = [gate | up]; out[T, I] = silu(gate) * up. SILU_VECS vectors per pass: one vector's exp8 (a chain
 * of dependent FMAs) and division are latency-bound, and the out-of-order window overlaps too few of them on its
 * own (Zen 2, bf16, 32 x 4864: 2.1 ns per element -> 1.3 with 4). The same operations per element. */
#define SILU_VECS 4
#define DEFINE_SILU_MUL(NAME, T_, LOAD, ROUND, STORE, LOAD8, ROUND8, STORE8)                              \
void NAME(const T_ *x, T_ *out, int64_t T, int64_t I, int num_threads) {                                  \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (T * I >= PARALLEL_MIN)")      \
    for (int64_t t = 0; t < T; t++) {                                                                     \
        const T_ *g = x + t * 2 * I, *u = g + I;                                                          \
        T_ *o = out + t * I;                                                                              \
        int64_t i = 0;                                                                                    \
        for (; i + 8 * SILU_VECS <= I; i += 8 * SILU_VECS) {                                              \
            v8f sv[SILU_VECS];                                                                            \
            for (int k = 0; k < SILU_VECS; k++) {                                                         \
                const v8f gv = LOAD8(g + i + 8 * k);                                                      \
                sv[k] = gv / (1.0f + exp8((v8f){0} - gv));                                                \
            }                                                                                             \
            for (int k = 0; k < SILU_VECS; k++) STORE8(o + i + 8 * k, ROUND8(sv[k]) * LOAD8(u + i + 8 * k)); \
        }                                                                                                 \
        for (; i + 8 <= I; i += 8) {                                                                      \
            const v8f gv = LOAD8(g + i);                                                                  \
            const v8f sv = gv / (1.0f + exp8((v8f){0} - gv));                                             \
            STORE8(o + i, ROUND8(sv) * LOAD8(u + i));                                                     \
        }                                                                                                 \
        for (; i < I; i++) {                                                                              \
            const float gs = LOAD(g[i]);                                                                  \
            const float sv = gs / (1.0f + exp8((v8f){0} - gs)[0]);                                        \
            o[i] = STORE(ROUND(sv) * LOAD(u[i]));                                                         \
        }                                                                                                 \
    }                                                                                                     \
}

/* In place on x [T, H, D] (row stride x_stride elements, heads D apart): the two halves of each head rotate
 * by the token's angles, cos/sin [max_pos, D/2] (float32) at positions[t]:
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (each product and sum rounded as torch does for bf16). */
#define DEFINE_ROPE(NAME, T_, LOAD, ROUND, STORE)                                                         \
void NAME(T_ *x, int64_t x_stride, const int64_t *positions, const float *cos_t, const float *sin_t,       \
          int64_t T, int64_t H, int64_t D, int num_threads) {                                             \
    const int64_t half = D / 2;                                                                           \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (T * H * D >= PARALLEL_MIN)")  \
    for (int64_t t = 0; t < T; t++) {                                                                     \
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;                   \
        for (int64_t h = 0; h < H; h++) {                                                                 \
            T_ *x1 = x + t * x_stride + h * D, *x2 = x1 + half;                                           \
            for (int64_t i = 0; i < half; i++) {                                                          \
                const float a = LOAD(x1[i]), b = LOAD(x2[i]), ci = ROUND(c[i]), si = ROUND(s[i]);         \
                const float p1 = ROUND(a * ci), p2 = ROUND(b * si), p3 = ROUND(b * ci), p4 = ROUND(a * si); \
                x1[i] = STORE(p1 - p2);                                                                   \
                x2[i] = STORE(p3 + p4);                                                                   \
            }                                                                                             \
        }                                                                                                 \
    }                                                                                                     \
}

#define IDENT(x) (x)
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, float, IDENT, IDENT, IDENT, load8, IDENT, store8, IDENT, load8, IDENT,
                    IDENT)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, uint16_t, bf16_to_f32, rbf, f32_to_bf16, load8_bf16, round8_bf16,
                    store8_bf16, bf16_to_f32, load8_bf16, rbf, round8_bf16)
/* Gemma's norm on bf16 activations: float32 weights, one rounding (the f32 case is add_rms_norm_f32) */
DEFINE_ADD_RMS_NORM(add_rms_norm_w32_bf16, uint16_t, float, bf16_to_f32, rbf, f32_to_bf16, load8_bf16, round8_bf16,
                    store8_bf16, IDENT, load8, IDENT, IDENT)
DEFINE_SILU_MUL(silu_mul_f32, float, IDENT, IDENT, IDENT, load8, IDENT, store8)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_f32, rbf, f32_to_bf16, load8_bf16, round8_bf16, store8_bf16)
DEFINE_ROPE(rope_f32, float, IDENT, IDENT, IDENT)
DEFINE_ROPE(rope_bf16, uint16_t, bf16_to_f32, rbf, f32_to_bf16)

/* out[b] = the index of row b's largest value in x [B, V] (V >= 1), as torch.argmax: the first of equal maxima
 * (-0 equals +0), the first NaN where a row has one. torch's loop is scalar: 3.1 ms for 32 rows of a 152K
 * vocabulary on 2 threads, 1.4% of a batched decode step of a 0.5B model; here two vector passes per row, the
 * maximum (two accumulators: a compare and blend per vector is a latency chain) and then its first index. */
static inline int any8(v8i mask) { /* a lane set */
#if defined(__AVX2__)
    return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#else
    return ((mask[0] | mask[1]) | (mask[2] | mask[3]) | (mask[4] | mask[5]) | (mask[6] | mask[7])) != 0;
#endif
}

void argmax_f32(const float *x, int64_t *out, int64_t B, int64_t V, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (B * V >= PARALLEL_MIN)")
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * V;
        v8f m0 = (v8f){0} - INFINITY, m1 = m0;
        v8i nan = {0};
        int64_t i = 0;
        for (; i + 16 <= V; i += 16) {
            const v8f v0 = load8(r + i), v1 = load8(r + i + 8);
            nan |= (v0 != v0) | (v1 != v1);
            m0 = select8(v0 > m0, v0, m0);
            m1 = select8(v1 > m1, v1, m1);
        }
        float m = -INFINITY;
        int any_nan = 0;
        for (int k = 0; k < 8; k++) {
            m = m0[k] > m ? m0[k] : m;
            m = m1[k] > m ? m1[k] : m;
            any_nan |= nan[k] != 0;
        }
        for (; i < V; i++) {
            m = r[i] > m ? r[i] : m;
            any_nan |= r[i] != r[i];
        }
        int64_t j = 0; /* past the chunks of 8 without it, then to its lane */
        for (; j + 8 <= V; j += 8) {
            const v8f v = load8(r + j);
            if (any8(any_nan ? (v != v) : (v == m))) break;
        }
        while (j < V && !(any_nan ? r[j] != r[j] : r[j] == m)) j++;
        out[b] = j;
    }
}
