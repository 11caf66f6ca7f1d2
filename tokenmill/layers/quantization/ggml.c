/* Matmuls directly on ggml's quantized blocks (the bytes of a GGUF file, as they are): y = x @ W^T.
 *
 * Types (ggml ids): F32, F16, BF16 and Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (32-value blocks), Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, IQ4_XS (256-value super-blocks of eight 32-value sub-blocks). Block layouts are ggml's
 * (ggml-common.h); gguf-py's gguf.quants.dequantize is the reference the tests hold them to.
 *
 * gg_linear, the decode kernel: like llama.cpp, the activations are quantized once per call to int8 with one
 * float scale per 32 values (dx), and each 32-value weight sub-block is decoded in registers to 32 small
 * integers u (unsigned, with a per-type offset, or signed for Q8_0/IQ4) whose dot product with the int8
 * activations is exact in integers: vpdpbusd (AVX-512 VNNI), else vpmaddubsw + vpmaddwd (AVX2), else scalar.
 * A sub-block then contributes
 *     ws * dx * dot(u, xq)  +  sum over its 16-value groups g of  mc_g * (dx * sum_g(xq))
 * where ws is its float scale and mc_g folds the offset and the min (Q4_1/K-quant) terms: the second part
 * only needs the activations' per-16 sums, precomputed with the quantized activations. Types with a scale per
 * 16 values (Q2_K, Q3_K, Q6_K) multiply the two halves' integer dots by their integer scales first.
 *
 * Decode is bound by the weight bytes it reads, so each weight row is read once per call (rows one after the
 * other: short rows read as interleaved streams defeat the hardware prefetcher) and each decoded sub-block is
 * used for up to RMAX rows of x at once (batched decode reuses the weights from registers/L1). OpenMP threads
 * split the output columns into ranges of equal weight bytes. The quantized activations live in a
 * thread-local buffer that grows and is reused: no allocation per call in steady state.
 *
 * gg_dequant_rows: rows of a weight as float32 or bfloat16, bit for bit gguf-py's arithmetic (no FMA
 * contraction): the token embedding's lookups and the weight tiles of the prefill route (ggml.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__F16C__))
#include <immintrin.h>
#endif
#include "../cpu_vec.h"

#define AI static inline __attribute__((always_inline))

enum {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30
};

typedef struct {
    int32_t type;
    int32_t pad;
    int64_t rows;
    int64_t row_stride;
    const uint8_t *w;
} gg_part_t;

#if defined(__AVX512F__)
#define RMAX 8 /* rows of x per pass over a weight row: accumulators fit the 32 vector registers */
#else
#define RMAX 4
#endif

static const int8_t KV_IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * (1.0f / 16777216.0f);
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* values and bytes per (super-)block */
AI int tvalues(const int t) {
    switch (t) {
    case T_F32: case T_F16: case T_BF16: return 1;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 32;
    }
}

AI int tbytes(const int t) {
    switch (t) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_IQ4_NL: return 18;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    case T_IQ4_XS: return 136;
    default: return 0;
    }
}

AI int is_float(const int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
AI int is_signed(const int t) { return t == T_Q8_0 || t == T_IQ4_NL || t == T_IQ4_XS; } /* u holds int8 */
AI int has_sc16(const int t) { return t == T_Q2_K || t == T_Q3_K || t == T_Q6_K; }       /* scale per 16 */

/* integer offset subtracted from u (the dequantized value is a * (u - off) + b) */
AI int toffset(const int t) {
    switch (t) {
    case T_Q4_0: return 8;
    case T_Q5_0: return 16;
    case T_Q3_K: return 4;
    case T_Q6_K: return 32;
    default: return 0;
    }
}

static inline uint32_t le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Q3_K's sixteen 6-bit scales as bytes 0-63 (ggml's kmask shuffle) */
AI void q3k_scale_bytes(const uint8_t *sc12, uint8_t *out) {
    uint32_t aux[4];
    memcpy(aux, sc12, 12);
    const uint32_t tmp = aux[2], k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | ((tmp & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    memcpy(out, aux, 16);
}

/* Q4_K/Q5_K's eight 6-bit scales to bytes 0-7 and mins to bytes 8-15 (llama.cpp's utmp shuffle) */
AI void q4k_scale_bytes(const uint8_t *sc12, uint8_t *out) {
    uint32_t u[4];
    memcpy(u, sc12, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t m03 = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = m03;
    u[0] &= 0x3f3f3f3fu;
    memcpy(out, u, 16);
}

/* Dequantization parameters of a (super-)block: value i of 16-group g is a[g] * (u_i - off) + b[g]. */
typedef struct {
    float a[16], b[16];
} deq_t;

AI void deq_params(const int t, const uint8_t *blk, deq_t *p) {
    switch (t) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL:
        p->a[0] = p->a[1] = f16(blk);
        p->b[0] = p->b[1] = 0.0f;
        break;
    case T_Q4_1: case T_Q5_1:
        p->a[0] = p->a[1] = f16(blk);
        p->b[0] = p->b[1] = f16(blk + 2);
        break;
    case T_Q2_K: {
        const float d = f16(blk + 80), dmin = f16(blk + 82);
        for (int g = 0; g < 16; g++) {
            p->a[g] = d * (float)(blk[g] & 0xF);
            p->b[g] = -(dmin * (float)(blk[g] >> 4));
        }
        break;
    }
    case T_Q3_K: {
        const float d = f16(blk + 108);
        uint8_t sc[16];
        q3k_scale_bytes(blk + 96, sc);
        for (int g = 0; g < 16; g++) {
            p->a[g] = d * (float)((int)sc[g] - 32);
            p->b[g] = 0.0f;
        }
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        const float d = f16(blk), dmin = f16(blk + 2);
        uint8_t sm[16];
        q4k_scale_bytes(blk + 4, sm);
        for (int s = 0; s < 8; s++) {
            p->a[2 * s] = p->a[2 * s + 1] = d * (float)sm[s];
            p->b[2 * s] = p->b[2 * s + 1] = -(dmin * (float)sm[8 + s]);
        }
        break;
    }
    case T_Q6_K: {
        const float d = f16(blk + 208);
        for (int g = 0; g < 16; g++) {
            p->a[g] = d * (float)(int8_t)blk[192 + g];
            p->b[g] = 0.0f;
        }
        break;
    }
    case T_IQ4_XS: {
        const float d = f16(blk);
        const uint32_t sh = (uint32_t)blk[2] | ((uint32_t)blk[3] << 8);
        for (int s = 0; s < 8; s++) {
            const int ls = ((blk[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4);
            p->a[2 * s] = p->a[2 * s + 1] = d * (float)(ls - 32);
            p->b[2 * s] = p->b[2 * s + 1] = 0.0f;
        }
        break;
    }
    default:
        break;
    }
}

/* The 32 integers u of sub-block s (scalar reference decoder; the SIMD one below must agree). */
AI void dec_sub_scalar(const int t, const uint8_t *b, int s, uint8_t *u) {
    switch (t) {
    case T_Q4_0: case T_Q4_1: {
        const uint8_t *qs = b + (t == T_Q4_0 ? 2 : 4);
        for (int i = 0; i < 16; i++) {
            u[i] = qs[i] & 15;
            u[i + 16] = qs[i] >> 4;
        }
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        const int o = t == T_Q5_0 ? 2 : 4;
        const uint32_t qh = le32(b + o);
        const uint8_t *qs = b + o + 4;
        for (int i = 0; i < 16; i++) {
            u[i] = (qs[i] & 15) | (((qh >> i) & 1) << 4);
            u[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        }
        break;
    }
    case T_Q8_0:
        memcpy(u, b + 2, 32);
        break;
    case T_IQ4_NL: case T_IQ4_XS: {
        const uint8_t *qs = t == T_IQ4_NL ? b + 2 : b + 8 + 16 * s;
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)KV_IQ4[qs[i] & 15];
            u[i + 16] = (uint8_t)KV_IQ4[qs[i] >> 4];
        }
        break;
    }
    case T_Q2_K: {
        const uint8_t *q = b + 16 + (s / 4) * 32;
        for (int l = 0; l < 32; l++) u[l] = (q[l] >> (2 * (s % 4))) & 3;
        break;
    }
    case T_Q3_K: {
        const uint8_t *q = b + 32 + (s / 4) * 32;
        for (int l = 0; l < 32; l++) u[l] = ((q[l] >> (2 * (s % 4))) & 3) | (((b[l] >> s) & 1) << 2);
        break;
    }
    case T_Q4_K: {
        const uint8_t *q = b + 16 + (s / 2) * 32;
        for (int l = 0; l < 32; l++) u[l] = (s & 1) ? q[l] >> 4 : q[l] & 15;
        break;
    }
    case T_Q5_K: {
        const uint8_t *q = b + 48 + (s / 2) * 32;
        for (int l = 0; l < 32; l++) u[l] = ((s & 1) ? q[l] >> 4 : q[l] & 15) | (((b[16 + l] >> s) & 1) << 4);
        break;
    }
    case T_Q6_K: {
        const int h = s / 4, sp = s % 4;
        const uint8_t *ql = b + h * 64 + (sp & 1) * 32, *qh = b + 128 + h * 32;
        for (int l = 0; l < 32; l++)
            u[l] = ((sp >> 1) ? ql[l] >> 4 : ql[l] & 15) | (((qh[l] >> (2 * sp)) & 3) << 4);
        break;
    }
    default:
        break;
    }
}

#if defined(__AVX2__)
/* 16 bytes' low nibbles in bytes 0-15, high nibbles in bytes 16-31 (ggml's order) */
AI __m256i nib32(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

/* byte i = 0xFF where bit i of `bits` is set */
AI __m256i bits32(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_movm_epi8(bits);
#else
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    return _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
#endif
}

AI __m256i srl16(__m256i v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }

/* The same 32 integers as dec_sub_scalar, in a register */
AI __m256i dec_sub(const int t, const uint8_t *b, int s) {
    const __m256i m1 = _mm256_set1_epi8(1), m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
    switch (t) {
    case T_Q4_0: return nib32(b + 2);
    case T_Q4_1: return nib32(b + 4);
    case T_Q5_0: case T_Q5_1: {
        const int o = t == T_Q5_0 ? 2 : 4;
        return _mm256_or_si256(nib32(b + o + 4), _mm256_and_si256(bits32(le32(b + o)), _mm256_set1_epi8(16)));
    }
    case T_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case T_IQ4_NL: case T_IQ4_XS: {
        const __m128i kv = _mm_loadu_si128((const __m128i *)KV_IQ4);
        return _mm256_shuffle_epi8(_mm256_set_m128i(kv, kv), nib32(t == T_IQ4_NL ? b + 2 : b + 8 + 16 * s));
    }
    case T_Q2_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + (s / 4) * 32));
        return _mm256_and_si256(srl16(q, 2 * (s % 4)), m3);
    }
    case T_Q3_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + (s / 4) * 32));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(srl16(hm, s), m1), 2);
        return _mm256_or_si256(_mm256_and_si256(srl16(q, 2 * (s % 4)), m3), hi);
    }
    case T_Q4_K: case T_Q5_K: {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (t == T_Q4_K ? 16 : 48) + (s / 2) * 32));
        const __m256i lo = _mm256_and_si256((s & 1) ? _mm256_srli_epi16(q, 4) : q, m15);
        if (t == T_Q4_K) return lo;
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(srl16(qh, s), m1), 4));
    }
    case T_Q6_K: {
        const int h = s / 4, sp = s % 4;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (sp & 1) * 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
        const __m256i lo = _mm256_and_si256((sp >> 1) ? _mm256_srli_epi16(ql, 4) : ql, m15);
        return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(srl16(qh, 2 * sp), m3), 4));
    }
    default: return _mm256_setzero_si256();
    }
}

/* 8 int32 lanes whose sum is dot(u, x): u unsigned bytes (each <= 63 on the AVX2 path, where vpmaddubsw
 * saturates above 2 * 127 * 128), x int8 in [-127, 127] */
AI __m256i dot_u(__m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

/* signed weight bytes: |w| * sign(x, w) (|-128| = 128 read as unsigned; 2 * 128 * 127 does not saturate) */
AI __m256i dot_s(__m256i w, __m256i x) { return dot_u(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

/* two 16-value halves with integer scales: lanes 0-7 of sc16 hold the first half's, 8-15 the second's */
AI __m256i dot_sc16(__m256i u, __m256i x, __m256i sc16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc16);
}

AI float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Quantized activations of M rows, one record per row at base + r * stride: int8 q[K], then float d[K/32] (the
 * 32-block scales dx), s32[K/32] (dx * sum of the block's q) and s16[K/16] (dx * sum of each 16-value half's
 * q). The stride is padded off multiples of 4 KiB: rows 4 KiB apart share L1 sets and evict each other. */
typedef struct {
    const uint8_t *base;
    int64_t stride;
    const float *xf; /* the float activations [M, K] (float weight types) */
    int64_t K;
} act_t;

static inline int64_t act_stride(int64_t K) { return ((K + 16 * (K / 32) + 63) & ~(int64_t)63) + 64; }
AI const int8_t *act_q(const act_t *a, int r) { return (const int8_t *)(a->base + r * a->stride); }
AI const float *act_d(const act_t *a, int r) { return (const float *)(a->base + r * a->stride + a->K); }
AI const float *act_s32(const act_t *a, int r) { return act_d(a, r) + a->K / 32; }
AI const float *act_s16(const act_t *a, int r) { return act_d(a, r) + 2 * (a->K / 32); }

/* Per-sub-block terms of a (super-)block for the integer dot: ws[s] (times dx times the integer dot), the
 * per-16 integer scales sc[g] (Q2_K/Q3_K/Q6_K) and mc[g] (times dx * sum of the 16 activations); 32-scale
 * types fill mc[s] per sub-block instead. */
typedef struct {
    float ws[8], mc[16];
    int16_t sc[16];
} hdr_t;

/* one vector store where the kernel reads the 8 back as a vector (8 scalar stores would not forward to it) */
AI void fill8(float *p, float v) {
#if defined(__AVX2__)
    _mm256_storeu_ps(p, _mm256_set1_ps(v));
#else
    for (int i = 0; i < 8; i++) p[i] = v;
#endif
}

/* n floats out[i] = (float)in[i] * m, from signed (sgn) or unsigned bytes; n = 8 or 16 */
AI void bytes_times(const uint8_t *in, int n, int sgn, float m, float *out) {
#if defined(__AVX2__)
    for (int i = 0; i < n; i += 8) {
        const __m128i v = _mm_loadl_epi64((const __m128i *)(in + i));
        const __m256i w = sgn ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), _mm256_set1_ps(m)));
    }
#else
    for (int i = 0; i < n; i++) out[i] = (float)(sgn ? (int8_t)in[i] : in[i]) * m;
#endif
}

/* Q2_K/Q3_K/Q6_K: one scale d, integer scales per 16 values (sc), and the offset/min terms mc[g] */
AI void hdr_sc16(hdr_t *h, const int8_t *sc, float d, float mc_per_sc, const float *mins) {
    fill8(h->ws, d);
    for (int g = 0; g < 16; g++) h->sc[g] = sc[g];
    if (mins != NULL)
        memcpy(h->mc, mins, 16 * sizeof(float));
    else
        bytes_times((const uint8_t *)sc, 16, 1, mc_per_sc, h->mc);
}

AI void dec_hdr(const int t, const uint8_t *b, hdr_t *h) {
    uint8_t v[16];
    switch (t) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_IQ4_NL:
        h->ws[0] = f16(b);
        h->mc[0] = -(float)toffset(t) * h->ws[0];
        break;
    case T_Q4_1: case T_Q5_1:
        h->ws[0] = f16(b);
        h->mc[0] = f16(b + 2);
        break;
    case T_Q2_K: {
        uint8_t mins[16];
        float mc[16];
        for (int g = 0; g < 16; g++) {
            v[g] = b[g] & 0xF;
            mins[g] = b[g] >> 4;
        }
        bytes_times(mins, 16, 0, -f16(b + 82), mc);
        hdr_sc16(h, (const int8_t *)v, f16(b + 80), 0.0f, mc);
        break;
    }
    case T_Q3_K: case T_Q6_K: {
        const float d = f16(b + (t == T_Q3_K ? 108 : 208));
        if (t == T_Q3_K) {
            q3k_scale_bytes(b + 96, v);
            for (int g = 0; g < 16; g++) v[g] -= 32;
        } else {
            memcpy(v, b + 192, 16);
        }
        hdr_sc16(h, (const int8_t *)v, d, -(float)toffset(t) * d, NULL);
        break;
    }
    case T_Q4_K: case T_Q5_K:
        q4k_scale_bytes(b + 4, v);
        bytes_times(v, 8, 0, f16(b), h->ws);
        bytes_times(v + 8, 8, 0, -f16(b + 2), h->mc);
        break;
    case T_IQ4_XS: {
        deq_t p;
        deq_params(t, b, &p);
        for (int s = 0; s < 8; s++) h->ws[s] = p.a[2 * s];
        break;
    }
    default:
        break;
    }
}

#if defined(__AVX2__)
/* A 256-value step of a weight row: one K-quant super-block, or eight 32-value blocks (a "virtual" super-block,
 * so that all types share one loop and the offset/min terms of 8 blocks take one vector FMA). */
/* eight fp16 values `stride` bytes apart as floats: gathered with integer loads and shifts (scalar ports) and
 * converted at once, instead of a vector insert and conversion per block */
AI __m256 f16x8(const uint8_t *p, int stride) {
    uint64_t lo = 0, hi = 0;
    for (int g = 0; g < 4; g++) {
        uint16_t a, b;
        memcpy(&a, p + g * stride, 2);
        memcpy(&b, p + (g + 4) * stride, 2);
        lo |= (uint64_t)a << (16 * g);
        hi |= (uint64_t)b << (16 * g);
    }
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)hi, (long long)lo));
}

AI void step_hdr(const int t, const uint8_t *w, int64_t sb, hdr_t *h) {
    if (tvalues(t) == 256) {
        dec_hdr(t, w + sb * tbytes(t), h);
        return;
    }
    const uint8_t *b = w + sb * 8 * tbytes(t);
    const __m256 d = f16x8(b, tbytes(t));
    _mm256_storeu_ps(h->ws, d);
    if (t == T_Q4_1 || t == T_Q5_1)
        _mm256_storeu_ps(h->mc, f16x8(b + 2, tbytes(t)));
    else
        _mm256_storeu_ps(h->mc, _mm256_mul_ps(d, _mm256_set1_ps(-(float)toffset(t))));
}

AI __m256i step_sub(const int t, const uint8_t *w, int64_t sb, int s) {
    return tvalues(t) == 256 ? dec_sub(t, w + sb * tbytes(t), s) : dec_sub(t, w + (sb * 8 + s) * tbytes(t), 0);
}

/* The 16 integer scales of a super-block, each twice in a 32-bit lane (scales 0-7, then 8-15), so that one
 * lane permutation gives a sub-block's two int16 scale vectors for vpmaddwd. */
AI void sc16_lanes(const hdr_t *h, __m256i *T) {
    for (int i = 0; i < 2; i++) {
        const __m256i v = _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(h->sc + 8 * i)));
        T[i] = _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
    }
}

AI __m256i dot_any(const int t, __m256i u, __m256i x, const __m256i *T, int s) {
    if (is_signed(t)) return dot_s(u, x);
    if (!has_sc16(t)) return dot_u(u, x);
    const int a = (2 * s) % 8, b = (2 * s + 1) % 8;
    return dot_sc16(u, x, _mm256_permutevar8x32_epi32(T[s / 4], _mm256_setr_epi32(a, a, a, a, b, b, b, b)));
}

/* acc[r] += the integer dot of sub-block s with x rows r < R times its scale, lane s of sc[r] (the weight's
 * sub-block scales times the row's activation scales, one vector product per 8 sub-blocks) */
AI void sub_dot(const int t, const int R, const uint8_t *w, int64_t sb, int s, const __m256i *T, const act_t *a,
                const __m256 *sc, __m256 *acc) {
    const int64_t j = sb * 8 + s;
    const __m256i u = step_sub(t, w, sb, s);
    const __m256i lane = _mm256_set1_epi32(s);
    for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(act_q(a, r) + j * 32));
        const __m256 p = _mm256_cvtepi32_ps(dot_any(t, u, x, T, s));
        /* Q2_K/Q3_K/Q6_K: one float scale d for all sub-blocks (sc[0] holds it in every lane): no per-row
         * scale vectors to hold in registers */
        const __m256 scale = has_sc16(t) ? _mm256_mul_ps(sc[0], _mm256_broadcast_ss(act_d(a, r) + j))
                                         : _mm256_permutevar8x32_ps(sc[r], lane);
        acc[r] = _mm256_fmadd_ps(p, scale, acc[r]);
    }
}

/* res[r] = dot(weight row w, x row r) for R rows of x, a quantized type. Under 4 rows, two accumulators per
 * row (even and odd sub-blocks; the loop is unrolled so that they stay in registers): one FMA chain would wait
 * its 4-cycle latency at every sub-block. */
AI void dot_q(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    const int64_t K = a->K, nsb = K / 256;
    __m256 acc0[RMAX], acc1[RMAX], accm[RMAX]; /* fixed sizes: a [R] array would be a VLA, kept in memory */
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        hdr_t h;
        step_hdr(t, w, sb, &h);
        __m256 sc[RMAX];
        const __m256 ws = _mm256_loadu_ps(h.ws);
        sc[0] = ws;
        if (!has_sc16(t))
            for (int r = 0; r < R; r++) sc[r] = _mm256_mul_ps(ws, _mm256_loadu_ps(act_d(a, r) + sb * 8));
        __m256i T[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (has_sc16(t)) sc16_lanes(&h, T);
        for (int s = 0; s < 8; s += 2) {
            sub_dot(t, R, w, sb, s, T, a, sc, acc0);
            sub_dot(t, R, w, sb, s + 1, T, a, sc, acc1);
        }
        if (is_signed(t)) continue;
        for (int r = 0; r < R; r++) {
            if (has_sc16(t)) {
                const float *s16 = act_s16(a, r) + sb * 16;
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(h.mc), _mm256_loadu_ps(s16), accm[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(h.mc + 8), _mm256_loadu_ps(s16 + 8), accm[r]);
            } else {
                accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(h.mc), _mm256_loadu_ps(act_s32(a, r) + sb * 8), accm[r]);
            }
        }
    }
    float tail[RMAX] = {0};
    for (int64_t j = nsb * 8; j < K / 32; j++) { /* 32-value blocks past the last 256 (K % 256 != 0) */
        hdr_t h;
        dec_hdr(t, w + j * tbytes(t), &h);
        const __m256i u = dec_sub(t, w + j * tbytes(t), 0);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(act_q(a, r) + j * 32));
            const __m256 p = _mm256_cvtepi32_ps(dot_any(t, u, x, NULL, 0)); /* 32-value types only */
            acc0[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(h.ws[0] * act_d(a, r)[j]), acc0[r]);
            if (!is_signed(t)) tail[r] += h.mc[0] * act_s32(a, r)[j];
        }
    }
    for (int r = 0; r < R; r++)
        res[r] = hsum256(_mm256_add_ps(_mm256_add_ps(acc0[r], acc1[r]), accm[r])) + tail[r];
}
#else
AI void dot_q(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    const int V = tvalues(t), B = tbytes(t), NS = V / 32;
    const int64_t K = a->K, nsb = K / V;
    float acc[RMAX] = {0};
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = w + sb * B;
        hdr_t h;
        dec_hdr(t, b, &h);
        for (int s = 0; s < NS; s++) {
            const int64_t j = sb * NS + s;
            uint8_t u[32];
            dec_sub_scalar(t, b, s, u);
            for (int r = 0; r < R; r++) {
                const int8_t *x = act_q(a, r) + j * 32;
                int32_t p0 = 0, p1 = 0;
                for (int i = 0; i < 16; i++) {
                    p0 += (is_signed(t) ? (int8_t)u[i] : u[i]) * x[i];
                    p1 += (is_signed(t) ? (int8_t)u[i + 16] : u[i + 16]) * x[i + 16];
                }
                const int32_t p = has_sc16(t) ? p0 * h.sc[2 * s] + p1 * h.sc[2 * s + 1] : p0 + p1;
                acc[r] += h.ws[s] * act_d(a, r)[j] * (float)p;
                if (is_signed(t)) continue;
                if (has_sc16(t)) {
                    const float *s16 = act_s16(a, r) + 2 * j;
                    acc[r] += h.mc[2 * s] * s16[0] + h.mc[2 * s + 1] * s16[1];
                } else {
                    acc[r] += h.mc[NS == 1 ? 0 : s] * act_s32(a, r)[j];
                }
            }
        }
    }
    for (int r = 0; r < R; r++) res[r] = acc[r];
}
#endif

/* float weight rows times the float activations */
AI v8f load8_w(const int t, const uint8_t *w, int64_t k) {
    if (t == T_F32) return load8((const float *)w + k);
    if (t == T_BF16) return load8_bf16((const uint16_t *)w + k);
#if defined(__F16C__)
    return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + k)));
#else
    v8f v;
    for (int i = 0; i < 8; i++) v[i] = f16(w + 2 * (k + i));
    return v;
#endif
}

AI float load1_w(const int t, const uint8_t *w, int64_t k) {
    if (t == T_F32) return ((const float *)w)[k];
    if (t == T_BF16) return bf16_to_f32(((const uint16_t *)w)[k]);
    return f16(w + 2 * k);
}

/* explicit FMA or none: left to -ffp-contract, GCC fuses a*b+c in some instantiations (row counts) and not
 * others, and a row's result would depend on how many rows share the call */
AI v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c; /* no FMA instruction: nothing to contract into */
#endif
}

AI float fma1(float a, float b, float c) {
#if defined(__FMA__)
    return fmaf(a, b, c);
#else
    return a * b + c;
#endif
}

/* Two accumulators per row (even and odd 8-value steps) at every row count: one FMA chain per row would wait
 * its latency at every 8 values, and the same order for any R keeps a row's result independent of the batch */
AI void dot_f(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    const int64_t K = a->K;
    v8f acc0[RMAX], acc1[RMAX];
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = (v8f){0};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        const v8f w0 = load8_w(t, w, k), w1 = load8_w(t, w, k + 8);
        for (int r = 0; r < R; r++) {
            acc0[r] = fma8(w0, load8(a->xf + r * K + k), acc0[r]);
            acc1[r] = fma8(w1, load8(a->xf + r * K + k + 8), acc1[r]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const v8f wv = load8_w(t, w, k);
        for (int r = 0; r < R; r++) acc0[r] = fma8(wv, load8(a->xf + r * K + k), acc0[r]);
    }
    for (int r = 0; r < R; r++) {
        float s = hsum8(acc0[r] + acc1[r]);
        for (int64_t i = k; i < K; i++) s = fma1(load1_w(t, w, i), a->xf[r * K + i], s);
        res[r] = s;
    }
}

typedef void (*dot_fn)(const uint8_t *w, const act_t *a, float *res);

#define DOT_Q(T, NAME) \
    static void NAME##_1(const uint8_t *w, const act_t *a, float *r) { dot_q(T, 1, w, a, r); } \
    static void NAME##_2(const uint8_t *w, const act_t *a, float *r) { dot_q(T, 2, w, a, r); } \
    static void NAME##_4(const uint8_t *w, const act_t *a, float *r) { dot_q(T, 4, w, a, r); } \
    static void NAME##_8(const uint8_t *w, const act_t *a, float *r) { dot_q(T, RMAX == 8 ? 8 : 1, w, a, r); }
#define DOT_F(T, NAME) \
    static void NAME##_1(const uint8_t *w, const act_t *a, float *r) { dot_f(T, 1, w, a, r); } \
    static void NAME##_2(const uint8_t *w, const act_t *a, float *r) { dot_f(T, 2, w, a, r); } \
    static void NAME##_4(const uint8_t *w, const act_t *a, float *r) { dot_f(T, 4, w, a, r); } \
    static void NAME##_8(const uint8_t *w, const act_t *a, float *r) { dot_f(T, RMAX == 8 ? 8 : 1, w, a, r); }

DOT_F(T_F32, d_f32)
DOT_F(T_F16, d_f16)
DOT_F(T_BF16, d_bf16)
DOT_Q(T_Q4_0, d_q4_0)
DOT_Q(T_Q4_1, d_q4_1)
DOT_Q(T_Q5_0, d_q5_0)
DOT_Q(T_Q5_1, d_q5_1)
DOT_Q(T_Q8_0, d_q8_0)
DOT_Q(T_IQ4_NL, d_iq4_nl)
DOT_Q(T_Q2_K, d_q2_k)
DOT_Q(T_Q3_K, d_q3_k)
DOT_Q(T_Q4_K, d_q4_k)
DOT_Q(T_Q5_K, d_q5_k)
DOT_Q(T_Q6_K, d_q6_k)
DOT_Q(T_IQ4_XS, d_iq4_xs)

#define PICK(NAME) return R >= 8 ? NAME##_8 : R >= 4 ? NAME##_4 : R >= 2 ? NAME##_2 : NAME##_1
/* the kernel for `type` over R rows (R in 1, 2, 4, RMAX) */
static dot_fn pick(int type, int R) {
    switch (type) {
    case T_F32: PICK(d_f32);
    case T_F16: PICK(d_f16);
    case T_BF16: PICK(d_bf16);
    case T_Q4_0: PICK(d_q4_0);
    case T_Q4_1: PICK(d_q4_1);
    case T_Q5_0: PICK(d_q5_0);
    case T_Q5_1: PICK(d_q5_1);
    case T_Q8_0: PICK(d_q8_0);
    case T_IQ4_NL: PICK(d_iq4_nl);
    case T_Q2_K: PICK(d_q2_k);
    case T_Q3_K: PICK(d_q3_k);
    case T_Q4_K: PICK(d_q4_k);
    case T_Q5_K: PICK(d_q5_k);
    case T_Q6_K: PICK(d_q6_k);
    case T_IQ4_XS: PICK(d_iq4_xs);
    default: return NULL;
    }
}

#if defined(__AVX2__)
AI int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

/* One row of x to int8 per 32 values (scale amax/127, round to nearest even), with the scaled sums. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s32, float *s16) {
    for (int64_t j = 0; j < K / 32; j++) {
        const float *xb = x + j * 32;
        int32_t sum[2] = {0, 0};
        float amax = 0.0f;
#if defined(__AVX2__)
        __m256 v[4], m = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            qi[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sum[0] = hsum_i32(_mm256_add_epi32(qi[0], qi[1]));
        sum[1] = hsum_i32(_mm256_add_epi32(qi[2], qi[3]));
        const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        const __m256i p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + j * 32), p8);
#else
        for (int i = 0; i < 32; i++) {
            const float ax = fabsf(xb[i]);
            amax = ax > amax ? ax : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; i++) {
            const int32_t v = (int32_t)nearbyintf(xb[i] * id);
            q[j * 32 + i] = (int8_t)v;
            sum[i / 16] += v;
        }
#endif
        const float dj = amax / 127.0f;
        d[j] = dj;
        s16[2 * j] = dj * (float)sum[0];
        s16[2 * j + 1] = dj * (float)sum[1];
        s32[j] = s16[2 * j] + s16[2 * j + 1];
    }
}

/* the thread-local activation buffer (grown, never shrunk) */
static __thread uint8_t *g_buf;
static __thread size_t g_cap;

static uint8_t *scratch(size_t n) {
    if (n > g_cap) {
        free(g_buf);
        g_cap = (n + 4095) & ~(size_t)4095;
        g_buf = aligned_alloc(64, g_cap);
        if (g_buf == NULL) g_cap = 0;
    }
    return g_buf;
}

/* the first output column whose weight bytes start at or after `target` (columns weighted by their row bytes) */
static int64_t column_at(const gg_part_t *parts, int nparts, int64_t K, double target) {
    int64_t col = 0;
    double before = 0.0;
    for (int p = 0; p < nparts; p++) {
        const double rb = (double)K / tvalues(parts[p].type) * tbytes(parts[p].type);
        const double size = rb * (double)parts[p].rows;
        if (target < before + size) {
            int64_t c = (int64_t)ceil((target - before) / rb);
            return col + (c < parts[p].rows ? c : parts[p].rows);
        }
        before += size;
        col += parts[p].rows;
    }
    return col;
}

static double total_bytes(const gg_part_t *parts, int nparts, int64_t K) {
    double total = 0.0;
    for (int p = 0; p < nparts; p++)
        total += (double)K / tvalues(parts[p].type) * tbytes(parts[p].type) * (double)parts[p].rows;
    return total;
}

/* output columns [n0, n1) for all M rows of activations; pairs: rows 2i and 2i + 1 are the two halves of
 * output row i (gg_linear_precise), summed */
static void run_columns(const gg_part_t *parts, int nparts, int64_t n0, int64_t n1, const act_t *a, int64_t M,
                        int64_t N, const float *bias, float *y, int pairs) {
    const int64_t K = a->K;
    int64_t start = 0;
    for (int p = 0; p < nparts; start += parts[p].rows, p++) {
        const int64_t lo = n0 > start ? n0 : start, hi = n1 < start + parts[p].rows ? n1 : start + parts[p].rows;
        for (int64_t n = lo; n < hi; n++) {
            const uint8_t *w = parts[p].w + (n - start) * parts[p].row_stride;
            const float b = bias ? bias[n] : 0.0f;
            for (int64_t m = 0; m < M;) {
                const int64_t left = M - m;
                const int R = left >= RMAX ? RMAX : left >= 4 ? 4 : left >= 2 ? 2 : 1;
                const act_t am = {a->base ? a->base + m * a->stride : NULL, a->stride, a->xf + m * K, K};
                float res[RMAX];
                pick(parts[p].type, R)(w, &am, res);
                if (pairs) /* M and every R are even here: a pair never straddles two passes */
                    for (int r = 0; r < R; r += 2) y[(m + r) / 2 * N + n] = (res[r] + res[r + 1]) + b;
                else
                    for (int r = 0; r < R; r++) y[(m + r) * N + n] = res[r] + b;
                m += R;
            }
        }
    }
}

/* Row m of x as activation rows 2m and 2m + 1: x quantized, then the residual x - dx * q quantized the same
 * way; xf rows 2m and 2m + 1 are x and zeros (float weight types see x once). */
static void quantize_pair(const float *x, int64_t K, const act_t *a, int64_t m, float *xf) {
    int8_t *q = (int8_t *)act_q(a, 2 * m);
    const float *d = act_d(a, 2 * m);
    quantize_row(x, K, q, (float *)d, (float *)act_s32(a, 2 * m), (float *)act_s16(a, 2 * m));
    float *res = xf + (2 * m + 1) * K;
    for (int64_t k = 0; k < K; k++) res[k] = x[k] - d[k / 32] * (float)q[k];
    quantize_row(res, K, (int8_t *)act_q(a, 2 * m + 1), (float *)act_d(a, 2 * m + 1),
                 (float *)act_s32(a, 2 * m + 1), (float *)act_s16(a, 2 * m + 1));
    memcpy(xf + 2 * m * K, x, (size_t)K * sizeof(float));
    memset(res, 0, (size_t)K * sizeof(float));
}

static void linear(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
                   const float *bias, float *y, int num_threads, int precise) {
    int quantized = 0;
    for (int p = 0; p < nparts; p++) quantized |= !is_float(parts[p].type);
    precise &= quantized;
    const int64_t rows = precise ? 2 * M : M;
    act_t a = {NULL, act_stride(K), x, K};
    if (quantized) {
        const size_t act_bytes = (size_t)(rows * a.stride);
        a.base = scratch(act_bytes + (precise ? (size_t)(rows * K) * sizeof(float) : 0));
        if (a.base == NULL) return;
        if (precise) a.xf = (const float *)(a.base + act_bytes);
    }
    const double total = total_bytes(parts, nparts, K);
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        if (quantized) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                if (precise)
                    quantize_pair(x + m * K, K, &a, m, (float *)a.xf);
                else
                    quantize_row(x + m * K, K, (int8_t *)act_q(&a, m), (float *)act_d(&a, m),
                                 (float *)act_s32(&a, m), (float *)act_s16(&a, m));
            }
        }
        const int T = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t n0 = column_at(parts, nparts, K, total * t / T);
        const int64_t n1 = t == T - 1 ? N : column_at(parts, nparts, K, total * (t + 1) / T);
        run_columns(parts, nparts, n0, n1, &a, rows, N, bias, y, precise);
    }
}

/* The decode kernel: int8 activations per 32 values (bfloat16 models: as fine as their activations). */
void gg_linear(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
               const float *bias, float *y, int num_threads) {
    linear(x, M, parts, nparts, N, K, bias, y, num_threads, 0);
}

/* The same for float32 models, with the activations at about 16-bit precision: x ~ dx * q + dr * qr, qr the
 * int8 quantization of the residual, both run as rows of one pass over the weights (each decoded weight
 * block serves both; the integer dots are exact) and summed. Twice the integer work, the same weight bytes. */
void gg_linear_precise(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
                       const float *bias, float *y, int num_threads) {
    linear(x, M, parts, nparts, N, K, bias, y, num_threads, 1);
}

#if defined(__AVX2__)
/* 8 floats to bfloat16, rounded to nearest even as torch does. The AVX512_BF16 instruction treats subnormal
 * floats as zero, which no dequantized value is (an fp16 scale times a small integer is >= 2^-24 or 0). */
AI void store_bf16(uint16_t *p, __m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    _mm_storeu_si128((__m128i *)p, (__m128i)_mm256_cvtneps_pbh(v));
#else
    store8_bf16(p, (v8f)v);
#endif
}
#endif

/* One row as float32 (out_bf16 = 0) or bfloat16, gguf-py's arithmetic exactly: a * (u - off), then + b
 * where there is a min (the caller is compiled without FMA contraction). */
AI void dequant_row(const int t, const uint8_t *w, int64_t K, void *out, int out_bf16) {
    float *of = out;
    uint16_t *ob = out;
    if (is_float(t)) {
        for (int64_t k = 0; k < K; k++) {
            const float v = load1_w(t, w, k);
            if (out_bf16) ob[k] = f32_to_bf16(v); else of[k] = v;
        }
        return;
    }
    const int V = tvalues(t), B = tbytes(t), NS = V / 32, off = toffset(t);
    for (int64_t sb = 0; sb < K / V; sb++) {
        const uint8_t *b = w + sb * B;
        deq_t p;
        deq_params(t, b, &p);
        for (int s = 0; s < NS; s++) {
            const int g0 = NS == 1 ? 0 : 2 * s;
            const int64_t o = sb * V + s * 32;
#if defined(__AVX2__)
            const __m256i u = dec_sub(t, b, s);
            for (int c = 0; c < 4; c++) { /* 8 values at a time; values 0-15 take group g0, 16-31 g0 + 1 */
                const __m128i half = c < 2 ? _mm256_castsi256_si128(u) : _mm256_extracti128_si256(u, 1);
                const __m128i b8 = (c & 1) ? _mm_srli_si128(half, 8) : half;
                const __m256i q = is_signed(t) ? _mm256_cvtepi8_epi32(b8)
                                               : _mm256_sub_epi32(_mm256_cvtepu8_epi32(b8), _mm256_set1_epi32(off));
                const __m256 prod = _mm256_mul_ps(_mm256_set1_ps(p.a[g0 + c / 2]), _mm256_cvtepi32_ps(q));
                const __m256 v = _mm256_add_ps(prod, _mm256_set1_ps(p.b[g0 + c / 2]));
                if (out_bf16) store_bf16(ob + o + 8 * c, v); else _mm256_storeu_ps(of + o + 8 * c, v);
            }
#else
            uint8_t u[32];
            dec_sub_scalar(t, b, s, u);
            float f[32];
            for (int i = 0; i < 32; i++) {
                const int g = g0 + i / 16, q = is_signed(t) ? (int8_t)u[i] : (int)u[i] - off;
                const float v = p.a[g] * (float)q;
                f[i] = v + p.b[g];
            }
            if (out_bf16) {
                for (int i = 0; i < 32; i += 8) store8_bf16(ob + o + i, load8(f + i));
            } else {
                memcpy(of + o, f, sizeof f);
            }
#endif
        }
    }
}

#define DEQ(T) case T: dequant_row(T, w, K, out, out_bf16); break
__attribute__((optimize("fp-contract=off")))
static void dequant_row_any(int t, const uint8_t *w, int64_t K, void *out, int out_bf16) {
    switch (t) {
    DEQ(T_F32); DEQ(T_F16); DEQ(T_BF16); DEQ(T_Q4_0); DEQ(T_Q4_1); DEQ(T_Q5_0); DEQ(T_Q5_1); DEQ(T_Q8_0);
    DEQ(T_IQ4_NL); DEQ(T_Q2_K); DEQ(T_Q3_K); DEQ(T_Q4_K); DEQ(T_Q5_K); DEQ(T_Q6_K); DEQ(T_IQ4_XS);
    default: break;
    }
}

void gg_dequant_rows(int32_t type, const uint8_t *w, int64_t row_stride, const int64_t *rows, int64_t R, int64_t K,
                     void *out, int32_t out_bf16, int num_threads) {
    const size_t esize = out_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1) if (R * K > 65536)
    for (int64_t r = 0; r < R; r++) {
        const int64_t src = rows ? rows[r] : r;
        dequant_row_any(type, w + src * row_stride, K, (char *)out + (size_t)r * K * esize, out_bf16);
    }
}

/* which integer path this build runs (the kernels report, tests) */
const char *gg_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx-vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}
