/* Helpers shared by tokenmill's C kernels (skinny_linear.c, cpu_fused.c, attention/paged_attention.c,
 * decoder_stack.c): 8-lane float vectors through GCC vector extensions (AVX2/AVX-512/NEON via
 * -march=native), bf16 <-> fp32 with torch's rounding, a fixed-order horizontal sum and a vector exp. */
#pragma once
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

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

static inline v8f load8(const float *p) { /* unaligned */
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline v8f load8_bf16(const uint16_t *p) {
#if defined(__AVX2__)
    /* one 256-bit widening load: GCC builds the generic form below from two 128-bit halves and an insert */
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    return (v8f)_mm256_castsi256_ps(u);
#else
    v8u16 h;
    memcpy(&h, p, sizeof h);
    v8u32 u = __builtin_convertvector(h, v8u32) << 16;
    v8f f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* lanes of a where mask (a vector comparison's result) is set, else b */
static inline v8f select8(v8i mask, v8f a, v8f b) {
    v8i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    const v8i r = (ai & mask) | (bi & ~mask);
    v8f f;
    memcpy(&f, &r, sizeof f);
    return f;
}

/* f32_to_bf16 on 8 lanes, as the bits of the rounded value in the high half of each lane */
static inline v8u32 bf16_bits8(v8f v) {
#if defined(__AVX2__)
    /* the same, with an unordered compare for NaN and one blend: GCC's form of the generic code below is a
     * longer dependency chain (an unsigned compare it emulates), which bound the bf16 loops around it */
    const __m256i u = _mm256_castps_si256((__m256)v), hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), hi);
    const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), hi);
    const __m256 nan = _mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q);
    return (v8u32)_mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(nan));
#else
    v8u32 u;
    memcpy(&u, &v, sizeof u);
    const v8u32 nan = (v8u32)((u & 0x7fffffffu) > 0x7f800000u);
    const v8u32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (rounded & ~nan) | (((u >> 16) | 0x40u) << 16 & nan);
#endif
}

static inline void store8_bf16(uint16_t *p, v8f v) {
    const v8u16 h = __builtin_convertvector(bf16_bits8(v) >> 16, v8u16);
    memcpy(p, &h, sizeof h);
}

/* v rounded to bf16 and back (torch's rounding after each bf16 op) */
static inline v8f round8_bf16(v8f v) {
    const v8u32 b = bf16_bits8(v);
    v8f f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* the same tree for every caller: part of the fixed reduction order batch invariance relies on */
static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* hsum8 of eight vectors at once, out[k] = hsum8(a[k]): the same tree, so the same bits. Transposed with two
 * permutes and an add per pair of vectors, then three horizontal adds and one permute: about 2 instructions per
 * vector where hsum8's scalar tail takes ~7 (and a scalar store each). */
static inline v8f hsum8x8(const v8f *a) {
#if defined(__AVX2__)
    __m256 u[4]; /* u[i]: lanes 0-3 a[2i][j] + a[2i][j + 4], lanes 4-7 the same of a[2i + 1] */
    for (int i = 0; i < 4; i++) {
        const __m256 x = (__m256)a[2 * i], y = (__m256)a[2 * i + 1];
        u[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
    /* pairs of those, then the two halves: lanes hold the sums of a[0], a[2], a[4], a[6], a[1], a[3], ... */
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(u[0], u[1]), _mm256_hadd_ps(u[2], u[3]));
    return (v8f)_mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
#else
    v8f r;
    for (int k = 0; k < 8; k++) r[k] = hsum8(a[k]);
    return r;
#endif
}

/* e^x, 8 lanes: libm's expf does not vectorize without -ffast-math. Cody-Waite reduction x = n ln2 + r,
 * |r| <= ln2/2, a degree-6 polynomial for e^r, and 2^n put into the exponent bits: within 2 ulp of expf;
 * 0 below -87.3, clamped above 88.3. */
static inline v8f exp8(v8f x) {
    const v8f lo = (v8f){0} - 87.3f, hi = (v8f){0} + 88.3f;
    x = select8(x < lo, lo, x);
    x = select8(x > hi, hi, x);
    /* round to nearest even, as rintf: adding and removing 1.5 * 2^23 leaves no fraction bits (|x| < 2^22) */
    const v8f magic = (v8f){0} + 12582912.0f;
    const v8f n = (x * 1.44269504088896341f + magic) - magic;
    const v8f r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    v8f p = (v8f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * r) * r + r + 1.0f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
