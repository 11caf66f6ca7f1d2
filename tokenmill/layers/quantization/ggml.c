/* Matmuls directly on ggml's quantized blocks (the bytes of a GGUF file, as they are): y = x @ W^T.
 *
 * Types (ggml ids): F32, F16, BF16 and Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (32-value blocks), Q2_K, Q3_K,
 * Q4_K, Q5_K, Q6_K, IQ4_XS (256-value super-blocks of eight 32-value sub-blocks). Block layouts are ggml's
 * (ggml-common.h); gguf-py's gguf.quants.dequantize is the reference the tests hold them to.
 *
 * gg_linear, the decode kernel: like llama.cpp, the activations are quantized once per call to int8, and each
 * 32-value weight sub-block is decoded in registers to 32 small integers u (unsigned, with a per-type offset, or
 * signed for Q8_0/IQ4) whose dot product with the int8 activations is exact in integers.
 * - 32-value block types (Q4_0 ... Q8_0, IQ4_NL): activations with one float scale per 32 values (dx); a block
 *   contributes  ws * dx * dot(u, xq) + mc * (dx * sum(xq)),  ws its scale and mc its offset or min term
 *   (vpdpbusd on AVX-512 VNNI, else vpmaddubsw + vpmaddwd on AVX2, else scalar).
 * - K-quants (256-value super-blocks): activations with one scale per 256 values and integer sums per 16 (the
 *   "super-block form", as llama.cpp's Q8_K), so that a super-block's sub-block dots (vpmaddubsw) meet their
 *   integer scales (vpdpwssd / vpmaddwd) and its offset/min terms in int32, and meet a float once per super-block:
 *   about half the instructions per byte of a float step per sub-block.
 *
 * Decode is bound by the weight bytes it reads, so each weight row is read once per call (rows one after the
 * other: short rows read as interleaved streams defeat the hardware prefetcher) and each decoded sub-block is
 * used for up to RMAX rows of x at once (batched decode reuses the weights from registers; a tile of NTILE
 * weight rows stays in L1/L2 while further chunks of RMAX rows pass over it). OpenMP threads split the output
 * columns into ranges of equal weight bytes (4 per thread, taken as threads come free). The quantized
 * activations live in a thread-local buffer that grows and is reused: no allocation per call in steady state.
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
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30,
    /* ours, not ggml's: rows repacked eight at a time (gg_repack_x8), 1000 + the type they hold */
    T_Q4_0X8 = 1002, T_Q4_1X8 = 1003, T_Q5_0X8 = 1006, T_Q5_1X8 = 1007, T_Q8_0X8 = 1008,
    T_Q2_KX8 = 1010, T_Q3_KX8 = 1011, T_Q4_KX8 = 1012, T_Q5_KX8 = 1013, T_Q6_KX8 = 1014, T_IQ4_XSX8 = 1023,
    T_KX8D = 2014 /* a Q6_K or Q3_K x8 tile decoded for the kernel in a thread's buffer (run_columns), never a part */
};

typedef struct {
    int32_t type;
    int32_t pad;
    int64_t rows;
    int64_t row_stride;
    const uint8_t *w;
} gg_part_t;

#define RMAX 8 /* the most rows of x per pass over a weight row */
#if defined(__AVX512F__)
#define RMAX_WIDE 8
#else /* the x8 and float kernels keep two or three accumulators per row: at 8 rows they spill AVX2's 16
       * registers (F16 0.7x at 32 rows), where the per-row quantized kernels gain (Q6_K 1.23x, Q3_K 1.18x) */
#define RMAX_WIDE 4
#endif
/* rows of x per pass of an x8 kernel: Q4_K x8 takes RMAX everywhere, its per-row state outside the chunk loop
 * spilling only once per sub-block (on an AVX2-only EPYC 8 rows ran 1.17x at 8 and 32 rows of x, 1.13x at 512),
 * and Q8_0 x8, one int32 chain per row without VNNI (1.07x at 8 rows of x, 1.04x at 32; with two chains 8 rows
 * spilled: 0.75x); Q5_K x8 as Q4_K (1.14x at 8 rows of x, 1.17x at 32); Q4_0 x8 1.02x, so it keeps RMAX_WIDE with
 * the others */
#define X8_RMAX(T) ((T) == T_Q4_KX8 || (T) == T_Q5_KX8 || (T) == T_Q8_0X8 ? RMAX : RMAX_WIDE)

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
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: case T_Q4_KX8: case T_Q6_KX8:
    case T_Q5_KX8: case T_IQ4_XSX8: case T_Q2_KX8: case T_Q3_KX8: return 256;
    default: return 32;
    }
}

AI int tbytes(const int t) {
    switch (t) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: case T_Q4_0X8: return 18;
    case T_Q4_1: case T_Q4_1X8: return 20;
    case T_Q5_0: case T_Q5_0X8: return 22;
    case T_Q5_1: case T_Q5_1X8: return 24;
    case T_Q8_0: case T_Q8_0X8: return 34;
    case T_IQ4_NL: return 18;
    case T_Q2_K: case T_Q2_KX8: return 84;
    case T_Q3_K: case T_Q3_KX8: return 110;
    case T_Q4_K: case T_Q4_KX8: return 144;
    case T_Q5_K: case T_Q5_KX8: return 176;
    case T_Q6_K: case T_Q6_KX8: return 210;
    case T_IQ4_XS: case T_IQ4_XSX8: return 136;
    default: return 0;
    }
}

AI int is_float(const int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
AI int is_x8(const int t) {
    return t == T_Q4_0X8 || t == T_Q4_1X8 || t == T_Q5_0X8 || t == T_Q5_1X8 || t == T_Q8_0X8 || t == T_Q4_KX8 ||
           t == T_Q5_KX8 || t == T_Q6_KX8 || t == T_IQ4_XSX8 || t == T_Q2_KX8 || t == T_Q3_KX8;
}
AI int x8_base(const int t) { return t - 1000; }
AI int has_min(const int t) { return t == T_Q4_1 || t == T_Q5_1; }
AI int is_q5(const int t) { return t == T_Q5_0 || t == T_Q5_1; }
/* an x8 group record of a block (x8_lane): the d (and m or dmin) bytes, then Q5's fifth bits or the K-quants'
 * scales, then the values */
AI int is_k45(const int t) { return t == T_Q4_K || t == T_Q5_K; } /* d, dmin and the 12-byte 6-bit scales */
AI int x8_heads(const int base) { return has_min(base) || is_k45(base) ? 32 : 16; }
AI int x8_values(const int base) {
    return x8_heads(base) + (is_q5(base) ? 32 : base == T_Q4_K ? 96 : base == T_Q5_K ? 96 + 256 : base == T_Q6_K ? 128 : 0);
}
AI int is_signed(const int t) { return t == T_Q8_0 || t == T_IQ4_NL || t == T_IQ4_XS; } /* u holds int8 */

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

/* Q3_K's sixteen 6-bit scales as bytes 0-63 (ggml's kmask shuffle), in four words */
AI void q3k_scale_words(const uint8_t *sc12, uint32_t *aux) {
    memcpy(aux, sc12, 12);
    const uint32_t tmp = aux[2], k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | ((tmp & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
}

AI void q3k_scale_bytes(const uint8_t *sc12, uint8_t *out) {
    uint32_t aux[4];
    q3k_scale_words(sc12, aux);
    memcpy(out, aux, 16);
}

/* Q4_K/Q5_K's eight 6-bit scales to bytes 0-7 and mins to bytes 8-15 (llama.cpp's utmp shuffle), in words */
AI void q4k_scale_words(const uint8_t *sc12, uint32_t *u) {
    memcpy(u, sc12, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t m03 = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = m03;
    u[0] &= 0x3f3f3f3fu;
}

AI void q4k_scale_bytes(const uint8_t *sc12, uint8_t *out) {
    uint32_t u[4];
    q4k_scale_words(sc12, u);
    memcpy(out, u, 16);
}

/* IQ4_XS: sub-block s's 6-bit scale (4 low bits in bytes 4-7, 2 high bits in bytes 2-3) minus 32 */
AI int iq4xs_scale(const uint8_t *b, int s) {
    const uint32_t sh = (uint32_t)b[2] | ((uint32_t)b[3] << 8);
    return (int)(((b[4 + s / 2] >> (4 * (s % 2))) & 0xF) | (((sh >> (2 * s)) & 3) << 4)) - 32;
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
        for (int s = 0; s < 8; s++) {
            p->a[2 * s] = p->a[2 * s + 1] = d * (float)iq4xs_scale(blk, s);
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
        /* bits 2sp, 2sp + 1 of qh to bits 4, 5: one shift (16-bit lanes: the mask drops what crosses) */
        const __m256i sh = sp < 2 ? _mm256_slli_epi16(qh, 4 - 2 * sp) : sp == 2 ? qh : _mm256_srli_epi16(qh, 2);
        return _mm256_or_si256(lo, _mm256_and_si256(sh, _mm256_set1_epi8(48)));
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

AI float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

AI float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Weight bytes [p + PREFETCH_AHEAD, + n) on their way into L1, ahead of a kernel's pass over them (the x8 kernels'
 * one-group form, which the passes that stream weights from memory take; the per-row K-quant kernel). On an
 * AVX-512 AMD EPYC the hardware prefetchers alone left decode (1-2 rows of x) at 37-42 GB/s where this, 4 KiB
 * ahead, gave 44-49 (2 threads: Q4_K/Q4_0/Q5_0 x8 +10-22%, Q6_K +11%; 2-9 KiB ahead alike), 8 rows of x
 * +9-14% (x8), the per-row Q6_K at 16-32 rows +13-16%; nothing slower. Prefetches never fault. */
#define PREFETCH_AHEAD 4096
/* once: a single pass of x rows reads these bytes (a->wide == 0), so they come non-temporal (prefetchnta: into
 * L1, not kept in the outer caches they would only crowd). On an AVX2-only Zen 2, one row of x streaming a
 * 152k x 1536 Q4_K x8 head from memory read 21.6 -> 26.4 GB/s, a 152k x 896 Q5_0 x8 one 22.7 -> 27.9 (the
 * machine's 2-thread read bandwidth ~28); tiles that several passes of x rows reuse keep the temporal form. */
AI void prefetch_ahead(const uint8_t *p, int n, const int once) {
    if (once)
        for (int o = 0; o < n; o += 64) __builtin_prefetch(p + PREFETCH_AHEAD + o, 0, 0);
    else
        for (int o = 0; o < n; o += 64) __builtin_prefetch(p + PREFETCH_AHEAD + o, 0, 3);
}

/* Quantized activations of M rows, one record per row at base + r * stride: int8 q[K], then float d[K/32] (the
 * 32-block scales dx) and s32[K/32] (dx * sum of the block's q), for the 32-value block types; then the
 * super-block form below, for the K-quants. The stride is padded off multiples of 4 KiB: rows 4 KiB apart
 * share L1 sets and evict each other. */
typedef struct {
    const uint8_t *base;
    int64_t stride;
    const float *xf; /* the float activations [M, K] (float weight types) */
    int64_t K;
    int wide; /* more than one pass of x rows reads each weight tile: the x8 kernels go 512 bits wide (ROWS_X8) */
} act_t;

AI const int8_t *act_q(const act_t *a, int r) { return (const int8_t *)(a->base + r * a->stride); }
AI const float *act_d(const act_t *a, int r) { return (const float *)(a->base + r * a->stride + a->K); }
AI const float *act_s32(const act_t *a, int r) { return act_d(a, r) + a->K / 32; }

/* The super-block form of the same row (K-quant weights; K % 256 == 0), after it in the record: int8 q[K] with
 * one scale per 256 values (d256) and the integer sums of each 16 (b16), as llama.cpp's Q8_K, then of each 32
 * (b32: Q4_K x8's mins take two sub-blocks per vpmaddwd). A super-block's dot then sums in integers, its per-16
 * weight scales applied by vpmaddwd, and meets a float once. */
static inline int64_t act_off256(int64_t K) { return (K + 8 * (K / 32) + 63) & ~(int64_t)63; }
static inline int64_t act_stride(int64_t K) {
    const int64_t form256 = K % 256 == 0 ? K + 4 * (K / 256) + 2 * (K / 16) + 2 * (K / 32) : 0;
    return ((act_off256(K) + form256 + 63) & ~(int64_t)63) + 64;
}
AI const int8_t *act_q256(const act_t *a, int r) {
    return (const int8_t *)(a->base + r * a->stride + act_off256(a->K));
}
AI const float *act_d256(const act_t *a, int r) { return (const float *)(act_q256(a, r) + a->K); }
AI const int16_t *act_b16(const act_t *a, int r) { return (const int16_t *)(act_d256(a, r) + a->K / 256); }
AI const int16_t *act_b32(const act_t *a, int r) { return act_b16(a, r) + a->K / 16; }

/* A K-quant super-block's terms for the super-block form (the scalar path's; the SIMD path builds the same in
 * registers, kvec_t): value i of 16-group g is d * sc[g] * u_i + dm * mn[g] (the
 * offset or the min as an integer multiple of dm), so that with x_i ~ dx * q_i
 *     sum_i x_i w_i = dx * (d * sum_g sc[g] * dot_g(u, q) + dm * sum_g mn[g] * b16[g]),  integers inside. */
typedef struct {
    int16_t sc[16], mn[16];
    float d, dm;
} khdr_t;

AI void dec_khdr(const int t, const uint8_t *b, khdr_t *h) {
    uint8_t v[16];
    switch (t) {
    case T_Q2_K:
        for (int g = 0; g < 16; g++) {
            h->sc[g] = b[g] & 0xF;
            h->mn[g] = b[g] >> 4;
        }
        h->d = f16(b + 80);
        h->dm = -f16(b + 82);
        break;
    case T_Q3_K: case T_Q6_K:
        if (t == T_Q3_K) q3k_scale_bytes(b + 96, v);
        for (int g = 0; g < 16; g++) h->sc[g] = h->mn[g] = t == T_Q3_K ? (int16_t)v[g] - 32 : (int8_t)b[192 + g];
        h->d = f16(b + (t == T_Q3_K ? 108 : 208));
        h->dm = -(float)toffset(t) * h->d;
        break;
    case T_Q4_K: case T_Q5_K:
        q4k_scale_bytes(b + 4, v);
        for (int g = 0; g < 16; g++) {
            h->sc[g] = v[g / 2];
            h->mn[g] = v[8 + g / 2];
        }
        h->d = f16(b);
        h->dm = -f16(b + 2);
        break;
    case T_IQ4_XS:
        for (int g = 0; g < 16; g++) {
            h->sc[g] = (int16_t)iq4xs_scale(b, g / 2);
            h->mn[g] = 0;
        }
        h->d = f16(b);
        h->dm = 0.0f;
        break;
    default:
        break;
    }
}

/* A 32-value block's terms for the integer dot: its scale ws (times dx times the integer dot) and mc, which
 * folds the offset or the min (times dx * the sum of the block's activations). */
typedef struct {
    float ws[8], mc[8]; /* one per block; the SIMD path fills eight blocks' at once */
} hdr_t;

AI void dec_hdr(const int t, const uint8_t *b, hdr_t *h) {
    h->ws[0] = f16(b);
    h->mc[0] = has_min(t) ? f16(b + 2) : -(float)toffset(t) * h->ws[0];
}

#if defined(__AVX2__)
/* Eight 32-value blocks make a 256-value step of a weight row, so that their scales convert at once and the
 * offset/min terms of 8 blocks take one vector FMA. */
/* eight fp16 values `stride` bytes apart as floats: gathered with integer loads and shifts (scalar ports) and
 * converted at once, instead of a vector insert and conversion per block (a vpgatherdd was slower, measured) */
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
    const uint8_t *b = w + sb * 8 * tbytes(t);
    const __m256 d = f16x8(b, tbytes(t));
    _mm256_storeu_ps(h->ws, d);
    if (has_min(t))
        _mm256_storeu_ps(h->mc, f16x8(b + 2, tbytes(t)));
    else
        _mm256_storeu_ps(h->mc, _mm256_mul_ps(d, _mm256_set1_ps(-(float)toffset(t))));
}

AI __m256i dot_any(const int t, __m256i u, __m256i x) { return is_signed(t) ? dot_s(u, x) : dot_u(u, x); }

/* acc[r] += the integer dot of block s of the step with x rows r < R times its scale, lane s of sc[r] (the
 * blocks' scales times the row's activation scales, one vector product per 8 blocks) */
AI void sub_dot(const int t, const int R, const uint8_t *w, int64_t sb, int s, const act_t *a, const __m256 *sc,
                __m256 *acc) {
    const int64_t j = sb * 8 + s;
    const __m256i u = dec_sub(t, w + j * tbytes(t), 0);
    const __m256i lane = _mm256_set1_epi32(s);
    for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(act_q(a, r) + j * 32));
        const __m256 p = _mm256_cvtepi32_ps(dot_any(t, u, x));
        acc[r] = _mm256_fmadd_ps(p, _mm256_permutevar8x32_ps(sc[r], lane), acc[r]);
    }
}

/* res[r] = dot(weight row w, x row r) for R rows of x, a 32-value block type. Two accumulators per row (even
 * and odd blocks; the loop is unrolled so that they stay in registers): one FMA chain would wait its 4-cycle
 * latency at every block. */
AI void dot_q(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    const int64_t K = a->K, nsb = K / 256;
    __m256 acc0[RMAX], acc1[RMAX], accm[RMAX]; /* fixed sizes: a [R] array would be a VLA, kept in memory */
    for (int r = 0; r < R; r++) acc0[r] = acc1[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        hdr_t h;
        step_hdr(t, w, sb, &h);
        __m256 sc[RMAX];
        const __m256 ws = _mm256_loadu_ps(h.ws);
        for (int r = 0; r < R; r++) sc[r] = _mm256_mul_ps(ws, _mm256_loadu_ps(act_d(a, r) + sb * 8));
        for (int s = 0; s < 8; s += 2) {
            sub_dot(t, R, w, sb, s, a, sc, acc0);
            sub_dot(t, R, w, sb, s + 1, a, sc, acc1);
        }
        if (is_signed(t)) continue;
        for (int r = 0; r < R; r++)
            accm[r] = _mm256_fmadd_ps(_mm256_loadu_ps(h.mc), _mm256_loadu_ps(act_s32(a, r) + sb * 8), accm[r]);
    }
    float tail[RMAX] = {0};
    for (int64_t j = nsb * 8; j < K / 32; j++) { /* blocks past the last 256 values (K % 256 != 0) */
        hdr_t h;
        dec_hdr(t, w + j * tbytes(t), &h);
        const __m256i u = dec_sub(t, w + j * tbytes(t), 0);
        for (int r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(act_q(a, r) + j * 32));
            const __m256 p = _mm256_cvtepi32_ps(dot_any(t, u, x));
            acc0[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(h.ws[0] * act_d(a, r)[j]), acc0[r]);
            if (!is_signed(t)) tail[r] += h.mc[0] * act_s32(a, r)[j];
        }
    }
    for (int r = 0; r < R; r++)
        res[r] = hsum256(_mm256_add_ps(_mm256_add_ps(acc0[r], acc1[r]), accm[r])) + tail[r];
}

/* acc += the 16 pair sums p16 times the 16-bit scales sc, in 8 int32 lanes */
AI __m256i acc_scaled(__m256i acc, __m256i p16, __m256i sc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p16, sc);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p16, sc);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, sc));
#endif
}

/* A K-quant super-block's integer scales in registers: S the 16 groups' scales as int16, the even groups' in
 * the low 128-bit lane and the odd ones' in the high lane (word k: group 2k, 2k + 1), so that one in-lane vpshufb
 * gives sub-block s's vpmaddwd operand (its groups 2s and 2s + 1 each across their half); mn the offset/min
 * multipliers of the 16 groups as int16 in order (khdr_t's, built without a round trip through memory: scalar
 * stores read back as a vector stall on store forwarding). */
typedef struct {
    __m256i S, mn;
    float d, dm;
} kvec_t;

/* 16 bytes as int16 even | odd lanes (S's order), signed or not */
AI __m256i even_odd16(__m128i bytes, const int sign) {
    const __m128i eo = _mm_shuffle_epi8(bytes, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    return sign ? _mm256_cvtepi8_epi16(eo) : _mm256_cvtepu8_epi16(eo);
}

/* sub-block s's scales from S: word 2s..2s+1 bytes of each lane, repeated */
AI __m256i sub_scales(__m256i S, const int s) {
    return _mm256_shuffle_epi8(S, _mm256_set1_epi16((short)(2 * s | (2 * s + 1) << 8)));
}

AI __m128i words128(const uint32_t *u) { return _mm_setr_epi32((int)u[0], (int)u[1], (int)u[2], (int)u[3]); }

AI void dec_kvec(const int t, const uint8_t *b, kvec_t *h) {
    switch (t) {
    case T_Q2_K: {
        const __m128i raw = _mm_loadu_si128((const __m128i *)b), m15 = _mm_set1_epi8(15);
        h->S = even_odd16(_mm_and_si128(raw, m15), 0);
        h->mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m15));
        h->d = f16(b + 80);
        h->dm = -f16(b + 82);
        break;
    }
    case T_Q3_K: {
        uint32_t u[4];
        q3k_scale_words(b + 96, u);
        const __m128i v = words128(u);
        h->S = _mm256_sub_epi16(even_odd16(v, 0), _mm256_set1_epi16(32));
        h->mn = _mm256_sub_epi16(_mm256_cvtepu8_epi16(v), _mm256_set1_epi16(32));
        h->d = f16(b + 108);
        h->dm = -(float)toffset(t) * h->d;
        break;
    }
    case T_Q6_K: {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 192));
        h->S = even_odd16(raw, 1);
        h->mn = _mm256_cvtepi8_epi16(raw);
        h->d = f16(b + 208);
        h->dm = -(float)toffset(t) * h->d;
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        uint32_t u[4];
        q4k_scale_words(b + 4, u);
        const __m128i v = words128(u); /* bytes 0-7 the sub-blocks' scales, 8-15 their mins */
        h->S = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(v)); /* groups 2k, 2k + 1 take sub-block k's */
        const __m128i mins = _mm_srli_si128(v, 8);
        h->mn = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins, mins));
        h->d = f16(b);
        h->dm = -f16(b + 2);
        break;
    }
    case T_IQ4_XS: {
        const __m256i L = _mm256_setr_epi32(iq4xs_scale(b, 0), iq4xs_scale(b, 1), iq4xs_scale(b, 2),
                                            iq4xs_scale(b, 3), iq4xs_scale(b, 4), iq4xs_scale(b, 5),
                                            iq4xs_scale(b, 6), iq4xs_scale(b, 7));
        h->S = _mm256_permute4x64_epi64(_mm256_packs_epi32(L, L), 0x88); /* the 8 sub-blocks' in each lane */
        h->mn = _mm256_setzero_si256();
        h->d = f16(b);
        h->dm = 0.0f;
        break;
    }
    default:
        break;
    }
}

/* res[r] = dot(weight row w, x row r), a K-quant type on the super-block form of x: per super-block, the 8
 * sub-blocks' pair sums (vpmaddubsw: u <= 63, or |w| <= 127 for IQ4_XS, against |q| <= 127 fits int16) meet
 * their integer scales in int32 (two chains, even and odd sub-blocks), then one conversion and FMA per row. */
AI void dot_k(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    const int64_t nsb = a->K / 256;
    __m256 facc[RMAX];
    for (int r = 0; r < R; r++) facc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *b = w + sb * tbytes(t);
        prefetch_ahead(b, tbytes(t), !a->wide);
        kvec_t h;
        dec_kvec(t, b, &h);
        __m256i acc0[RMAX], acc1[RMAX];
        for (int r = 0; r < R; r++) acc0[r] = acc1[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            const __m256i u = dec_sub(t, b, s);
            const __m256i sc = sub_scales(h.S, s);
            const __m256i us = is_signed(t) ? _mm256_sign_epi8(u, u) : u;
            for (int r = 0; r < R; r++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(act_q256(a, r) + sb * 256 + s * 32));
                if (is_signed(t)) x = _mm256_sign_epi8(x, u);
                const __m256i p16 = _mm256_maddubs_epi16(us, x);
                if (s & 1) acc1[r] = acc_scaled(acc1[r], p16, sc); else acc0[r] = acc_scaled(acc0[r], p16, sc);
            }
        }
        const __m256i mn = h.mn;
        for (int r = 0; r < R; r++) {
            const float dx = act_d256(a, r)[sb];
            const __m256i dot = _mm256_add_epi32(acc0[r], acc1[r]);
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(h.d * dx), facc[r]);
            if (t == T_IQ4_XS) continue;
            const __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(act_b16(a, r) + sb * 16)), mn);
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(h.dm * dx), facc[r]);
        }
    }
    for (int r = 0; r < R; r++) res[r] = hsum256(facc[r]);
}
#else
/* the scalar forms: the same integers, one float accumulator per row */
AI void dot_q(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    float acc[RMAX] = {0};
    for (int64_t j = 0; j < a->K / 32; j++) {
        const uint8_t *b = w + j * tbytes(t);
        hdr_t h;
        dec_hdr(t, b, &h);
        uint8_t u[32];
        dec_sub_scalar(t, b, 0, u);
        for (int r = 0; r < R; r++) {
            const int8_t *x = act_q(a, r) + j * 32;
            int32_t p = 0;
            for (int i = 0; i < 32; i++) p += (is_signed(t) ? (int8_t)u[i] : u[i]) * x[i];
            acc[r] += h.ws[0] * act_d(a, r)[j] * (float)p;
            if (!is_signed(t)) acc[r] += h.mc[0] * act_s32(a, r)[j];
        }
    }
    for (int r = 0; r < R; r++) res[r] = acc[r];
}

AI void dot_k(const int t, const int R, const uint8_t *w, const act_t *a, float *res) {
    float acc[RMAX] = {0};
    for (int64_t sb = 0; sb < a->K / 256; sb++) {
        const uint8_t *b = w + sb * tbytes(t);
        khdr_t h;
        dec_khdr(t, b, &h);
        uint8_t u[8][32];
        for (int s = 0; s < 8; s++) dec_sub_scalar(t, b, s, u[s]);
        for (int r = 0; r < R; r++) {
            const int8_t *x = act_q256(a, r) + sb * 256;
            const int16_t *b16 = act_b16(a, r) + sb * 16;
            int32_t dot = 0, mins = 0;
            for (int g = 0; g < 16; g++) {
                int32_t p = 0;
                for (int i = 0; i < 16; i++) {
                    const uint8_t v = u[g / 2][(g % 2) * 16 + i];
                    p += (is_signed(t) ? (int8_t)v : (int32_t)v) * x[g * 16 + i];
                }
                dot += h.sc[g] * p;
                mins += h.mn[g] * b16[g];
            }
            const float dx = act_d256(a, r)[sb];
            acc[r] += (float)dot * (h.d * dx) + (float)mins * (h.dm * dx);
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

/* A kernel over n weight rows (`stride` bytes apart) and R rows of x: y[r * ldy + i] = dot(row i, x row r) + bias[i]
 * (pairs: y[r / 2 * ldy + i] = the sum of x rows r and r + 1's, gg_linear_precise). The row loop lives inside
 * the kernel: a call per weight row cost ~30 cycles, 15% of a K = 1536 Q4_K row. */
typedef void (*dot_fn)(const uint8_t *w, int64_t stride, int64_t n, const act_t *a, float *y, int64_t ldy,
                       const float *bias, int pairs);

AI void store_rows(const int R, const float *res, float *y, int64_t ldy, float b, int pairs) {
    if (pairs) /* R is even here: a pair never straddles two passes */
        for (int r = 0; r < R; r += 2) y[r / 2 * ldy] = (res[r] + res[r + 1]) + b;
    else
        for (int r = 0; r < R; r++) y[r * ldy] = res[r] + b;
}

#define ROWS(DOT, T, NAME, R) \
    static void NAME##_##R(const uint8_t *w, int64_t stride, int64_t n, const act_t *a, float *y, int64_t ldy, \
                           const float *bias, int pairs) { \
        for (int64_t i = 0; i < n; i++) { \
            float res[RMAX]; \
            DOT(T, R, w + i * stride, a, res); \
            store_rows(R, res, y + i, ldy, bias ? bias[i] : 0.0f, pairs); \
        } \
    }
#define KERNELS(DOT, T, NAME) ROWS(DOT, T, NAME, 1) ROWS(DOT, T, NAME, 2) ROWS(DOT, T, NAME, 4) ROWS(DOT, T, NAME, 8)
#define DOT_Q(T, NAME) KERNELS(dot_q, T, NAME)
#define DOT_K(T, NAME) KERNELS(dot_k, T, NAME)
#define DOT_F(T, NAME) KERNELS(dot_f, T, NAME)

DOT_F(T_F32, d_f32)
DOT_F(T_F16, d_f16)
DOT_F(T_BF16, d_bf16)
DOT_Q(T_Q4_0, d_q4_0)
DOT_Q(T_Q4_1, d_q4_1)
DOT_Q(T_Q5_0, d_q5_0)
DOT_Q(T_Q5_1, d_q5_1)
DOT_Q(T_Q8_0, d_q8_0)
DOT_Q(T_IQ4_NL, d_iq4_nl)
DOT_K(T_Q2_K, d_q2_k)
DOT_K(T_Q3_K, d_q3_k)
DOT_K(T_Q4_K, d_q4_k)
DOT_K(T_Q5_K, d_q5_k)
DOT_K(T_Q6_K, d_q6_k)
DOT_K(T_IQ4_XS, d_iq4_xs)

#if defined(__AVX2__)
/* Rows repacked eight at a time (the x8 types, 1000 + the ggml type, written by gg_repack_x8; x8_lane says the
 * layout): eight 32-byte vectors U[k] (k < 8) hold values 4k..4k+3 of the eight rows, one row per 32-bit lane, so
 * one vpdpbusd of U[k] against activations 4k..4k+3 broadcast to every lane gives eight rows' partial dots: no
 * horizontal sums, and a block's scale and offset (or min) terms are one vector FMA each for eight rows, where
 * the per-row kernel spends a convert, a permute and an FMA per row and block. Decode is bound by these
 * instructions, not by memory, on two cores. Where the CPU has 512-bit VNNI, two consecutive groups go at once
 * (group g in the low half of a register, g + 1 in the high): half the instructions per weight byte. The one
 * kernel below is written once for both widths (X8_DOT), on these per-width pieces: */
AI __m256i ld_256(const uint8_t *g, int64_t next) { (void)next; return _mm256_loadu_si256((const __m256i *)g); }
AI __m256 f16_256(const uint8_t *g, int64_t next) { (void)next; return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)); }
AI __m256i bcast_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
AI __m256i dpbusd_256(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, x);
#else /* u <= 31, or |w| <= 128: a pair sum 2 * 128 * 127 does not saturate int16 */
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}
AI __m256i abs_256(__m256i w) { return _mm256_abs_epi8(w); }
/* Without VNNI, the vpmaddubsw pair sums of several steps add up in int16 (bounded by the weights' range: no
 * overflow) and one vpmaddwd widens them (scaled, for Q4_K's sub-blocks): about half the multiply-port work of
 * a vpmaddwd per step. With VNNI, vpdpbusd per step, and Q4_K's sub-block sums scaled once (vpmulld). */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define vnni_256 1
#else
#define vnni_256 0
#endif
#define vnni_512 1
AI __m256i sign_256(__m256i x, __m256i w) { return _mm256_sign_epi8(x, w); } /* x where w > 0, -x where w < 0 */
/* bit `from` of each byte of v at bit `to`, the rest zero (16-bit shifts: what crosses bytes falls outside the mask) */
AI __m256i bit_at_256(__m256i v, const int from, const int to) {
    const __m256i h = from <= to ? _mm256_slli_epi16(v, to - from) : _mm256_srli_epi16(v, from - to);
    return _mm256_and_si256(h, _mm256_set1_epi8((char)(1 << to)));
}
/* byte j (< 4) of each 32-bit lane, sign-extended (a scale chunk's lanes, 4 int8 scales each) */
AI __m256i sbyte_256(__m256i v, const int j) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * j), 24); }
/* bytes lo and hi (< 4) of each 32-bit lane, sign-extended, as its two int16 halves (a vpmaddwd operand): one
 * vpshufb puts them atop the halves (the lane offsets ride in its control), an arithmetic shift extends them */
AI __m256i byte_pair_256(__m256i v, const uint32_t lo, const uint32_t hi) {
    const __m256i at = _mm256_add_epi8(_mm256_set1_epi32((int)(hi << 24 | lo << 8 | 0x800080u)),
                                       _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404,
                                                         0x08080808, 0x0c0c0c0c));
    return _mm256_srai_epi16(_mm256_shuffle_epi8(v, at), 8);
}
/* int32 lanes lo and hi as one lane of two int16 (lo's low half, then hi's): a vpmaddwd operand */
AI __m256i pair16_256(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define X16 1
AI __m512i ld_512(const uint8_t *g, int64_t next) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)g)),
                              _mm256_loadu_si256((const __m256i *)(g + next)), 1);
}
AI __m512 f16_512(const uint8_t *g, int64_t next) {
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(g + next)), _mm_loadu_si128((const __m128i *)g)));
}
AI __m512i bcast_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
AI __m512i dpbusd_512(__m512i acc, __m512i u, __m512i x) { return _mm512_dpbusd_epi32(acc, u, x); }
AI __m512i abs_512(__m512i w) { return _mm512_abs_epi8(w); }
/* no vpsignb at 512 bits: -x where w < 0 (where w == 0 the weight's |w| zeroes the product anyway) */
AI __m512i sign_512(__m512i x, __m512i w) { return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x); }
AI __m512i bit_at_512(__m512i v, const int from, const int to) {
    const __m512i h = from <= to ? _mm512_slli_epi16(v, to - from) : _mm512_srli_epi16(v, from - to);
    return _mm512_and_si512(h, _mm512_set1_epi8((char)(1 << to)));
}
AI __m512i sbyte_512(__m512i v, const int j) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24); }
AI __m512i byte_pair_512(__m512i v, const uint32_t lo, const uint32_t hi) {
    const __m512i at = _mm512_add_epi8(_mm512_set1_epi32((int)(hi << 24 | lo << 8 | 0x800080u)),
                                       _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c)));
    return _mm512_srai_epi16(_mm512_shuffle_epi8(v, at), 8);
}
AI __m512i pair16_512(__m512i lo, __m512i hi) {
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
}
#else
#define X16 0
#endif

/* res[8 * GROUPS * r + i] = dot(row i of the GROUPS groups at w (the next one `next` bytes on), x row r), r < R.
 * At 512 bits the two groups share registers (low and high halves); at 256 bits each has its own (H of them) */
#define X8_DOT(W, GROUPS, NAME)                                                                                      \
    AI void NAME(const int t, const int R, const uint8_t *w, int64_t next, const act_t *a, float *res) { \
        const int base = x8_base(t), gb = 8 * tbytes(base), hv = x8_values(base), q8 = base == T_Q8_0;       \
        const __m##W##i m4 = _mm##W##_set1_epi8(15), z = _mm##W##_setzero_si##W();                            \
        enum { H = W == 256 ? GROUPS : 1 }; /* groups in registers of their own (at 512 bits: halves) */       \
        __m##W acc[H][RMAX];                                                                                   \
        for (int st = 0; st < H; st++)                                                                          \
            for (int r = 0; r < R; r++) acc[st][r] = _mm##W##_setzero_ps();                                     \
        for (int64_t j = 0; j < a->K / 32; j++)                                                                \
        for (int st = 0; st < H; st++) {                                                                        \
            const uint8_t *g = w + st * next + j * gb;                                                         \
            if (H == GROUPS) prefetch_ahead(g, gb, !a->wide);                                                  \
            __m##W##i s0[RMAX], s1[RMAX], p[RMAX]; /* two chains per row of x; p: int16 pair sums (no VNNI) */  \
            for (int r = 0; r < R; r++) s0[r] = s1[r] = p[r] = z;                                              \
            const __m##W##i q = is_q5(base) ? ld_##W(g + x8_heads(base), next) : z;                            \
            for (int c = 0; c < (q8 ? 8 : 4); c++) {                                                           \
                const __m##W##i v = ld_##W(g + hv + 32 * c, next);                                             \
                if (q8) { /* |w| against x with w's sign */                                                    \
                    const __m##W##i u = abs_##W(v);                                                            \
                    for (int r = 0; r < R; r++) {                                                              \
                        const __m##W##i x = sign_##W(bcast_##W(act_q(a, r) + j * 32 + 4 * c), v);              \
                        /* two chains hide vpdpbusd's latency; the emulated one ends in a 1-cycle add */         \
                        if (c & 1 && vnni_##W) s1[r] = dpbusd_##W(s1[r], u, x); else s0[r] = dpbusd_##W(s0[r], u, x); \
                    }                                                                                          \
                    continue;                                                                                  \
                }                                                                                              \
                __m##W##i lo = _mm##W##_and_si##W(v, m4), hi = _mm##W##_and_si##W(_mm##W##_srli_epi16(v, 4), m4); \
                if (is_q5(base)) {                                                                             \
                    lo = _mm##W##_or_si##W(lo, bit_at_##W(q, c, 4));                                           \
                    hi = _mm##W##_or_si##W(hi, bit_at_##W(q, c + 4, 4));                                       \
                }                                                                                              \
                for (int r = 0; r < R; r++) {                                                                  \
                    const int8_t *xq = act_q(a, r) + j * 32;                                                   \
                    if (vnni_##W) {                                                                            \
                        s0[r] = dpbusd_##W(s0[r], lo, bcast_##W(xq + 4 * c));                                  \
                        s1[r] = dpbusd_##W(s1[r], hi, bcast_##W(xq + 16 + 4 * c));                             \
                        continue;                                                                              \
                    }                                                                                          \
                    /* pair sums <= 2 * 31 * 127: 4 fit int16 (2 chunks), 8 with u <= 15 (4 chunks) */           \
                    p[r] = _mm##W##_add_epi16(p[r], _mm##W##_add_epi16(_mm##W##_maddubs_epi16(lo, bcast_##W(xq + 4 * c)), \
                                                                       _mm##W##_maddubs_epi16(hi, bcast_##W(xq + 16 + 4 * c)))); \
                    if ((c + 1) % (is_q5(base) ? 2 : 4) == 0) {                                                \
                        s0[r] = _mm##W##_add_epi32(s0[r], _mm##W##_madd_epi16(p[r], _mm##W##_set1_epi16(1)));   \
                        p[r] = z;                                                                              \
                    }                                                                                          \
                }                                                                                              \
            }                                                                                                  \
            const __m##W d = f16_##W(g, next);                                                                 \
            const __m##W m = has_min(base) ? f16_##W(g + 16, next)                                             \
                                           : _mm##W##_mul_ps(d, _mm##W##_set1_ps(-(float)toffset(base)));      \
            for (int r = 0; r < R; r++) {                                                                      \
                const __m##W dot = _mm##W##_cvtepi32_ps(_mm##W##_add_epi32(s0[r], s1[r]));                     \
                acc[st][r] = _mm##W##_fmadd_ps(_mm##W##_mul_ps(d, _mm##W##_set1_ps(act_d(a, r)[j])), dot, acc[st][r]); \
                if (!q8) acc[st][r] = _mm##W##_fmadd_ps(m, _mm##W##_set1_ps(act_s32(a, r)[j]), acc[st][r]);      \
            }                                                                                                  \
        }                                                                                                      \
        for (int st = 0; st < H; st++)                                                                          \
            for (int r = 0; r < R; r++) _mm##W##_storeu_ps(res + 8 * GROUPS * r + 8 * st, acc[st][r]);         \
    }
X8_DOT(256, 1, dot_x8_256)
X8_DOT(256, 2, dot_x8_256x2)
X8_DOT(256, 4, dot_x8_256x4)
#if X16
X8_DOT(512, 2, dot_x8_512)
#else
#define dot_x8_512(t, R, w, next, a, res) ((void)0)
#endif

/* Q4_K rows repacked eight at a time (T_Q4_KX8; x8_lane says the layout): per super-block, the eight rows'
 * 6-bit scales and mins come apart into bytes for all 64 sub-blocks with a dozen vector ops (no per-row scalar
 * unpacking), and each sub-block's eight vectors U[c] (values 4c..4c+3 of the eight rows, one row per lane) meet
 * broadcast activations as in X8_DOT, their integer dots scaled per lane by the rows' sub-block scales; the
 * super-block form of x (its integer sums per 16) gives the mins' terms. One float FMA per super-block and row
 * of x, for eight weight rows. */
/* bytes 8k..8k+7 (k < 4) as eight int32 lanes */
AI __m256i lanes8_256(__m256i v, const int k) {
    const __m128i h = k < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
    return _mm256_cvtepu8_epi32(k & 1 ? _mm_unpackhi_epi64(h, h) : h);
}
#if X16
AI __m512i lanes8_512(__m512i v, const int k) { /* bytes 8k..8k+7 of each half as sixteen int32 lanes */
    __m128i lo, hi;
    switch (k / 2) {
    case 0: lo = _mm512_extracti32x4_epi32(v, 0); hi = _mm512_extracti32x4_epi32(v, 2); break;
    default: lo = _mm512_extracti32x4_epi32(v, 1); hi = _mm512_extracti32x4_epi32(v, 3); break;
    }
    return _mm512_cvtepu8_epi32(k & 1 ? _mm_unpackhi_epi64(lo, hi) : _mm_unpacklo_epi64(lo, hi));
}
#endif

/* chunk c of Q4_K (Q5_K) x8 sub-block s (values 4c..4c+3 of the eight rows, or sixteen: two groups) against R
 * rows of x, into part: vpdpbusd, or without VNNI int16 pair sums. Q5_K's fifth bit: bit s of the qh chunk's
 * bytes, moved to bit 4 */
#define X8K_CHUNK(W)                                                                                            \
    AI void x8k_chunk_##W(const int t, const int R, const uint8_t *g, int64_t next, const act_t *a, int64_t sb, \
                          const int s, const int c, __m##W##i *part) {                                          \
        const __m##W##i v = ld_##W(g + x8_values(t) + 256 * (s / 2) + 32 * c, next);                            \
        __m##W##i u = _mm##W##_and_si##W(s & 1 ? _mm##W##_srli_epi16(v, 4) : v, _mm##W##_set1_epi8(15));        \
        if (t == T_Q5_K) u = _mm##W##_or_si##W(u, bit_at_##W(ld_##W(g + 128 + 32 * c, next), s, 4));          \
        for (int r = 0; r < R; r++) {                                                                           \
            const __m##W##i x = bcast_##W(act_q256(a, r) + sb * 256 + 32 * s + 4 * c);                         \
            part[r] = vnni_##W ? dpbusd_##W(part[r], u, x) : _mm##W##_add_epi16(part[r], _mm##W##_maddubs_epi16(u, x)); \
        }                                                                                                       \
    }
/* a chunk, then (Q5_K without VNNI) after the fourth the pair sums so far scaled into isum: 4 pair sums <= 2 * 31
 * * 127 fill int16 */
#define X8K_STEP(W)                                                                                             \
    AI void x8k_step_##W(const int t, const int R, const uint8_t *g, int64_t next, const act_t *a, int64_t sb,  \
                         const int s, const int c, __m##W##i sc16, __m##W##i *part, __m##W##i *isum) {         \
        x8k_chunk_##W(t, R, g, next, a, sb, s, c, part);                                                        \
        if (t == T_Q5_K && !vnni_##W && c == 3)                                                                 \
            for (int r = 0; r < R; r++) {                                                                       \
                isum[r] = _mm##W##_add_epi32(isum[r], _mm##W##_madd_epi16(part[r], sc16));                      \
                part[r] = _mm##W##_setzero_si##W();                                                             \
            }                                                                                                   \
    }
X8K_CHUNK(256)
X8K_STEP(256)
#if X16
X8K_CHUNK(512)
X8K_STEP(512)
#endif

#define X8K_DOT(W, GROUPS, NAME)                                                                                \
    AI void NAME(const int t, const int R, const uint8_t *w, int64_t next, const act_t *a, float *res) { \
        const int base = x8_base(t), rec = 8 * tbytes(base);                                                    \
        const __m##W##i m4 = _mm##W##_set1_epi8(15), m3 = _mm##W##_set1_epi8(3), z = _mm##W##_setzero_si##W();   \
        enum { H = W == 256 ? GROUPS : 1 }; /* groups in registers of their own (at 512 bits: halves) */       \
        __m##W acc[H][RMAX];                                                                                    \
        for (int st = 0; st < H; st++)                                                                          \
            for (int r = 0; r < R; r++) acc[st][r] = _mm##W##_setzero_ps();                                     \
        for (int64_t sb = 0; sb < a->K / 256; sb++)                                                             \
        for (int st = 0; st < H; st++) {                                                                        \
            const uint8_t *g = w + st * next + sb * rec;                                                        \
            if (H == GROUPS) prefetch_ahead(g, rec, !a->wide);                                                  \
            const __m##W##i A0 = ld_##W(g + 32, next), A1 = ld_##W(g + 64, next), B = ld_##W(g + 96, next);     \
            __m##W##i SC[2], MN[2]; /* byte 8s + i: row i's sub-block s (s < 4 in [0], 4 + s in [1]) */         \
            for (int h = 0; h < 2; h++) {                                                                       \
                const __m##W##i A = h ? A1 : A0;                                                                \
                SC[h] = _mm##W##_or_si##W(_mm##W##_and_si##W(A, m4),                                            \
                        _mm##W##_slli_epi16(_mm##W##_and_si##W(_mm##W##_srli_epi16(B, 2 * h), m3), 4));         \
                MN[h] = _mm##W##_or_si##W(_mm##W##_and_si##W(_mm##W##_srli_epi16(A, 4), m4),                    \
                        _mm##W##_slli_epi16(_mm##W##_and_si##W(_mm##W##_srli_epi16(B, 4 + 2 * h), m3), 4));     \
            }                                                                                                   \
            __m##W##i isum[RMAX], msum[RMAX];                                                                   \
            for (int r = 0; r < R; r++) isum[r] = msum[r] = z;                                                  \
            for (int s = 0; s < 8; s++) {                                                                       \
                const __m##W##i sc = lanes8_##W(SC[s / 4], s % 4);                                             \
                const __m##W##i sc16 = _mm##W##_or_si##W(sc, _mm##W##_slli_epi32(sc, 16));                      \
                __m##W##i part[RMAX]; /* the sub-block's unscaled dots (without VNNI: int16 pair sums) */       \
                for (int r = 0; r < R; r++) part[r] = z;                                                        \
                if (R >= (base == T_Q5_K ? 4 : 8)) { /* unrolled: Q4_K 1.1-1.2x at 8-32 rows of x, 0.9x at 2; \
                                                      * Q5_K 1.3x at 4, 0.75x at 1 */                           \
                    _Pragma("GCC unroll 8")                                                                     \
                    for (int c = 0; c < 8; c++) x8k_step_##W(base, R, g, next, a, sb, s, c, sc16, part, isum);  \
                } else {                                                                                        \
                    for (int c = 0; c < 8; c++) x8k_step_##W(base, R, g, next, a, sb, s, c, sc16, part, isum);  \
                }                                                                                               \
                for (int r = 0; r < R; r++) /* 8 pair sums <= 2 * 15 * 127 fit int16 (Q5_K: the last 4) */     \
                    isum[r] = _mm##W##_add_epi32(isum[r], vnni_##W ? _mm##W##_mullo_epi32(part[r], sc)           \
                                                                   : _mm##W##_madd_epi16(part[r], sc16));        \
            }                                                                                                   \
            for (int s = 0; s < 8; s += 2) { /* the mins' terms: sub-blocks s, s + 1's mins times their x sums */ \
                const __m##W##i mn = _mm##W##_or_si##W(lanes8_##W(MN[s / 4], s % 4),                            \
                                                       _mm##W##_slli_epi32(lanes8_##W(MN[s / 4], s % 4 + 1), 16)); \
                for (int r = 0; r < R; r++) {                                                                   \
                    const __m##W##i b = bcast_##W((const int8_t *)(act_b32(a, r) + sb * 8 + s));                \
                    msum[r] = _mm##W##_add_epi32(msum[r], _mm##W##_madd_epi16(b, mn));                          \
                }                                                                                               \
            }                                                                                                   \
            const __m##W d = f16_##W(g, next), dmin = f16_##W(g + 16, next);                                    \
            for (int r = 0; r < R; r++) {                                                                       \
                const __m##W dx = _mm##W##_set1_ps(act_d256(a, r)[sb]);                                         \
                acc[st][r] = _mm##W##_fmadd_ps(_mm##W##_mul_ps(d, dx), _mm##W##_cvtepi32_ps(isum[r]), acc[st][r]); \
                acc[st][r] = _mm##W##_fnmadd_ps(_mm##W##_mul_ps(dmin, dx), _mm##W##_cvtepi32_ps(msum[r]), acc[st][r]); \
            }                                                                                                   \
        }                                                                                                       \
        for (int st = 0; st < H; st++)                                                                          \
            for (int r = 0; r < R; r++) _mm##W##_storeu_ps(res + 8 * GROUPS * r + 8 * st, acc[st][r]);         \
    }
X8K_DOT(256, 1, dot_x8k_256)
X8K_DOT(256, 2, dot_x8k_256x2)
#if X16
X8K_DOT(512, 2, dot_x8k_512)
#else
#define dot_x8k_512(t, R, w, next, a, res) ((void)0)
#endif

/* Q6_K rows repacked eight at a time (T_Q6_KX8; x8_lane says the layout): a 16-value group's eight int8 scales
 * come out of a scale chunk as int32 lanes with two shifts; a value chunk (a nibble of ql with two bits of qh, 6
 * bits unsigned) meets broadcast activations as in X8_DOT, each group's integer dot scaled per lane; the offset 32
 * is 32 times the scales against the groups' activation sums (the super-block form of x), as Q4_K's mins. */
#define X6K_DOT(W, GROUPS)                                                                                      \
    /* the scale chunk holding group g's (< 16) scales: byte g % 4 of each row's 32-bit lane */                 \
    AI __m##W##i x6k_scale_chunk_##W(const uint8_t *rec, int64_t next, const int g) {                          \
        return ld_##W(rec + 16 + 32 * (g / 4), next);                                                           \
    }                                                                                                           \
    /* the eight (sixteen) rows' int8 scales of group g (< 16) of the record at rec, as int32 lanes */          \
    AI __m##W##i x6k_scale_##W(const uint8_t *rec, int64_t next, const int g) {                                \
        return sbyte_##W(x6k_scale_chunk_##W(rec, next, g), g % 4);                                             \
    }                                                                                                           \
    /* values 4c..4c+3 (c < 8) of group g's sub-block (half g / 8, quarter g / 2 % 4 of ggml's ql/qh split), u    \
     * in 0..63: a nibble of ql with bits 2sp, 2sp + 1 of qh moved to bits 4, 5 (16-bit shifts: the mask drops   \
     * what crosses) */                                                                                         \
    AI __m##W##i x6k_u_##W(const uint8_t *rec, int64_t next, const int g, const int c) {                       \
        const int h = g / 8, sp = g / 2 % 4;                                                                    \
        const uint8_t *vals = rec + x8_values(T_Q6_K);                                                          \
        const __m##W##i QL = ld_##W(vals + 32 * (16 * h + 8 * (sp & 1) + c), next);                              \
        const __m##W##i QH = ld_##W(vals + 32 * (32 + 8 * h + c), next);                                         \
        const __m##W##i hi = _mm##W##_and_si##W(sp < 2 ? _mm##W##_slli_epi16(QH, 4 - 2 * sp)                    \
                                                       : _mm##W##_srli_epi16(QH, 2 * sp - 4), _mm##W##_set1_epi8(48)); \
        return _mm##W##_or_si##W(_mm##W##_and_si##W(sp >> 1 ? _mm##W##_srli_epi16(QL, 4) : QL, _mm##W##_set1_epi8(15)), hi); \
    }                                                                                                           \
    /* group g against R rows of x (vpdpbusd: the offset 32 is left to the scales times the groups' x sums) */  \
    AI void x6k_group_##W(const int R, const uint8_t *rec, int64_t next, const act_t *a, int64_t sb, const int g, \
                          __m##W##i *isum) {                                                                    \
        const __m##W##i sc = x6k_scale_##W(rec, next, g);                                                       \
        __m##W##i part[RMAX];                                                                                   \
        for (int r = 0; r < R; r++) part[r] = _mm##W##_setzero_si##W();                                         \
        _Pragma("GCC unroll 4")                                                                                 \
        for (int c = 4 * (g % 2); c < 4 * (g % 2) + 4; c++) {                                                   \
            const __m##W##i u = x6k_u_##W(rec, next, g, c);                                                     \
            for (int r = 0; r < R; r++)                                                                         \
                part[r] = dpbusd_##W(part[r], u, bcast_##W(act_q256(a, r) + sb * 256 + 16 * g + 4 * (c % 4)));   \
        }                                                                                                       \
        for (int r = 0; r < R; r++) isum[r] = _mm##W##_add_epi32(isum[r], _mm##W##_mullo_epi32(part[r], sc)); \
    }                                                                                                           \
    AI void dot_x6k_##W(const int t, const int R, const uint8_t *w, int64_t next, const act_t *a, float *res) { \
        (void)t;                                                                                                \
        const __m##W##i z = _mm##W##_setzero_si##W();                                                           \
        __m##W acc[RMAX];                                                                                       \
        for (int r = 0; r < R; r++) acc[r] = _mm##W##_setzero_ps();                                             \
        for (int64_t sb = 0; sb < a->K / 256; sb++) {                                                           \
            const uint8_t *rec = w + sb * 8 * 210;                                                              \
            if (GROUPS == 1) prefetch_ahead(rec, 8 * 210, !a->wide);                                            \
            __m##W##i isum[RMAX], msum[RMAX];                                                                   \
            for (int r = 0; r < R; r++) isum[r] = msum[r] = z;                                                  \
            if (R == 8) { /* as two halves of four rows (all eight at once spilled registers: 0.75x the per-row \
                           * kernel at 8 rows, where the halves run 1.1x) */                                     \
                const act_t a4 = {a->base + 4 * a->stride, a->stride, a->xf + 4 * a->K, a->K, a->wide};         \
                _Pragma("GCC unroll 16")                                                                        \
                for (int g = 0; g < 16; g++) {                                                                  \
                    x6k_group_##W(4, rec, next, a, sb, g, isum);                                                \
                    x6k_group_##W(4, rec, next, &a4, sb, g, isum + 4);                                          \
                }                                                                                               \
            } else { /* unrolled: constant shifts and offsets */                                                \
                _Pragma("GCC unroll 16")                                                                        \
                for (int g = 0; g < 16; g++) x6k_group_##W(R, rec, next, a, sb, g, isum);                       \
            }                                                                                                   \
            for (int s = 0; s < 8; s++) { /* the offset's terms: groups 2s, 2s + 1's scales times their x sums */ \
                const __m##W##i pair = byte_pair_##W(x6k_scale_chunk_##W(rec, next, 2 * s), 2 * s % 4, 2 * s % 4 + 1); \
                for (int r = 0; r < R; r++) {                                                                   \
                    const __m##W##i b = bcast_##W((const int8_t *)(act_b16(a, r) + sb * 16 + 2 * s));           \
                    msum[r] = _mm##W##_add_epi32(msum[r], _mm##W##_madd_epi16(b, pair));                        \
                }                                                                                               \
            }                                                                                                   \
            const __m##W d = f16_##W(rec, next);                                                                \
            for (int r = 0; r < R; r++) {                                                                       \
                const __m##W ddx = _mm##W##_mul_ps(d, _mm##W##_set1_ps(act_d256(a, r)[sb]));                    \
                const __m##W##i dot = _mm##W##_sub_epi32(isum[r], _mm##W##_slli_epi32(msum[r], 5));             \
                acc[r] = _mm##W##_fmadd_ps(ddx, _mm##W##_cvtepi32_ps(dot), acc[r]);                              \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < R; r++) _mm##W##_storeu_ps(res + 8 * GROUPS * r, acc[r]);                           \
    }
/* Q6_K rows are repacked at load only with VNNI (X6K_AT_LOAD). Without it an x8 kernel (vpmaddubsw, decoding
 * values as it goes) ran 1.11-1.20x the per-row kernel at 8-64 rows of x but 0.75x at one (bf16 x) on an
 * AVX2-only EPYC (Zen 2): a 1.5B Q4_K_M decoded at 0.89x repacked. So the rows stay in ggml's layout there, and
 * where enough rows of x pass over a tile (KX8D_ROWS) run_columns decodes it into a thread's buffer
 * (x6k_regroup, T_KX8D below): 1.3x the per-row kernel at 32 rows of x, 1.45x at 64, 1.5x at 512. */
#define X6K_AT_LOAD vnni_256
X6K_DOT(256, 1)
#if X16
X6K_DOT(512, 2)
#else
#define dot_x6k_512(t, R, w, next, a, res) ((void)0)
#endif

/* A Q6_K tile decoded for a CPU without VNNI (x6k_regroup; Q3_K x8's take the same form, x3k_decode), where the
 * x8 layout's kernel would decode every value once per pass of rows of x: per 8 rows and super-block a record of KX8D_REC bytes, their d as floats (32
 * bytes), each group's scales as int16 pairs (16 x 32 bytes; lane i: row i's scale twice), then the values u - 32
 * as int8 in 64 chunks (chunk 4g + c, lane i: row i's values 16g + 4c..16g + 4c + 3). A chunk is then one vpabsb
 * before its rows' vpsignb (x takes w's sign), vpmaddubsw, vpaddw: a group's four chunks' pair sums (<= 2 * 32 *
 * 127 each) add up in int16, and one vpmaddwd per group and row applies the scales. */
#define KX8D_REC 2592
AI void dot_kx8d_256(const int t, const int R, const uint8_t *w, int64_t next, const act_t *a, float *res) {
    (void)t, (void)next;
    __m256 acc[RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < a->K / 256; sb++) {
        const uint8_t *rec = w + sb * KX8D_REC;
        __m256i isum[RMAX];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int g = 0; g < 16; g++) {
            __m256i part[RMAX];
            for (int r = 0; r < R; r++) part[r] = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i sw = _mm256_load_si256((const __m256i *)(rec + 544 + 32 * (4 * g + c)));
                const __m256i aw = _mm256_abs_epi8(sw);
                for (int r = 0; r < R; r++) {
                    const __m256i x = _mm256_sign_epi8(bcast_256(act_q256(a, r) + sb * 256 + 16 * g + 4 * c), sw);
                    part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(aw, x));
                }
            }
            const __m256i sc = _mm256_load_si256((const __m256i *)(rec + 32 + 32 * g));
            for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(part[r], sc));
        }
        const __m256 d = _mm256_load_ps((const float *)rec);
        for (int r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(act_d256(a, r)[sb])), _mm256_cvtepi32_ps(isum[r]),
                                     acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(res + 8 * r, acc[r]);
}
#define dot_kx8d_512(t, R, w, next, a, res) ((void)0)

/* IQ4_XS rows repacked eight at a time (T_IQ4_XSX8; x8_lane says the layout): a value chunk's nibbles are looked
 * up in the IQ4 table (vpshufb) as signed bytes that meet broadcast activations with their sign, as Q8_0 x8 (a
 * pair sum <= 2 * 127 * 127 fills int16, so none add up there); the eight rows' sub-block scales (6 bits from two
 * places, minus 32) come apart as int32 lanes with shifts and apply in the vpmaddwd (VNNI: a vpmulld per
 * sub-block). Where the per-row kernel spends its instructions on per-row scales and sums, this spends them on
 * values: 1.5x on an AVX2-only EPYC at one row of x. */
AI __m256i iq4_table_256(void) {
    const __m128i kv = _mm_loadu_si128((const __m128i *)KV_IQ4);
    return _mm256_set_m128i(kv, kv);
}
AI __m256i u16_lanes_256(const uint8_t *g, int64_t next) { /* eight uint16 as int32 lanes */
    (void)next;
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)g));
}
#if X16
AI __m512i iq4_table_512(void) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KV_IQ4)); }
AI __m512i u16_lanes_512(const uint8_t *g, int64_t next) {
    return _mm512_cvtepu16_epi32(_mm256_set_m128i(_mm_loadu_si128((const __m128i *)(g + next)),
                                                  _mm_loadu_si128((const __m128i *)g)));
}
#endif
#define X8IQ_DOT(W, GROUPS)                                                                                     \
    AI void dot_x8iq_##W(const int t, const int R, const uint8_t *w, int64_t next, const act_t *a, float *res) { \
        (void)t;                                                                                                \
        const __m##W##i m4 = _mm##W##_set1_epi8(15), kv = iq4_table_##W(), z = _mm##W##_setzero_si##W();         \
        __m##W acc[RMAX];                                                                                       \
        for (int r = 0; r < R; r++) acc[r] = _mm##W##_setzero_ps();                                             \
        for (int64_t sb = 0; sb < a->K / 256; sb++) {                                                           \
            const uint8_t *g = w + sb * 8 * 136;                                                                \
            if (GROUPS == 1) prefetch_ahead(g, 8 * 136, !a->wide);                                              \
            const __m##W##i L = ld_##W(g + 16, next), H = u16_lanes_##W(g + 48, next);                          \
            __m##W##i isum[RMAX];                                                                               \
            for (int r = 0; r < R; r++) isum[r] = z;                                                            \
            _Pragma("GCC unroll 8")                                                                             \
            for (int s = 0; s < 8; s++) {                                                                       \
                const __m##W##i sc = _mm##W##_sub_epi32(_mm##W##_or_si##W(                                      \
                    _mm##W##_and_si##W(_mm##W##_srli_epi32(L, 4 * s), _mm##W##_set1_epi32(15)),                 \
                    _mm##W##_slli_epi32(_mm##W##_and_si##W(_mm##W##_srli_epi32(H, 2 * s), _mm##W##_set1_epi32(3)), 4)), \
                    _mm##W##_set1_epi32(32));                                                                   \
                const __m##W##i sc16 = pair16_##W(sc, sc);                                                      \
                __m##W##i part[RMAX];                                                                           \
                for (int r = 0; r < R; r++) part[r] = z;                                                        \
                for (int c = 0; c < 4; c++) {                                                                   \
                    const __m##W##i v = ld_##W(g + 64 + 128 * s + 32 * c, next);                                \
                    const __m##W##i wl = _mm##W##_shuffle_epi8(kv, _mm##W##_and_si##W(v, m4));                  \
                    const __m##W##i wh = _mm##W##_shuffle_epi8(kv, _mm##W##_and_si##W(_mm##W##_srli_epi16(v, 4), m4)); \
                    const __m##W##i al = abs_##W(wl), ah = abs_##W(wh);                                         \
                    for (int r = 0; r < R; r++) {                                                               \
                        const int8_t *xq = act_q256(a, r) + sb * 256 + 32 * s + 4 * c;                          \
                        const __m##W##i xl = sign_##W(bcast_##W(xq), wl), xh = sign_##W(bcast_##W(xq + 16), wh); \
                        if (vnni_##W) {                                                                         \
                            part[r] = dpbusd_##W(dpbusd_##W(part[r], al, xl), ah, xh);                          \
                        } else {                                                                                \
                            part[r] = _mm##W##_add_epi32(part[r], _mm##W##_add_epi32(                           \
                                _mm##W##_madd_epi16(_mm##W##_maddubs_epi16(al, xl), sc16),                      \
                                _mm##W##_madd_epi16(_mm##W##_maddubs_epi16(ah, xh), sc16)));                    \
                        }                                                                                       \
                    }                                                                                           \
                }                                                                                               \
                for (int r = 0; r < R; r++)                                                                     \
                    isum[r] = _mm##W##_add_epi32(isum[r], vnni_##W ? _mm##W##_mullo_epi32(part[r], sc) : part[r]); \
            }                                                                                                   \
            const __m##W d = f16_##W(g, next);                                                                  \
            for (int r = 0; r < R; r++)                                                                         \
                acc[r] = _mm##W##_fmadd_ps(_mm##W##_mul_ps(d, _mm##W##_set1_ps(act_d256(a, r)[sb])),             \
                                           _mm##W##_cvtepi32_ps(isum[r]), acc[r]);                              \
        }                                                                                                       \
        for (int r = 0; r < R; r++) _mm##W##_storeu_ps(res + 8 * GROUPS * r, acc[r]);                           \
    }
X8IQ_DOT(256, 1)
#if X16
X8IQ_DOT(512, 2)
#else
#define dot_x8iq_512(t, R, w, next, a, res) ((void)0)
#endif

/* Q3_K x8 (per super-block record): byte j of lane i of S[k] is row i's scale of group 4k + j (6 bits from two
 * places, minus 32: ggml's kmask shuffle, lane-wise) */
#define X8Q23_PARTS(W)                                                                                          \
    AI void q3k_scales_##W(const uint8_t *g, int64_t next, __m##W##i S[4]) {                                    \
        const __m##W##i m3 = _mm##W##_set1_epi8(3), m15 = _mm##W##_set1_epi8(15);                             \
        const __m##W##i A = ld_##W(g + 16, next), B = ld_##W(g + 48, next), C = ld_##W(g + 80, next);          \
        for (int k = 0; k < 4; k++) {                                                                           \
            const __m##W##i l4 = _mm##W##_and_si##W(k < 2 ? (k ? B : A) : _mm##W##_srli_epi16(k == 2 ? A : B, 4), m15); \
            const __m##W##i h2 = _mm##W##_and_si##W(_mm##W##_srli_epi16(C, 2 * k), m3);                         \
            S[k] = _mm##W##_sub_epi8(_mm##W##_or_si##W(l4, _mm##W##_slli_epi16(h2, 4)), _mm##W##_set1_epi8(32)); \
        }                                                                                                       \
    }                                                                                                           \
    /* lane i: row i's values 32s + 4c .. + 3 as unsigned 2 bits of qs (Q3_K: hmask's bit as bit 2, u - 4 the   \
     * value; Q2_K: the value) */                                                                               \
    AI __m##W##i q23_values_##W(const uint8_t *g, int64_t next, const int q3, const int s, const int c) {       \
        const __m##W##i Q = ld_##W(g + (q3 ? 368 : 160) + 32 * (8 * (s / 4) + c), next);                       \
        const __m##W##i u = _mm##W##_and_si##W(_mm##W##_srli_epi16(Q, 2 * (s % 4)), _mm##W##_set1_epi8(3));    \
        return q3 ? _mm##W##_or_si##W(u, bit_at_##W(ld_##W(g + 112 + 32 * c, next), s, 2)) : u;                 \
    }
X8Q23_PARTS(256)
#if X16
X8Q23_PARTS(512)
#endif

/* Q3_K and Q2_K rows repacked eight at a time (T_Q3_KX8, T_Q2_KX8; x8_lane says the layout): per super-block the
 * eight rows' sixteen group scales (Q3_K: 6 bits from two places, minus 32; Q2_K: 4 bits, and its mins) come apart
 * as bytes with a few shifts; a value chunk (two bits of qs, and Q3_K's hmask bit) meets broadcast activations as
 * in X8_DOT, a group's four chunks' pair sums (<= 2 * 7 * 127) adding up in int16 before one vpmaddwd applies its
 * scale (VNNI: vpdpbusd, a vpmulld per group); Q3_K's offset 4 and Q2_K's mins meet the groups' x sums (the
 * super-block form of x), as Q6_K x8's offset. */
#define X8Q23_DOT(W, GROUPS)                                                                                    \
    AI void dot_x8q23_##W(const int t, const int R, const uint8_t *w, int64_t next, const act_t *a, float *res) { \
        const int base = x8_base(t), q3 = base == T_Q3_K, rec = 8 * tbytes(base);                             \
        const __m##W##i m15 = _mm##W##_set1_epi8(15), z = _mm##W##_setzero_si##W();                            \
        __m##W acc[RMAX];                                                                                       \
        for (int r = 0; r < R; r++) acc[r] = _mm##W##_setzero_ps();                                             \
        for (int64_t sb = 0; sb < a->K / 256; sb++) {                                                           \
            const uint8_t *g = w + sb * rec;                                                                    \
            if (GROUPS == 1) prefetch_ahead(g, rec, !a->wide);                                                  \
            __m##W##i S[4], MN[4]; /* byte j of lane i: row i's group 4k + j scale (min) */                     \
            if (q3) {                                                                                           \
                q3k_scales_##W(g, next, S);                                                                     \
                for (int k = 0; k < 4; k++) MN[k] = S[k];                                                       \
            } else {                                                                                            \
                for (int k = 0; k < 4; k++) {                                                                   \
                    const __m##W##i v = ld_##W(g + 32 + 32 * k, next);                                          \
                    S[k] = _mm##W##_and_si##W(v, m15);                                                          \
                    MN[k] = _mm##W##_and_si##W(_mm##W##_srli_epi16(v, 4), m15);                                 \
                }                                                                                               \
            }                                                                                                   \
            __m##W##i isum[RMAX], msum[RMAX];                                                                   \
            for (int r = 0; r < R; r++) isum[r] = msum[r] = z;                                                  \
            _Pragma("GCC unroll 8")                                                                             \
            for (int s = 0; s < 8; s++) {                                                                       \
                _Pragma("GCC unroll 2")                                                                         \
                for (int half = 0; half < 2; half++) { /* group 2s + half: values 16 half.. of sub-block s */   \
                    const uint32_t j = (2 * s + half) % 4;                                                      \
                    const __m##W##i sc = vnni_##W /* its scale per lane: int32, or (without VNNI) twice int16 */ \
                        ? sbyte_##W(S[(2 * s + half) / 4], j)                                                   \
                        : byte_pair_##W(S[(2 * s + half) / 4], j, j);                                          \
                    __m##W##i part[RMAX];                                                                       \
                    for (int r = 0; r < R; r++) part[r] = z;                                                    \
                    _Pragma("GCC unroll 4")                                                                     \
                    for (int c = 4 * half; c < 4 * half + 4; c++) {                                             \
                        const __m##W##i u = q23_values_##W(g, next, q3, s, c);                                  \
                        for (int r = 0; r < R; r++) {                                                           \
                            const __m##W##i x = bcast_##W(act_q256(a, r) + sb * 256 + 32 * s + 4 * c);          \
                            part[r] = vnni_##W ? dpbusd_##W(part[r], u, x)                                      \
                                               : _mm##W##_add_epi16(part[r], _mm##W##_maddubs_epi16(u, x));     \
                        }                                                                                       \
                    }                                                                                           \
                    for (int r = 0; r < R; r++)                                                                 \
                        isum[r] = _mm##W##_add_epi32(isum[r], vnni_##W ? _mm##W##_mullo_epi32(part[r], sc)       \
                                                                       : _mm##W##_madd_epi16(part[r], sc));     \
                }                                                                                               \
                /* groups 2s, 2s + 1's offset scales (Q3_K) or mins (Q2_K) times their x sums */                \
                const uint32_t j0 = 2 * s % 4;                                                                  \
                const __m##W##i pair = byte_pair_##W(MN[s / 2], j0, j0 + 1);                                    \
                for (int r = 0; r < R; r++) {                                                                   \
                    const __m##W##i b = bcast_##W((const int8_t *)(act_b16(a, r) + sb * 16 + 2 * s));           \
                    msum[r] = _mm##W##_add_epi32(msum[r], _mm##W##_madd_epi16(b, pair));                        \
                }                                                                                               \
            }                                                                                                   \
            const __m##W d = f16_##W(g, next), dmin = q3 ? d : f16_##W(g + 16, next);                          \
            for (int r = 0; r < R; r++) {                                                                       \
                const __m##W dx = _mm##W##_set1_ps(act_d256(a, r)[sb]);                                         \
                if (q3) {                                                                                       \
                    const __m##W##i dot = _mm##W##_sub_epi32(isum[r], _mm##W##_slli_epi32(msum[r], 2));         \
                    acc[r] = _mm##W##_fmadd_ps(_mm##W##_mul_ps(d, dx), _mm##W##_cvtepi32_ps(dot), acc[r]);      \
                } else {                                                                                        \
                    acc[r] = _mm##W##_fmadd_ps(_mm##W##_mul_ps(d, dx), _mm##W##_cvtepi32_ps(isum[r]), acc[r]);  \
                    acc[r] = _mm##W##_fnmadd_ps(_mm##W##_mul_ps(dmin, dx), _mm##W##_cvtepi32_ps(msum[r]), acc[r]); \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < R; r++) _mm##W##_storeu_ps(res + 8 * GROUPS * r, acc[r]);                           \
    }
X8Q23_DOT(256, 1)
#if X16
X8Q23_DOT(512, 2)
#else
#define dot_x8q23_512(t, R, w, next, a, res) ((void)0)
#endif

AI void store_x8(const int R, const float *res, int width, int k, float *y, int64_t ldy, float b, int pairs) {
    float col[RMAX];
    for (int r = 0; r < R; r++) col[r] = res[width * r + k];
    store_rows(R, col, y, ldy, b, pairs);
}

/* n (a multiple of 8) repacked rows from w: two groups at a time where the CPU has 512-bit VNNI and the tile is
 * reused (a->wide), else one. Half the instructions per weight byte pays once the tile is in cache (1.3x at 16-32
 * rows of x); streaming it from memory in one pass, two groups at a time ran 0.55-0.9x as fast as one at a time
 * on an AMD EPYC with AVX-512 (Q4_K/Q8_0 x8, 1-8 rows, 1 or 2 threads, software prefetch did not close it; in
 * cache the wide form won there too). */
/* Where one pass of x streams a tile from memory (decode), the x8 kernels of the 32-value types and Q4_K/Q5_K
 * read two (Q8_0 at one row of x: four) ranges of its groups at once, each group's sums in registers of their own
 * (X8_DOT and X8K_DOT at 256 bits over two or four groups): more streams of weight bytes, which the hardware
 * prefetchers fetch faster than one. On an AVX2-only EPYC, 2 threads, a 152k-row head from memory, one row of x,
 * GB/s one stream -> two: Q4_0 28.0 -> 39.3, Q4_1 31.1 -> 43.5, Q5_0 26.8 -> 37.9, Q5_1 28.4 -> 40.3, Q8_0 28.1
 * -> 36.3, Q4_K 25.5-27.0 -> 33.9-36.4, Q5_K 23.2-24.9 -> 30.1-31.2; Q8_0 two -> four 32.5-33.3 -> 37.1-37.8 (four
 * for the 4- and 5-bit types ran 0.8-1.0x two: their instructions bound them first). With two rows of x
 * (float32 models' two passes) the 4- and 5-bit kernels are bound by their instructions, and two streams ran
 * 0.85-1.09x (Q8_0 still 29.6 -> 36.3): one stream there. Q6_K's per-row kernel (without VNNI) reading two rows
 * at once ran 0.93-0.97x. Each group's arithmetic is the one-stream kernel's: the same bits. */
AI int x8_streams(const int t, const int R, const act_t *a) {
    const int x8_32 = t == T_Q4_0X8 || t == T_Q4_1X8 || t == T_Q5_0X8 || t == T_Q5_1X8 || t == T_Q8_0X8;
    if (a->wide || !(x8_32 || t == T_Q4_KX8 || t == T_Q5_KX8)) return 1;
    if (R == 1) return t == T_Q8_0X8 ? 4 : 2;
    return R == 2 && t == T_Q8_0X8 ? 2 : 1;
}
#define ONE_STREAM(t, R, w, next, a, res) ((void)0) /* (the kernels x8_streams never picks) */
#define ROWS_X8(T, NAME, R, DOT, TWO, FOUR) \
    static void NAME##_##R(const uint8_t *w, int64_t stride, int64_t n, const act_t *a, float *y, int64_t ldy, \
                           const float *bias, int pairs) { \
        enum { RR = R > X8_RMAX(T) ? 1 : R }; /* (run_columns never asks for more) */ \
        float res[32 * RMAX]; \
        int64_t i = 0; \
        int S = x8_streams(T, RR, a); \
        while (S > 1 && n < 8 * S) S /= 2; \
        if (S > 1) { \
            const int64_t part = n / (8 * S) * 8; /* rows of each stream */ \
            for (; i < part; i += 8) { \
                if (S == 4) FOUR(T, RR, w + i * stride, part * stride, a, res); \
                else TWO(T, RR, w + i * stride, part * stride, a, res); \
                for (int st = 0; st < S; st++) \
                    for (int k = 0; k < 8; k++) \
                        store_x8(RR, res, 8 * S, 8 * st + k, y + st * part + i + k, ldy, \
                                 bias ? bias[st * part + i + k] : 0.0f, pairs); \
            } \
            i = S * part; \
        } \
        for (; X16 && a->wide && i + 16 <= n; i += 16) { \
            DOT##_512(T, RR, w + i * stride, 8 * stride, a, res); \
            for (int k = 0; k < 16; k++) store_x8(RR, res, 16, k, y + i + k, ldy, bias ? bias[i + k] : 0.0f, pairs); \
        } \
        for (; i < n; i += 8) { \
            DOT##_256(T, RR, w + i * stride, 8 * stride, a, res); \
            for (int k = 0; k < 8; k++) store_x8(RR, res, 8, k, y + i + k, ldy, bias ? bias[i + k] : 0.0f, pairs); \
        } \
    }
#define KERNELS_X8(T, NAME, DOT, TWO, FOUR) \
    ROWS_X8(T, NAME, 1, DOT, TWO, FOUR) ROWS_X8(T, NAME, 2, DOT, TWO, FOUR) ROWS_X8(T, NAME, 4, DOT, TWO, FOUR) \
    ROWS_X8(T, NAME, 8, DOT, TWO, FOUR)
KERNELS_X8(T_Q4_0X8, d_q4_0x8, dot_x8, dot_x8_256x2, dot_x8_256x4)
KERNELS_X8(T_Q4_1X8, d_q4_1x8, dot_x8, dot_x8_256x2, dot_x8_256x4)
KERNELS_X8(T_Q5_0X8, d_q5_0x8, dot_x8, dot_x8_256x2, dot_x8_256x4)
KERNELS_X8(T_Q5_1X8, d_q5_1x8, dot_x8, dot_x8_256x2, dot_x8_256x4)
KERNELS_X8(T_Q8_0X8, d_q8_0x8, dot_x8, dot_x8_256x2, dot_x8_256x4)
KERNELS_X8(T_Q4_KX8, d_q4_kx8, dot_x8k, dot_x8k_256x2, ONE_STREAM)
KERNELS_X8(T_Q5_KX8, d_q5_kx8, dot_x8k, dot_x8k_256x2, ONE_STREAM)
#if X6K_AT_LOAD
KERNELS_X8(T_Q6_KX8, d_q6_kx8, dot_x6k, ONE_STREAM, ONE_STREAM)
#endif
KERNELS_X8(T_KX8D, d_kx8d, dot_kx8d, ONE_STREAM, ONE_STREAM)
KERNELS_X8(T_IQ4_XSX8, d_iq4_xsx8, dot_x8iq, ONE_STREAM, ONE_STREAM)
KERNELS_X8(T_Q3_KX8, d_q3_kx8, dot_x8q23, ONE_STREAM, ONE_STREAM)
KERNELS_X8(T_Q2_KX8, d_q2_kx8, dot_x8q23, ONE_STREAM, ONE_STREAM)
#endif

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
#if defined(__AVX2__)
    case T_Q4_0X8: PICK(d_q4_0x8);
    case T_Q4_1X8: PICK(d_q4_1x8);
    case T_Q5_0X8: PICK(d_q5_0x8);
    case T_Q5_1X8: PICK(d_q5_1x8);
    case T_Q8_0X8: PICK(d_q8_0x8);
    case T_Q4_KX8: PICK(d_q4_kx8);
    case T_Q5_KX8: PICK(d_q5_kx8);
#if X6K_AT_LOAD
    case T_Q6_KX8: PICK(d_q6_kx8);
#endif
    case T_KX8D: PICK(d_kx8d);
    case T_IQ4_XSX8: PICK(d_iq4_xsx8);
    case T_Q3_KX8: PICK(d_q3_kx8);
    case T_Q2_KX8: PICK(d_q2_kx8);
#endif
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
static void quantize_row(const float *x, int64_t K, int8_t *q, float *d, float *s32) {
    for (int64_t j = 0; j < K / 32; j++) {
        const float *xb = x + j * 32;
        int32_t sum = 0;
        float amax = 0.0f;
#if defined(__AVX2__)
        __m256 v[4], m = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        amax = hmax256(m);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++)
            qi[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
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
            sum += v;
        }
#endif
        const float dj = amax / 127.0f;
        d[j] = dj;
        s32[j] = dj * (float)sum;
    }
}

/* One row of x to the super-block form: int8 per 256 values (scale amax/127, nearest even), integer sums per 16. */
static void quantize_row256(const float *x, int64_t K, int8_t *q, float *d, int16_t *b16, int16_t *b32) {
    for (int64_t j = 0; j < K / 256; j++) {
        const float *xb = x + j * 256;
        float amax = 0.0f;
#if defined(__AVX2__)
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 256; i += 8)
            m = _mm256_max_ps(m, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(xb + i)));
        amax = hmax256(m);
        const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (int g = 0; g < 16; g += 2) { /* 32 values: two groups of 16 */
            __m256i qi[4];
            for (int i = 0; i < 4; i++)
                qi[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + g * 16 + 8 * i), id),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            b16[j * 16 + g] = (int16_t)hsum_i32(_mm256_add_epi32(qi[0], qi[1]));
            b16[j * 16 + g + 1] = (int16_t)hsum_i32(_mm256_add_epi32(qi[2], qi[3]));
            const __m256i p16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            _mm256_storeu_si256((__m256i *)(q + j * 256 + g * 16),
                                _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
#else
        for (int i = 0; i < 256; i++) {
            const float ax = fabsf(xb[i]);
            amax = ax > amax ? ax : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int g = 0; g < 16; g++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++) {
                const int32_t v = (int32_t)nearbyintf(xb[g * 16 + i] * id);
                q[j * 256 + g * 16 + i] = (int8_t)v;
                sum += v;
            }
            b16[j * 16 + g] = (int16_t)sum;
        }
#endif
        for (int s = 0; s < 8; s++) b32[j * 8 + s] = (int16_t)(b16[j * 16 + 2 * s] + b16[j * 16 + 2 * s + 1]);
        d[j] = amax / 127.0f;
    }
}

/* a thread-local buffer (grown, never shrunk) */
static uint8_t *grown(uint8_t **buf, size_t *cap, size_t n) {
    if (n > *cap) {
        free(*buf);
        *cap = (n + 4095) & ~(size_t)4095;
        *buf = aligned_alloc(64, *cap);
        if (*buf == NULL) *cap = 0;
    }
    return *buf;
}

static __thread uint8_t *g_buf; /* the calling thread's quantized activations, which all threads read */
static __thread size_t g_cap;
static uint8_t *scratch(size_t n) { return grown(&g_buf, &g_cap, n); }

#if defined(__AVX2__)
/* word k (< 8) of 8 rows (32-bit words at p[i] + off) as chunk k at out (lane i: row i's): an 8x8 transpose */
AI void transpose8_words(const uint8_t *const *p, int64_t off, uint8_t *out) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(p[i] + off)));
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);     /* rows i, i+1: words 0, 1 | 4, 5 */
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* words 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 8; i += 4)
        for (int k = 0; k < 2; k++) {
            u[i + 2 * k] = _mm256_shuffle_ps(t[i + k], t[i + k + 2], 0x44);     /* word 2k (| 2k + 4) of 4 rows */
            u[i + 2 * k + 1] = _mm256_shuffle_ps(t[i + k], t[i + k + 2], 0xEE); /* word 2k + 1 (| 2k + 5) */
        }
    for (int k = 0; k < 4; k++) {
        _mm256_storeu_ps((float *)(out + 32 * k), _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
        _mm256_storeu_ps((float *)(out + 32 * (k + 4)), _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
    }
}

/* Q6_K rows [0, rows) (rows % 8 == 0, row stride `stride`) decoded into T_KX8D records at dst (32-byte
 * aligned): each 8 rows' super-block regrouped into the x8 layout (an 8x8 word transpose), then decoded */
static void x6k_regroup(const uint8_t *w, int64_t stride, int64_t rows, int64_t K, uint8_t *dst) {
    const int64_t nsb = K / 256;
    uint8_t x8[8 * 210];
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *p[8];
            for (int i = 0; i < 8; i++) {
                p[i] = w + (8 * g + i) * stride + sb * 210;
                memcpy(x8 + 2 * i, p[i] + 208, 2);
                for (int c = 0; c < 4; c++) memcpy(x8 + 16 + 32 * c + 4 * i, p[i] + 192 + 4 * c, 4);
            }
            for (int b = 0; b < 6; b++) transpose8_words(p, 32 * b, x8 + x8_values(T_Q6_K) + 256 * b);
            uint8_t *o = dst + (g * nsb + sb) * KX8D_REC;
            _mm256_store_ps((float *)o, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x8)));
            for (int k = 0; k < 16; k++) {
                _mm256_store_si256((__m256i *)(o + 32 + 32 * k), byte_pair_256(x6k_scale_chunk_256(x8, 0, k), k % 4, k % 4));
                for (int c = 0; c < 4; c++)
                    _mm256_store_si256((__m256i *)(o + 544 + 32 * (4 * k + c)),
                                       _mm256_sub_epi8(x6k_u_256(x8, 0, k, 4 * (k % 2) + c), _mm256_set1_epi8(32)));
            }
        }
}

/* Q3_K x8 rows [0, rows) (whole groups, row stride `stride`) decoded into T_KX8D records at dst: a Q6_K tile's
 * form, the values u - 4 (-4..3) where Q6_K's are u - 32, the scales (-32..31) as Q6_K's int8 ones */
static void x3k_decode(const uint8_t *w, int64_t stride, int64_t rows, int64_t K, uint8_t *dst) {
    const int64_t nsb = K / 256;
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t sb = 0; sb < nsb; sb++) {
            const uint8_t *rec = w + 8 * g * stride + sb * 8 * tbytes(T_Q3_K);
            uint8_t *o = dst + (g * nsb + sb) * KX8D_REC;
            __m256i S[4];
            q3k_scales_256(rec, 0, S);
            _mm256_store_ps((float *)o, f16_256(rec, 0));
            for (int k = 0; k < 16; k++) {
                _mm256_store_si256((__m256i *)(o + 32 + 32 * k), byte_pair_256(S[k / 4], k % 4, k % 4));
            }
            for (int s = 0; s < 8; s++) /* chunk 4k + c of group k = 2s + c / 4: values 32s + 4c.. */
                for (int c = 0; c < 8; c++)
                    _mm256_store_si256((__m256i *)(o + 544 + 32 * (8 * s + c)),
                                       _mm256_sub_epi8(q23_values_256(rec, 0, 1, s, c), _mm256_set1_epi8(4)));
        }
}

/* What decodes a type's tiles to T_KX8D where enough rows of x pass over them (KX8D_ROWS), or NULL: Q6_K where it
 * is not repacked at load, and Q3_K x8 without VNNI, whose kernel otherwise decodes every value once per pass of
 * four rows of x (Q3_K on an AVX2-only EPYC, N=8960 K=1536 + 1536x8960 + 2048x1536, bf16 x, ms x8 / decoded:
 * M=16 6.70/5.52, M=32 12.97/9.88, M=128 54.0/37.9, M=512 218/151) */
typedef void (*tile_decoder_fn)(const uint8_t *w, int64_t stride, int64_t rows, int64_t K, uint8_t *dst);
static tile_decoder_fn tile_decoder(const int t) {
    if (t == T_Q6_K && !X6K_AT_LOAD) return x6k_regroup;
    if (t == T_Q3_KX8 && !vnni_256) return x3k_decode;
    return NULL;
}
static __thread uint8_t *t_buf; /* this thread's decoded weight tile */
static __thread size_t t_cap;
/* rows of x from which run_columns decodes a tile: Q6_K at 16 rows 1.15-1.2x the per-row kernel, at 8 (one pass
 * of the tile for its decoding) 0.87x */
#define KX8D_ROWS 16
#endif

/* the first output column whose weight bytes start at or after `target` (columns weighted by their row bytes) */
static int64_t column_at(const gg_part_t *parts, int nparts, int64_t K, double target) {
    int64_t col = 0;
    double before = 0.0;
    for (int p = 0; p < nparts; p++) {
        const double rb = (double)K / tvalues(parts[p].type) * tbytes(parts[p].type);
        const double size = rb * (double)parts[p].rows;
        if (target < before + size) {
            int64_t c = (int64_t)ceil((target - before) / rb);
            if (is_x8(parts[p].type)) c = (c + 7) & ~(int64_t)7; /* a thread's columns start at a group */
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

#define NTILE 16 /* weight rows per kernel call: their bytes stay in L1/L2 while all row-chunks of x pass */

/* weight rows [0, count) of type t (their outputs columns n..) for all M rows of x, RMAX rows of x per pass */
static void run_tile(const int t, const uint8_t *w, int64_t stride, int64_t count, const act_t *a, int64_t M,
                     int64_t N, int64_t n, const float *bias, float *y, int pairs) {
    const int rmax = is_x8(t) || t == T_KX8D ? X8_RMAX(t) : is_float(t) ? RMAX_WIDE : RMAX; /* rows per pass */
    for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        const int R = left >= rmax ? rmax : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const act_t am = {a->base ? a->base + m * a->stride : NULL, a->stride, a->xf + m * a->K, a->K, M > rmax};
        pick(t, R)(w, stride, count, &am, y + (pairs ? m / 2 : m) * N + n, N, bias ? bias + n : NULL, pairs);
        m += R;
    }
}

/* output columns [n0, n1) for all M rows of activations; pairs: rows 2i and 2i + 1 are the two halves of
 * output row i (gg_linear_precise), summed */
static void run_columns(const gg_part_t *parts, int nparts, int64_t n0, int64_t n1, const act_t *a, int64_t M,
                        int64_t N, const float *bias, float *y, int pairs, int invariant) {
    const int64_t K = a->K;
    int64_t start = 0;
    for (int p = 0; p < nparts; start += parts[p].rows, p++) {
        const int64_t lo = n0 > start ? n0 : start, hi = n1 < start + parts[p].rows ? n1 : start + parts[p].rows;
        const int t = parts[p].type;
        const int64_t stride = parts[p].row_stride;
        /* tiles keep weight bytes in cache for the next pass of x; with one pass, the kernel takes the whole
         * range (its two streams: ROWS_X8) */
        const int64_t ntile = is_x8(t) && M <= X8_RMAX(t) ? hi - lo : NTILE;
        for (int64_t n = lo; n < hi; n += ntile) {
            const int64_t count = hi - n < ntile ? hi - n : ntile;
            const uint8_t *w = parts[p].w + (n - start) * stride;
            int64_t done = 0;
#if defined(__AVX2__)
            /* not in batch-invariant mode: the x8 kernel's float sums differ from the per-row kernel's, and a
             * row's bits would depend on how many rows share the call */
            const tile_decoder_fn decode = tile_decoder(t);
            if (decode != NULL && !invariant && M >= KX8D_ROWS && count >= 8) {
                const int64_t rb = K / 256 * KX8D_REC / 8, whole = count / 8 * 8;
                uint8_t *tile = grown(&t_buf, &t_cap, (size_t)(whole * rb));
                if (tile != NULL) {
                    decode(w, stride, whole, K, tile);
                    run_tile(T_KX8D, tile, rb, whole, a, M, N, n, bias, y, pairs);
                    done = whole;
                }
            }
#endif
            if (done < count) run_tile(t, w + done * stride, stride, count - done, a, M, N, n + done, bias, y, pairs);
        }
    }
}

enum { FORM32 = 1, FORM256 = 2 }; /* the activation forms a layer's weight types read */

/* Row m of x into the forms the weights need. precise: as rows 2m and 2m + 1, x quantized, then the residual
 * x - dx * q quantized the same way (each form from its own residual); xf rows 2m and 2m + 1 are x and zeros
 * (float weight types see x once). */
static void quantize_x(const float *x, int64_t K, const act_t *a, int64_t m, int forms, int precise, float *xf) {
    const int64_t r = precise ? 2 * m : m;
    float *res = precise ? xf + (2 * m + 1) * K : NULL;
    if (forms & FORM32) {
        int8_t *q = (int8_t *)act_q(a, r);
        const float *d = act_d(a, r);
        quantize_row(x, K, q, (float *)d, (float *)act_s32(a, r));
        if (precise) {
            for (int64_t k = 0; k < K; k++) res[k] = x[k] - d[k / 32] * (float)q[k];
            quantize_row(res, K, (int8_t *)act_q(a, r + 1), (float *)act_d(a, r + 1), (float *)act_s32(a, r + 1));
        }
    }
    if (forms & FORM256) {
        int8_t *q = (int8_t *)act_q256(a, r);
        const float *d = act_d256(a, r);
        quantize_row256(x, K, q, (float *)d, (int16_t *)act_b16(a, r), (int16_t *)act_b32(a, r));
        if (precise) {
            for (int64_t k = 0; k < K; k++) res[k] = x[k] - d[k / 256] * (float)q[k];
            quantize_row256(res, K, (int8_t *)act_q256(a, r + 1), (float *)act_d256(a, r + 1),
                            (int16_t *)act_b16(a, r + 1), (int16_t *)act_b32(a, r + 1));
        }
    }
    if (precise) {
        memcpy(xf + 2 * m * K, x, (size_t)K * sizeof(float));
        memset(res, 0, (size_t)K * sizeof(float));
    }
}

#define CHUNKS_PER_THREAD 4 /* column ranges per thread in linear */
/* Both small-layer choices in linear (quantize_first, one range per thread under SMALL_LAYER_BYTES) measured on an
 * AVX2-only EPYC, 2 threads, alternated: the default model's decode 1.05-1.09x (its layers are 576 wide: 0.2-1.1
 * MB in Q4_1), its int4 HF form 1.05-1.07x; 0.5B and 1.5B Q4_K_M decode unchanged */
#define SMALL_LAYER_BYTES (1024.0 * 1024.0)
static void linear(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
                   const float *bias, float *y, int num_threads, int precise, int invariant) {
    int forms = 0;
    for (int p = 0; p < nparts; p++)
        if (!is_float(parts[p].type)) forms |= tvalues(parts[p].type) == 256 ? FORM256 : FORM32;
    precise &= forms != 0;
    const int64_t rows = precise ? 2 * M : M;
    act_t a = {NULL, act_stride(K), x, K, 0};
    if (forms) {
        const size_t act_bytes = (size_t)(rows * a.stride);
        a.base = scratch(act_bytes + (precise ? (size_t)(rows * K) * sizeof(float) : 0));
        if (a.base == NULL) return;
        if (precise) a.xf = (const float *)(a.base + act_bytes);
    }
    const double total = total_bytes(parts, nparts, K);
    /* one or two rows of x (decode) are quantized before the threads start: one barrier less per layer */
    const int quantize_first = forms && M <= 2;
    if (quantize_first)
        for (int64_t m = 0; m < M; m++) quantize_x(x + m * K, K, &a, m, forms, precise, (float *)a.xf);
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
        if (forms && !quantize_first) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) quantize_x(x + m * K, K, &a, m, forms, precise, (float *)a.xf);
        }
        /* ranges of equal weight bytes, more than threads, taken as threads come free: a core a neighbour
         * slows takes fewer, instead of its partner spinning at the barrier for it. A layer under
         * SMALL_LAYER_BYTES takes one range per thread: its ranges would be a few microseconds each, and
         * handing them out cost more than they balanced */
        const int per = total < SMALL_LAYER_BYTES ? 1 : CHUNKS_PER_THREAD;
        const int C = omp_get_num_threads() == 1 ? 1 : per * omp_get_num_threads();
#pragma omp for schedule(dynamic, 1) nowait /* (the region's end is the barrier) */
        for (int c = 0; c < C; c++) {
            const int64_t n0 = column_at(parts, nparts, K, total * c / C);
            const int64_t n1 = c == C - 1 ? N : column_at(parts, nparts, K, total * (c + 1) / C);
            run_columns(parts, nparts, n0, n1, &a, rows, N, bias, y, precise, invariant);
        }
    }
}

/* The decode kernel: int8 activations per 32 values (bfloat16 models: as fine as their activations). */
void gg_linear(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
               const float *bias, float *y, int num_threads) {
    linear(x, M, parts, nparts, N, K, bias, y, num_threads, 0, 0);
}

/* The same for float32 models, with the activations at about 16-bit precision: x ~ dx * q + dr * qr, qr the
 * int8 quantization of the residual, both run as rows of one pass over the weights (each decoded weight
 * block serves both; the integer dots are exact) and summed. Twice the integer work, the same weight bytes. */
void gg_linear_precise(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
                       const float *bias, float *y, int num_threads) {
    linear(x, M, parts, nparts, N, K, bias, y, num_threads, 1, 0);
}

/* Both for batch-invariant mode: each row's output the same bits whatever rows share the call */
void gg_linear_invariant(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N, int64_t K,
                         const float *bias, float *y, int num_threads) {
    linear(x, M, parts, nparts, N, K, bias, y, num_threads, 0, 1);
}

void gg_linear_precise_invariant(const float *x, int64_t M, const gg_part_t *parts, int32_t nparts, int64_t N,
                                 int64_t K, const float *bias, float *y, int num_threads) {
    linear(x, M, parts, nparts, N, K, bias, y, num_threads, 1, 1);
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

/* Block j of row 8g + i <-> lane i of block j's group record (gg_repack_x8), either way (unpack: record to block).
 * A record holds the eight rows' blocks' bytes regrouped:
 *   their fp16 scales d (16 bytes); Q4_1/Q5_1: then their fp16 mins m (16 bytes);
 *   Q5_0/Q5_1: then their fifth bits (32 bytes): bit c of byte 4i + k is the bit of row i's value 4c + k;
 *   then the values in chunks of 32 bytes, bytes 4i..4i+3 of chunk c being row i's value bytes 4c..4c+3 (Q8_0: 8
 *   chunks, values 4c..4c+3; the nibble types: 4 chunks, low nibbles values 4c..4c+3, high 16+4c..19+4c).
 * Q4_K and Q5_K (a record per super-block; x8k_scales): d, then dmin (16 bytes each); the 6-bit scales and mins of
 * sub-block s in bytes 8s + i of 64 (scale's low 4 bits, then min's) and the high 2 bits in byte 8(s % 4) + i
 * of 32 (scale's at bit 2(s / 4), min's at 4 + 2(s / 4)); then 32 chunks: bytes 4i..4i+3 of chunk 8q + c are
 * row i's bytes 32q + 4c.. of its nibbles (low nibbles: values 64q + 4c.., sub-block 2q; high: sub-block 2q + 1).
 * Q5_K puts its qh between the scales and the nibbles: 8 chunks, bytes 4i..4i+3 of chunk c row i's qh[4c..4c+3].
 * Q6_K (a record per super-block): d (16 bytes), then 4 chunks of the int8 scales (bytes 4i..4i+3 of chunk c are
 * row i's scales 4c..4c+3), then 48 chunks of its ql and qh bytes as they lie (ql's 128, qh's 64), 4 per lane.
 * IQ4_XS (a record per super-block): d (16 bytes), its scales_l (4 bytes per lane, 32), its scales_h (2 per lane,
 * 16), then 32 chunks of its qs as they lie, 4 bytes per lane (chunk 4s + c: sub-block s's values 4c.. in the low
 * nibbles, 16 + 4c.. in the high ones).
 * Q3_K (a record per super-block): d (16 bytes), its 12 scale bytes in 3 chunks (4 per lane), its hmask in 8 and
 * its qs in 16, as they lie. Q2_K: d, dmin (16 bytes each), its 16 scale bytes in 4 chunks, its qs in 16. */
/* Q4_K's eight 6-bit scales and mins (ggml's 12 bytes at sc12) <-> lane i's bytes of the record's regrouping at o */
static void x8k_scales(uint8_t *sc12, uint8_t *o, const int i, const int unpack) {
    uint8_t *A = o + 32 + i, *B = o + 96 + i, v[16];
    if (!unpack) {
        q4k_scale_bytes(sc12, v); /* scales in v[0..7], mins in v[8..15] */
        for (int t = 0; t < 4; t++) B[8 * t] = 0;
        for (int s = 0; s < 8; s++) {
            A[8 * s] = (uint8_t)((v[s] & 15) | (v[8 + s] & 15) << 4);
            B[8 * (s % 4)] |= (uint8_t)((v[s] >> 4) << (2 * (s / 4)) | (v[8 + s] >> 4) << (4 + 2 * (s / 4)));
        }
        return;
    }
    for (int s = 0; s < 8; s++) {
        v[s] = (uint8_t)((A[8 * s] & 15) | ((B[8 * (s % 4)] >> (2 * (s / 4))) & 3) << 4);
        v[8 + s] = (uint8_t)((A[8 * s] >> 4) | ((B[8 * (s % 4)] >> (4 + 2 * (s / 4))) & 3) << 4);
    }
    for (int j = 0; j < 4; j++) { /* ggml's 12-byte packing (get_scale_min_k4 read backwards) */
        sc12[j] = (uint8_t)(v[j] | (v[j + 4] >> 4) << 6);
        sc12[4 + j] = (uint8_t)(v[8 + j] | (v[12 + j] >> 4) << 6);
        sc12[8 + j] = (uint8_t)((v[j + 4] & 15) | (v[12 + j] & 15) << 4);
    }
}

/* Q5's 32 fifth bits (little-endian at qh) <-> lane i's 4 bytes at bits: bit c of byte k is value 4c + k's */
static void x8_fifth_bits(uint8_t *qh, uint8_t *bits, const int unpack) {
    uint32_t h = unpack ? 0 : le32(qh);
    for (int k = 0; k < 4; k++) {
        if (!unpack) bits[k] = 0;
        for (int c = 0; c < 8; c++) {
            if (unpack) h |= (uint32_t)((bits[k] >> c) & 1) << (4 * c + k);
            else bits[k] |= (uint8_t)(((h >> (4 * c + k)) & 1) << c);
        }
    }
    if (unpack) for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(h >> (8 * k));
}

static void x8_lane(const int base, uint8_t *b, uint8_t *o, const int i, const int unpack) {
    const int two = has_min(base) || is_k45(base); /* d, then m (dmin) */
    const int qh = 2 + 2 * two, qs = base == T_Q4_K ? 16 : base == T_Q5_K ? 48 : qh + (is_q5(base) ? 4 : 0);
#define MOVE(blk, rec, n) (unpack ? memcpy(blk, rec, n) : memcpy(rec, blk, n))
    if (base == T_Q6_K) { /* ql, qh, scales, d in the block */
        MOVE(b + 208, o + 2 * i, 2);
        for (int c = 0; c < 4; c++) MOVE(b + 192 + 4 * c, o + 16 + 32 * c + 4 * i, 4);
        for (int c = 0; c < 48; c++) MOVE(b + 4 * c, o + x8_values(base) + 32 * c + 4 * i, 4);
        return;
    }
    if (base == T_Q3_K || base == T_Q2_K) { /* Q3_K: hmask, qs, scales, d; Q2_K: scales, qs, d, dmin */
        const int q3 = base == T_Q3_K, sc = q3 ? 96 : 0, nsc = q3 ? 3 : 4;
        MOVE(b + (q3 ? 108 : 80), o + 2 * i, 2);
        if (!q3) MOVE(b + 82, o + 16 + 2 * i, 2);
        for (int k = 0; k < nsc; k++) MOVE(b + sc + 4 * k, o + (q3 ? 16 : 32) + 32 * k + 4 * i, 4);
        for (int c = 0; c < 8 * q3; c++) MOVE(b + 4 * c, o + 112 + 32 * c + 4 * i, 4); /* hmask */
        for (int c = 0; c < 16; c++) MOVE(b + (q3 ? 32 : 16) + 4 * c, o + (q3 ? 368 : 160) + 32 * c + 4 * i, 4);
        return;
    }
    if (base == T_IQ4_XS) { /* d, scales_h, scales_l, qs in the block */
        MOVE(b, o + 2 * i, 2);
        MOVE(b + 4, o + 16 + 4 * i, 4);
        MOVE(b + 2, o + 48 + 2 * i, 2);
        for (int c = 0; c < 32; c++) MOVE(b + 8 + 4 * c, o + 64 + 32 * c + 4 * i, 4);
        return;
    }
    MOVE(b, o + 2 * i, 2);
    if (two) MOVE(b + 2, o + 16 + 2 * i, 2);
    for (int c = 0; c < (tbytes(base) - qs) / 4; c++) MOVE(b + qs + 4 * c, o + x8_values(base) + 32 * c + 4 * i, 4);
    if (base == T_Q5_K)
        for (int c = 0; c < 8; c++) MOVE(b + 16 + 4 * c, o + 128 + 32 * c + 4 * i, 4);
#undef MOVE
    if (is_k45(base)) x8k_scales(b + 4, o, i, unpack);
    if (is_q5(base)) x8_fifth_bits(b + qh, o + x8_heads(base) + 4 * i, unpack);
}

/* lane i (< 8) of an x8 group back to its row's blocks */
static void unpack_x8_row(const int base, const uint8_t *group, int i, int64_t K, uint8_t *row) {
    const int tb = tbytes(base);
    for (int64_t j = 0; j < K / tvalues(base); j++) x8_lane(base, row + j * tb, (uint8_t *)group + j * 8 * tb, i, 1);
}

void gg_dequant_rows(int32_t type, const uint8_t *w, int64_t row_stride, const int64_t *rows, int64_t R, int64_t K,
                     void *out, int32_t out_bf16, int num_threads) {
    const size_t esize = out_bf16 ? 2 : 4;
    const int x8 = is_x8(type), base = x8 ? x8_base(type) : type;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) if (R * K > 65536)
    {
        uint8_t *row = x8 ? malloc((size_t)(K / tvalues(base) * tbytes(base))) : NULL;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; r++) {
            const int64_t src = rows ? rows[r] : r;
            const uint8_t *p = w + src * row_stride;
            if (x8 && row != NULL) {
                unpack_x8_row(base, w + (src & ~(int64_t)7) * row_stride, (int)(src & 7), K, row);
                p = row;
            }
            dequant_row_any(base, p, K, (char *)out + (size_t)r * K * esize, out_bf16);
        }
        free(row);
    }
}

/* Rows [rows, K] of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K or IQ4_XS (row stride src_stride, rows % 8 == 0) into the
 * x8 layout at dst (contiguous, the same bytes as the rows): returns the x8 type id, or -1 where this build has no
 * x8 kernel (no AVX2) or the type or shape does not fit (nothing written then). */
int32_t gg_repack_x8(int32_t type, const uint8_t *src, int64_t src_stride, int64_t rows, int64_t K, uint8_t *dst,
                     int num_threads) {
#if defined(__AVX2__)
    if (!is_x8(type + 1000) || rows % 8 || K % tvalues(type)) return -1;
    if (type == T_Q6_K && !X6K_AT_LOAD) return -1;
    const int tb = tbytes(type);
    const int64_t nb = K / tvalues(type), rb = nb * tb;
#pragma omp parallel for schedule(static) num_threads(num_threads > 0 ? num_threads : 1)
    for (int64_t g = 0; g < rows / 8; g++)
        for (int64_t j = 0; j < nb; j++)
            for (int i = 0; i < 8; i++)
                x8_lane(type, (uint8_t *)(src + (g * 8 + i) * src_stride + j * tb), dst + g * 8 * rb + j * 8 * tb, i, 0);
    return type + 1000;
#else
    (void)type; (void)src; (void)src_stride; (void)rows; (void)K; (void)dst; (void)num_threads;
    return -1;
#endif
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
