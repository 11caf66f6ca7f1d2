/* A Llama-family decoder stack for short queries (decode, speculative verification), all layers in one call.
 *
 * Why: a single-stream decode step of a small model spends as long in Python (module calls, views, tensor
 * allocation, ~10 ctypes calls per layer) as in the kernels themselves. This loop runs the same kernels, in
 * the same order, with the same rounding points as the Python layer code (models/llama.py), so its output
 * is bit-identical to it; it only removes the glue. The kernels come in as function pointers from their own
 * libraries (skinny_linear.c, cpu_fused.c, attention/paged_attention.c, quantization/qlinear.c), so each
 * exists once.
 *
 * Activations are in the model's dtype (float32 or bfloat16, `bf16` below). A linear layer takes float32 in
 * and out: in bf16 its input is widened and its output rounded, as panel_linear and the bound int8 kernel
 * (quantization/kernels.py) do in Python. Each linear is the float panel kernel, int8_linear_iq (int8
 * weight-only with 16-bit activations, or w8a8) or gg_linear (ggml block weights: quantization/ggml.c): the
 * call the Python layer would make for these rows.
 *
 * LoRA adapters (layers/lora.py), float32 models only: a linear with a `lora_t` adds, for each token whose
 * `lora_slot` is not -1, x A_s^T B_s^T of its own slot s after the layer's kernel (per token: no work for other
 * slots). Same values as the Python path's masked matmuls up to summation order, not bit-identical.
 */
#include "cpu_vec.h"

typedef void (*linear_fn)(const float *x, const void *wp, const float *bias, float *y, int64_t M, int64_t N,
                          int64_t K, int num_threads);
typedef void (*int8_fn)(const float *x, int64_t M, int32_t qmax, const int8_t *w, const float *w_scale, int64_t N,
                        int64_t K, const float *bias, float *y, int num_threads);
typedef void (*blocks_fn)(const float *x, int64_t M, const void *parts, int32_t nparts, int64_t N, int64_t K,
                          const float *bias, float *y, int num_threads);
typedef void (*norm_fn)(const void *x, const void *residual, void *res_out, const void *w, void *out, int64_t T,
                        int64_t H, float eps, int num_threads);
typedef void (*silu_fn)(const void *x, void *out, int64_t T, int64_t I, int num_threads);
typedef void (*rope_fn)(void *x, int64_t x_stride, const int64_t *positions, const float *cos_t,
                        const float *sin_t, int64_t T, int64_t H, int64_t D, int num_threads);
typedef void (*attn_fn)(const void *q, const void *k_cache, const void *v_cache, void *out,
                        const int32_t *block_table, int64_t bt_stride, const int32_t *req_of,
                        const int32_t *kv_start, const int32_t *kv_end, int64_t num_tokens, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t head_stride, int64_t block_size,
                        float scale, int num_threads, const float *lut, const float *k_scale,
                        const float *v_scale, const float *sinks);
typedef int (*write_kv_fn)(const char *k, int64_t k_row_bytes, const char *v, int64_t v_row_bytes, char *cache,
                           int64_t T, int64_t num_kv_heads, int64_t head_bytes, int64_t cache_head_bytes,
                           const int64_t *slots);

enum { LINEAR_PANEL = 0, LINEAR_INT8 = 1, LINEAR_BLOCKS = 2 };

typedef struct {
    const float *a;         /* [max_loras, parts, rank, K] */
    const float *b[3];      /* per merged part: [max_loras, rank, part_n], scaling folded in */
    int64_t part_n[3];
    const uint8_t *present; /* [max_loras, parts]: the slot's adapter has this part (else its A, B are zero) */
    int32_t parts, rank, max_loras;
} lora_t;

typedef struct {
    const void *fn;     /* linear_fn (LINEAR_PANEL), int8_fn (LINEAR_INT8) or blocks_fn (LINEAR_BLOCKS) */
    const void *w;      /* panels, int8 [N, K], or the gg_part_t array */
    const float *bias;  /* float32 or NULL */
    const float *scale; /* LINEAR_INT8: the weight's per-row scales */
    int64_t N, K;
    int32_t kind, qmax; /* qmax: LINEAR_INT8's activation grid (32767 weight-only, 127 w8a8); LINEAR_BLOCKS:
                         * the number of parts */
    const lora_t *lora; /* the layer's adapter slots, or NULL */
} linear_t;

typedef struct {
    const void *norm1, *norm2, *q_norm, *k_norm; /* q_norm/k_norm NULL unless the model has them */
    linear_t qkv, o, gate_up, down;
    char *kv_cache; /* [2, Hkv, num_slots, D] */
} layer_t;

typedef struct {
    int64_t num_layers, H, Hq, Hkv, D, I, block_size, num_slots;
    float eps, scale;
    int bf16;
    const float *cos_t, *sin_t;
    const void *final_norm;
    norm_fn norm;
    silu_fn silu;
    rope_fn rope;
    attn_fn attn;
    write_kv_fn write_kv;
    const layer_t *layers;
} stack_t;

/* per-step inputs: query tokens, their positions and slots, and the attention plan (attention/cpu.py) */
typedef struct {
    int64_t M, bt_stride;
    const int64_t *positions, *slots;
    const int32_t *block_table, *req_of, *kv_start, *kv_end;
    const int32_t *lora_slot; /* [M]: each token's adapter slot, -1 for the base model; NULL: no adapter */
} step_t;

static void linear_f32(const linear_t *l, const float *x, float *y, int64_t M, int nt) {
    if (l->kind == LINEAR_INT8)
        ((int8_fn)l->fn)(x, M, l->qmax, l->w, l->scale, l->N, l->K, l->bias, y, nt);
    else if (l->kind == LINEAR_BLOCKS)
        ((blocks_fn)l->fn)(x, M, l->w, l->qmax, l->N, l->K, l->bias, y, nt);
    else
        ((linear_fn)l->fn)(x, l->w, l->bias, y, M, l->N, l->K, nt);
}

/* h[0..R) = rows of a [R, K] dotted with x, four rows at a time (independent sums) */
static void shrink_rows(const float *x, const float *a, float *h, int64_t R, int64_t K) {
    int64_t i = 0;
    for (; i + 4 <= R; i += 4) {
        const float *a0 = a + i * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
        for (int64_t k = 0; k < K; k++) s0 += x[k] * a0[k], s1 += x[k] * a1[k], s2 += x[k] * a2[k], s3 += x[k] * a3[k];
        h[i] = s0, h[i + 1] = s1, h[i + 2] = s2, h[i + 3] = s3;
    }
    for (; i < R; i++) {
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; k++) acc += x[k] * a[i * K + k];
        h[i] = acc;
    }
}

/* y[t] += (x[t] A_s^T) B_s^T for each token t with slot s >= 0, each merged part from its own B (parts the
 * slot's adapter lacks are skipped). Tokens run grouped by slot, so a slot's A and B stay in cache from one of
 * its tokens to the next (all slots' weights of all layers are far more than the cache); they are handed out
 * dynamically: a descheduled thread holds up one token's work, not half of it. */
static void lora_add(const lora_t *L, const float *x, float *y, int64_t M, int64_t K, int64_t N,
                     const int32_t *slot, int nt) {
    const int64_t P = L->parts, R = L->rank, ML = L->max_loras;
    int64_t next[ML + 1], order[M > 0 ? M : 1], n_rows = 0; /* adapter tokens, slot by slot (counting sort) */
    memset(next, 0, sizeof next);
    for (int64_t t = 0; t < M; t++) next[slot[t] + 1] += slot[t] >= 0;
    for (int64_t s = 0; s < ML; s++) next[s + 1] += next[s];
    for (int64_t t = 0; t < M; t++)
        if (slot[t] >= 0) order[next[slot[t]]++] = t, n_rows++;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int64_t i = 0; i < n_rows; i++) {
        const int64_t t = order[i], s = slot[t];
        float h[R];
        float *yt = y + t * N;
        for (int64_t p = 0; p < P; yt += L->part_n[p], p++) {
            if (!L->present[s * P + p]) continue;
            shrink_rows(x + t * K, L->a + (s * P + p) * R * K, h, R, K);
            const int64_t n = L->part_n[p];
            const float *b = L->b[p] + s * R * n;
            for (int64_t r = 0; r < R; r++) {
                const float hr = h[r], *br = b + r * n;
#pragma omp simd
                for (int64_t j = 0; j < n; j++) yt[j] += hr * br[j];
            }
        }
    }
}

/* bf16 <-> float32 around a float kernel, 8 lanes at a time, and from 64K elements (a batched step's gate/up
 * output: 32 x 9728 on a 0.5B model) on all threads, which would otherwise wait for this one at the next kernel */
#define CONVERT_PARALLEL_MIN 65536
static void widen_bf16(const uint16_t *x, float *y, int64_t n, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (n >= CONVERT_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i += 8)
        if (i + 8 <= n) store8(y + i, load8_bf16(x + i));
        else for (int64_t k = i; k < n; k++) y[k] = bf16_to_f32(x[k]);
}
static void narrow_bf16(const float *x, uint16_t *y, int64_t n, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (n >= CONVERT_PARALLEL_MIN)
    for (int64_t i = 0; i < n; i += 8)
        if (i + 8 <= n) store8_bf16(y + i, load8(x + i));
        else for (int64_t k = i; k < n; k++) y[k] = f32_to_bf16(x[k]);
}

static void linear(const stack_t *s, const linear_t *l, const void *x, void *y, int64_t M, float *fx, float *fy,
                   const int32_t *lora_slot, int nt) {
    if (!s->bf16) {
        linear_f32(l, x, y, M, nt);
        if (l->lora && lora_slot) lora_add(l->lora, x, y, M, l->K, l->N, lora_slot, nt);
        return;
    }
    widen_bf16(x, fx, M * l->K, nt);
    linear_f32(l, fx, fy, M, nt);
    narrow_bf16(fy, y, M * l->N, nt);
}

/* rows [M, n*D] of a wider matrix (row stride `stride` elements) into a dense [M, n*D] buffer */
static void gather_rows(char *dst, const char *src, int64_t M, int64_t row_bytes, int64_t stride_bytes) {
    for (int64_t t = 0; t < M; t++) memcpy(dst + t * row_bytes, src + t * stride_bytes, (size_t)row_bytes);
}

static inline int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* the widest input and output of the stack's linear layers (float32 staging in bf16) */
static int64_t widest_in(const stack_t *s) { return max3(s->H, s->I, s->Hq * s->D); }
static int64_t widest_out(const stack_t *s) { return max3(s->H, 2 * s->I, (s->Hq + 2 * s->Hkv) * s->D); }

/* Scratch sizes for M tokens: `act` elements of the model dtype, `f32` floats. */
void decoder_stack_scratch(const stack_t *s, int64_t M, int64_t *act, int64_t *f32) {
    const int64_t qkv_n = (s->Hq + 2 * s->Hkv) * s->D, q_n = s->Hq * s->D;
    *act = M * (3 * s->H + qkv_n + 2 * q_n + s->Hkv * s->D + 3 * s->I);
    *f32 = s->bf16 ? M * (widest_in(s) + widest_out(s)) : 0;
}

/* x [M, H]: the embedded tokens (overwritten); out [M, H]: the final-normed hidden states. Returns 0, or -1
 * when a KV slot lies outside the cache (nothing of that layer's KV written). */
int decoder_stack_run(const stack_t *s, const step_t *st, void *x, void *out, void *act, float *f32, int nt) {
    const int64_t M = st->M, H = s->H, D = s->D, es = s->bf16 ? 2 : 4;
    const int64_t q_n = s->Hq * D, kv_n = s->Hkv * D, qkv_n = q_n + 2 * kv_n;
    char *a = act;
    char *res = a, *h = res + M * H * es, *o = h + M * H * es, *qkv = o + M * H * es;
    char *q = qkv + M * qkv_n * es, *att = q + M * q_n * es, *k = att + M * q_n * es, *gu = k + M * kv_n * es;
    char *mid = gu + M * 2 * s->I * es;
    float *fx = f32, *fy = f32 ? f32 + M * widest_in(s) : 0;
    for (int64_t li = 0; li < s->num_layers; li++) {
        const layer_t *L = &s->layers[li];
        if (li == 0) {
            memcpy(res, x, (size_t)(M * H * es));
            s->norm(x, 0, 0, L->norm1, h, M, H, s->eps, nt);
        } else {
            s->norm(x, res, res, L->norm1, h, M, H, s->eps, nt);
        }
        linear(s, &L->qkv, h, qkv, M, fx, fy, st->lora_slot, nt);
        /* q into its own dense buffer (the attention kernel reads dense rows), k too when it gets normed */
        gather_rows(q, qkv, M, q_n * es, qkv_n * es);
        const char *kp = qkv + q_n * es;
        int64_t k_stride = qkv_n;
        if (L->q_norm) {
            gather_rows(k, kp, M, kv_n * es, qkv_n * es);
            s->norm(q, 0, 0, L->q_norm, q, M * s->Hq, D, s->eps, nt);
            s->norm(k, 0, 0, L->k_norm, k, M * s->Hkv, D, s->eps, nt);
            kp = k;
            k_stride = kv_n;
        }
        s->rope(q, q_n, st->positions, s->cos_t, s->sin_t, M, s->Hq, D, nt);
        s->rope((void *)kp, k_stride, st->positions, s->cos_t, s->sin_t, M, s->Hkv, D, nt);
        if (s->write_kv(kp, k_stride * es, qkv + (q_n + kv_n) * es, qkv_n * es, L->kv_cache, M, s->Hkv, D * es,
                        s->num_slots * D * es, st->slots))
            return -1;
        const char *kc = L->kv_cache, *vc = kc + s->Hkv * s->num_slots * D * es;
        s->attn(q, kc, vc, att, st->block_table, st->bt_stride, st->req_of, st->kv_start, st->kv_end, M, s->Hq,
                s->Hkv, D, s->num_slots * D, s->block_size, s->scale, nt, 0, 0, 0, 0); /* no sinks */
        linear(s, &L->o, att, o, M, fx, fy, st->lora_slot, nt);
        s->norm(o, res, res, L->norm2, h, M, H, s->eps, nt);
        linear(s, &L->gate_up, h, gu, M, fx, fy, st->lora_slot, nt);
        s->silu(gu, mid, M, s->I, nt);
        linear(s, &L->down, mid, x, M, fx, fy, st->lora_slot, nt);
    }
    s->norm(x, res, res, s->final_norm, out, M, H, s->eps, nt);
    return 0;
}
