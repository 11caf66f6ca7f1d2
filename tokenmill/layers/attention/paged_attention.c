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
 * Attention sinks (gpt-oss): an optional learned logit per query head (`sinks` [Hq], NULL without) that joins
 * each softmax's denominator with no value, so a head can give weight to "nothing".
 */
#include <stdlib.h>

#include "../cpu_vec.h"

/* The keys from position p to the end of p's cache block, or to s1: their count, and the slot of the first. */
static inline int64_t key_run(const int32_t *bt, int64_t p, int64_t s1, int64_t block_size, int64_t *slot) {
    const int64_t off = p % block_size, n = block_size - off;
    *slot = (int64_t)bt[p / block_size] * block_size + off;
    return n < s1 - p ? n : s1 - p;
}

/* softmax numerators in place over s[0..L) (minus the max), returning their sum; fixed order for a given L */
static inline float exp_sum(float *s, int64_t L, float mx) {
    v8f vs = (v8f){0};
    int64_t i = 0;
    for (; i + 8 <= L; i += 8) {
        v8f v;
        memcpy(&v, s + i, sizeof v);
        v = exp8(v - mx);
        memcpy(s + i, &v, sizeof v);
        vs += v;
    }
    float sum = ((vs[0] + vs[4]) + (vs[1] + vs[5])) + ((vs[2] + vs[6]) + (vs[3] + vs[7]));
    for (; i < L; i++) {
        v8f v = (v8f){0} + (s[i] - mx);
        s[i] = exp8(v)[0];
        sum += s[i];
    }
    return sum;
}

/* One query head's softmax over its scores s[0..L): the numerators in place, and oscale / their sum returned;
 * a sink logit (sink != NULL) joins the max and the sum but has no value to weight. */
static inline float softmax_inv(float *s, int64_t L, const float *sink, float oscale) {
    float mx = sink ? *sink : -INFINITY;
    v8f mv = (v8f){0} + mx; /* 8 lanes, then the lanes: a max is the same in any order (NaN scores skipped) */
    int64_t i = 0;
    for (; i + 8 <= L; i += 8) {
        const v8f v = load8(s + i);
        mv = select8(v > mv, v, mv);
    }
    for (int k = 0; k < 8; k++) mx = mv[k] > mx ? mv[k] : mx;
    for (; i < L; i++) mx = s[i] > mx ? s[i] : mx;
    float sum = exp_sum(s, L, mx);
    if (sink) sum += expf(*sink - mx);
    return sum > 0.0f ? oscale / sum : 0.0f;
}

/* The weighted sum of values for GN query heads from g0 (in DEFINE_ITEM): 16 columns at a time, each value
 * vector loaded (and widened) once for the GN heads; each output sums its keys in order. */
#define VALUES_OF_HEADS(GN, KT, DD, LD8)                                                                   \
    for (int c0 = 0; c0 < DD / 8; c0 += 2) {                                                                \
        v8f a[GN][2];                                                                                       \
        for (int g = 0; g < GN; g++) a[g][0] = a[g][1] = (v8f){0};                                          \
        for (int64_t p = s0, n, slot; p < s1; p += n) {                                                     \
            n = key_run(bt, p, s1, block_size, &slot);                                                      \
            const KT *vb = vh + slot * DD + 8 * c0;                                                         \
            const float *w = sc + g0 * L + (p - s0);                                                        \
            for (int64_t j = 0; j < n; j++) {                                                               \
                const v8f v0 = LD8(vb + j * DD), v1 = LD8(vb + j * DD + 8);                                 \
                for (int g = 0; g < GN; g++) {                                                              \
                    const float wj = w[g * L + j];                                                          \
                    a[g][0] += wj * v0;                                                                     \
                    a[g][1] += wj * v1;                                                                     \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
        for (int g = 0; g < GN; g++) {                                                                      \
            memcpy(acc + (g0 + g) * DD + 8 * c0, &a[g][0], sizeof a[g][0]);                                 \
            memcpy(acc + (g0 + g) * DD + 8 * c0 + 8, &a[g][1], sizeof a[g][1]);                             \
        }                                                                                                   \
    }

/* One (query token, KV head) item with the head size D known at compile time (64 and 128 cover most
 * models): each key is loaded once into registers and scored against the G query heads (eight keys' scores
 * finished together per head); values are summed
 * block by block (16 keys) with one query head's accumulators held in registers, or (WIDEN: bf16 caches,
 * where widening each value costs more than the FMA) 4 heads x 16 columns at a time, so each value is widened
 * once per 4 heads instead of once per head (same order of additions). qf is the scaled query
 * [G, D], sc the scores [G, L]; acc receives the unnormalised output [G, D]. */
#define DEFINE_ITEM(NAME, KT, DD, LD8, WIDEN)                                                              \
static void NAME(const float *qf, const KT *kh, const KT *vh, const int32_t *bt, int64_t s0, int64_t s1,     \
                 int64_t block_size, int64_t G, float *sc, float *acc, float oscale, float *inv,             \
                 const float *sk) {                                                                          \
    const int64_t L = s1 - s0;                                                                              \
    v8f part[G][8]; /* eight keys' per-head partial sums, reduced together (hsum8x8: hsum8's bits) */        \
    for (int64_t p = s0, n, slot; p < s1; p += n) {                                                         \
        n = key_run(bt, p, s1, block_size, &slot);                                                          \
        const KT *kb = kh + slot * DD;                                                                      \
        for (int64_t j = 0; j < n; j += 8) {                                                                \
            const int m = n - j < 8 ? (int)(n - j) : 8;                                                     \
            for (int k = 0; k < m; k++) {                                                                   \
                v8f kv[DD / 8];                                                                             \
                for (int c = 0; c < DD / 8; c++) kv[c] = LD8(kb + (j + k) * DD + 8 * c);                    \
                for (int64_t g = 0; g < G; g++) {                                                           \
                    v8f a = (v8f){0};                                                                       \
                    for (int c = 0; c < DD / 8; c++) a += load8(qf + g * DD + 8 * c) * kv[c];             \
                    part[g][k] = a;                                                                         \
                }                                                                                           \
            }                                                                                               \
            for (int64_t g = 0; g < G; g++) {                                                               \
                float *s = sc + g * L + (p - s0) + j;                                                       \
                if (m == 8) store8(s, hsum8x8(part[g]));                                                    \
                else for (int k = 0; k < m; k++) s[k] = hsum8(part[g][k]);                                  \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    for (int64_t g = 0; g < G; g++) inv[g] = softmax_inv(sc + g * L, L, sk ? sk + g : 0, oscale);           \
    if (WIDEN) {                                                                                            \
    /* values: up to 4 query heads x 16 columns of accumulators at a time, so each value vector is loaded  \
     * (and widened) once per 4 heads rather than once per head; each output still sums keys in order */    \
    for (int64_t g0 = 0; g0 < G; g0 += 4)                                                                  \
        switch (G - g0) { /* the head count a compile-time constant, so the accumulators stay in registers */ \
        case 1: VALUES_OF_HEADS(1, KT, DD, LD8); break;                                                     \
        case 2: VALUES_OF_HEADS(2, KT, DD, LD8); break;                                                     \
        case 3: VALUES_OF_HEADS(3, KT, DD, LD8); break;                                                     \
        default: VALUES_OF_HEADS(4, KT, DD, LD8);                                                           \
        }                                                                                                   \
    } else {                                                                                                \
    for (int64_t g = 0; g < G; g++) {                                                                       \
        v8f a[DD / 8];                                                                                      \
        for (int c = 0; c < DD / 8; c++) a[c] = (v8f){0};                                                   \
        for (int64_t p = s0, n, slot; p < s1; p += n) {                                                     \
            n = key_run(bt, p, s1, block_size, &slot);                                                      \
            const KT *vb = vh + slot * DD;                                                                  \
            const float *w = sc + g * L + (p - s0);                                                         \
            for (int64_t j = 0; j < n; j++)                                                                 \
                for (int c = 0; c < DD / 8; c++) a[c] += w[j] * LD8(vb + j * DD + 8 * c);                   \
        }                                                                                                   \
        for (int c = 0; c < DD / 8; c++) memcpy(acc + g * DD + 8 * c, &a[c], sizeof a[c]);                  \
    }                                                                                                       \
    }                                                                                                       \
}

DEFINE_ITEM(item_f32_d64, float, 64, load8, 0)
DEFINE_ITEM(item_f32_d128, float, 128, load8, 0)
DEFINE_ITEM(item_bf16_d64, uint16_t, 64, load8_bf16, 1)
DEFINE_ITEM(item_bf16_d128, uint16_t, 128, load8_bf16, 1)
/* no specialised item for this (KV type, D): the generic loops below */
#define item_none_d64 0
#define item_none_d128 0

#define DEFINE_PAGED_ATTENTION(NAME, T, KT, LOAD, STORE, LOADKV, ITEM)                                           \
void NAME(const T *q, const KT *k_cache, const KT *v_cache, T *out, const int32_t *block_table,             \
          int64_t bt_stride, const int32_t *req_of, const int32_t *kv_start, const int32_t *kv_end,         \
          int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,                    \
          int64_t head_stride, int64_t block_size, float scale, int num_threads, const float *lut,          \
          const float *k_scale, const float *v_scale, const float *sinks) {                                 \
    (void)lut;                                                                                              \
    const int64_t G = num_heads / num_kv_heads, D = head_dim;                                               \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                   \
    for (int64_t t = 0; t < num_tokens; t++) {                                                              \
        for (int64_t h = 0; h < num_kv_heads; h++) {                                                        \
            const int64_t s0 = kv_start[t], s1 = kv_end[t], L = s1 - s0;                                    \
            const int32_t *bt = block_table + (int64_t)req_of[t] * bt_stride;                               \
            const KT *kh = k_cache + h * head_stride, *vh = v_cache + h * head_stride;                      \
            const float qscale = scale * (k_scale ? k_scale[h] : 1.0f), oscale = v_scale ? v_scale[h] : 1.0f;  \
            const float *sk = sinks ? sinks + h * G : 0; /* this KV head's G query heads' sinks */             \
            float *qf = malloc(sizeof(float) * (size_t)(G * D * 2 + G * (L > 0 ? L : 1)));                  \
            float *acc = qf + G * D, *sc = acc + G * D;                                                     \
            for (int64_t i = 0; i < G * D; i++) {                                                           \
                qf[i] = LOAD(q[(t * num_heads + h * G) * D + i]) * qscale;                                  \
                acc[i] = 0.0f;                                                                              \
            }                                                                                               \
            float inv[G];                                                                                   \
            void (*item)(const float *, const KT *, const KT *, const int32_t *, int64_t, int64_t, int64_t,     \
                         int64_t, float *, float *, float, float *, const float *) =                        \
                D == 64 ? ITEM##_d64 : D == 128 ? ITEM##_d128 : 0;                                          \
            if (item) {                                                                                     \
                item(qf, kh, vh, bt, s0, s1, block_size, G, sc, acc, oscale, inv, sk);                      \
                goto store;                                                                                 \
            }                                                                                               \
            /* pass 1: scores, block by block */                                                            \
            for (int64_t p = s0, n, slot; p < s1; p += n) {                                                 \
                n = key_run(bt, p, s1, block_size, &slot);                                                  \
                const KT *kb = kh + slot * D;                                                               \
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
            }                                                                                               \
            /* softmax per query head */                                                                    \
            for (int64_t g = 0; g < G; g++) inv[g] = softmax_inv(sc + g * L, L, sk ? sk + g : 0, oscale);   \
            /* pass 2: weighted sum of values */                                                            \
            for (int64_t p = s0, n, slot; p < s1; p += n) {                                                 \
                n = key_run(bt, p, s1, block_size, &slot);                                                  \
                const KT *vb = vh + slot * D;                                                               \
                for (int64_t j = 0; j < n; j++) {                                                           \
                    const KT *vj = vb + j * D;                                                              \
                    for (int64_t g = 0; g < G; g++) {                                                       \
                        const float w = sc[g * L + (p - s0) + j];                                           \
                        float *ag = acc + g * D;                                                            \
                        _Pragma("omp simd")                                                                 \
                        for (int64_t d = 0; d < D; d++) ag[d] += w * LOADKV(vj[d]);                         \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        store:;                                                                                             \
            T *o = out + (t * num_heads + h * G) * D;                                                       \
            for (int64_t g = 0; g < G; g++)                                                                 \
                for (int64_t d = 0; d < D; d++) o[g * D + d] = STORE(acc[g * D + d] * inv[g]);              \
            free(qf);                                                                                       \
        }                                                                                                   \
    }                                                                                                       \
}

#define IDENT(x) (x)
#define BYTE_LUT(x) (lut[(x)])
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, float, IDENT, IDENT, IDENT, item_f32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, uint16_t, bf16_to_f32, f32_to_bf16, bf16_to_f32, item_bf16)
DEFINE_PAGED_ATTENTION(paged_attention_f32_kv8, float, uint8_t, IDENT, IDENT, BYTE_LUT, item_none)
DEFINE_PAGED_ATTENTION(paged_attention_bf16_kv8, uint16_t, uint8_t, bf16_to_f32, f32_to_bf16, BYTE_LUT, item_none)

/* Store a step's new keys and values into their cache slots: k/v rows [T, Hkv, D] (rows row_bytes apart,
 * heads dense), cache [2, Hkv, num_slots, D]; one copy of head_bytes per (token, head, K|V). Two torch
 * index_copy_ calls per layer cost ~30 us at decode sizes; this is one call and a few memcpy. */
int write_kv(const char *k, int64_t k_row_bytes, const char *v, int64_t v_row_bytes, char *cache, int64_t T,
             int64_t num_kv_heads, int64_t head_bytes, int64_t cache_head_bytes, const int64_t *slots) {
    char *v_cache = cache + num_kv_heads * cache_head_bytes;
    const int64_t num_slots = cache_head_bytes / head_bytes;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1; /* nothing written */
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = h * cache_head_bytes + slots[t] * head_bytes;
            memcpy(cache + dst, k + t * k_row_bytes + h * head_bytes, (size_t)head_bytes);
            memcpy(v_cache + dst, v + t * v_row_bytes + h * head_bytes, (size_t)head_bytes);
        }
    return 0;
}
