/* Paged attention on CPU: each query token attends over its context straight from the paged KV cache.
 *
 * No gather, no padding: a work item is one (query token, KV head) pair; it reads its keys block by block
 * through the block table, so a step reads each request's KV exactly once per KV head. The G query heads
 * that share a KV head are scored together, so GQA costs no extra KV traffic. Two passes per item (scores,
 * then softmax-weighted sum of V) with fp32 accumulation. Compiled once per machine by cpu_kernels.py.
 *
 * Layouts: q/out [Tq, Hq, D] contiguous; k/v cache [Hkv, num_blocks * block_size, D] (head_stride elements
 * apart); block_table int32 [B, bt_stride]; per query token: its request row, and the key range
 * [kv_start, kv_end) it attends (causal end; kv_start > 0 under a sliding window).
 * Quantized caches (fp8/int8 bytes) decode each byte through a 256-entry fp32 table `lut` and carry one scale
 * per KV head for K and for V (kv_quant.py); a head's scale is constant over the context, so it is folded
 * into the query (K) and the output (V) instead of multiplying every element.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define DEFINE_PAGED_ATTENTION(NAME, T, KT, LOAD, STORE, LOADKV)                                           \
void NAME(const T *q, const KT *k_cache, const KT *v_cache, T *out, const int32_t *block_table,             \
          int64_t bt_stride, const int32_t *req_of, const int32_t *kv_start, const int32_t *kv_end,         \
          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                    \
          int64_t head_stride, int64_t block_size, float scale, int num_threads, const float *lut,          \
          const float *k_scale, const float *v_scale) {                                                     \
    (void)lut;                                                                                              \
    const int64_t G = num_heads / num_kv_heads, D = head_dim;                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                   \
    for (int64_t t = 0; t < num_tokens; t++) {                                                              \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                        \
            const int64_t s0 = kv_start[t], s1 = kv_end[t], L = s1 - s0;                                    \
            const int32_t *bt = block_table + (int64_t)req_of[t] * bt_stride;                               \
            const KT *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;                      \
            const float qscale = scale * (k_scale ? k_scale[h] : 1.0f), oscale = v_scale ? v_scale[h] : 1.0f;  \
            float *qf = malloc(sizeof(float) * (size_t)(G * D * 2 + G * (L > 0 ? L : 1)));                  \
            float *acc = qf + G * D, *sc = acc + G * D;                                                     \
            for (int64_t i = 0; i < G * D; i++) {                                                           \
                qf[i] = LOAD(q[(t * num_heads + h * G) * D + i]) * qscale;                                  \
                acc[i] = 0.0f;                                                                              \
            }                                                                                               \
            /* pass 1: scores, block by block */                                                            \
            for (int64_t p = s0; p < s1;) {                                                                 \
                const int64_t off = p % block_size;                                                         \
                int64_t n = block_size - off;                                                               \
                if (n > s1 - p) n = s1 - p;                                                                 \
                const KT *kb = kh + ((int64_t)bt[p / block_size] * block_size + off) * D;                   \
                for (int64_t g = 0; g < G; g++) {                                                           \
                    const float *qg = qf + g * D;                                                           \
                    for (int64_t j = 0; j < n; j++) {                                                       \
                        const KT *kj = kb + j * D;                                                          \
                        float s = 0.0f;                                                                     \
                        _Pragma("omp simd reduction(+:s)")                                                  \
                        for (int64_t d = 0; d < D; d++) s += qg[d] * LOADKV(kj[d]);                         \
                        sc[g * L + (p - s0) + j] = s;                                                       \
                    }                                                                                       \
                }                                                                                           \
                p += n;                                                                                     \
            }                                                                                               \
            /* softmax per query head */                                                                    \
            float inv[G];                                                                                   \
            for (int64_t g = 0; g < G; g++) {                                                               \
                float *s = sc + g * L, mx = -INFINITY, sum = 0.0f;                                          \
                for (int64_t i = 0; i < L; i++) mx = s[i] > mx ? s[i] : mx;                                 \
                for (int64_t i = 0; i < L; i++) { s[i] = expf(s[i] - mx); sum += s[i]; }                    \
                inv[g] = sum > 0.0f ? oscale / sum : 0.0f;                                                  \
            }                                                                                               \
            /* pass 2: weighted sum of values */                                                            \
            for (int64_t p = s0; p < s1;) {                                                                 \
                const int64_t off = p % block_size;                                                         \
                int64_t n = block_size - off;                                                               \
                if (n > s1 - p) n = s1 - p;                                                                 \
                const KT *vb = vh + ((int64_t)bt[p / block_size] * block_size + off) * D;                   \
                for (int64_t j = 0; j < n; j++) {                                                           \
                    const KT *vj = vb + j * D;                                                              \
                    for (int64_t g = 0; g < G; g++) {                                                       \
                        const float w = sc[g * L + (p - s0) + j];                                           \
                        float *ag = acc + g * D;                                                            \
                        _Pragma("omp simd")                                                                 \
                        for (int64_t d = 0; d < D; d++) ag[d] += w * LOADKV(vj[d]);                         \
                    }                                                                                       \
                }                                                                                           \
                p += n;                                                                                     \
            }                                                                                               \
            T *o = out + (t * num_heads + h * G) * D;                                                       \
            for (int64_t g = 0; g < G; g++)                                                                 \
                for (int64_t d = 0; d < D; d++) o[g * D + d] = STORE(acc[g * D + d] * inv[g]);              \
            free(qf);                                                                                       \
        }                                                                                                   \
    }                                                                                                       \
}

#define IDENT(x) (x)
#define BYTE_LUT(x) (lut[(x)])
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, float, IDENT, IDENT, IDENT)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, uint16_t, bf16_to_f32, f32_to_bf16, bf16_to_f32)
DEFINE_PAGED_ATTENTION(paged_attention_f32_kv8, float, uint8_t, IDENT, IDENT, BYTE_LUT)
DEFINE_PAGED_ATTENTION(paged_attention_bf16_kv8, uint16_t, uint8_t, bf16_to_f32, f32_to_bf16, BYTE_LUT)
