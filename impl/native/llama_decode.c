/* The native CPU decode kernel: the Llama decoder layers, final norm and head for a single row
 * (batch 1, one token), float32.
 *
 * decodespec.impl.native builds this file with the system C compiler and calls it through
 * ctypes; that module documents the contract.  Every pointer is a contiguous float32 buffer
 * owned by the caller (torch tensors); nothing is allocated here and nothing can fail.
 * Threads: one OpenMP parallel region per call, in the libgomp torch already loaded (the
 * library is linked against the soname libgomp.so.1, which the loader resolves to the copy in
 * the process), with `threads` = torch.get_num_threads().  Matrix-vector products are split
 * by rows, so every output element is one thread's sum in a fixed order: results do not depend
 * on the thread count.
 *
 * Source: the operation order of decodespec.impl.model (HF LlamaDecoderLayer): pre-norm
 * RMSNorm, fused q/k/v projection, rotate-half RoPE (`x * cos + swap_halves(x) * signed_sin`),
 * the rotated key and the value written to the static cache slot before attention reads it
 * (M3.10 0x09), softmax over every slot with the additive mask of build_attention_mask,
 * o_proj + residual, RMSNorm, fused gate/up, silu(gate) * up, down_proj + residual.
 * Elementwise code is compiled with -ffp-contract=off so it rounds as torch's separate
 * operations do; the reductions (dot products, softmax sums) use their own order.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, capacity;
    float eps, scale;
} Dims;

typedef struct {
    const float *input_norm;  /* [d] */
    const float *qkv;         /* [(H + 2 H_kv) D, d] */
    const float *o_proj;      /* [d, H D] */
    const float *post_norm;   /* [d] */
    const float *gate_up;     /* [2 F, d] */
    const float *down;        /* [d, F] */
} Layer;

typedef struct {
    float *xn;      /* [d] */
    float *qkv;     /* [(H + 2 H_kv) D] */
    float *attn;    /* [H D] */
    float *gu;      /* [2 F] */
    float *act;     /* [F] */
    float *scores;  /* [H, S] */
} Scratch;

static inline float hsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static inline float dot(const float *w, const float *x, int n) {
    int c = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; c + 16 <= n; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
    }
    for (; c + 8 <= n; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
    float acc = hsum(_mm256_add_ps(a0, a1));
    for (; c < n; c++) acc += w[c] * x[c];
    return acc;
}

/* y[0..3] = rows 0..3 of w (row stride `stride`) dotted with x. */
static inline void dot4(const float *w, size_t stride, const float *x, int n, float *y) {
    int c = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) {
        __m256 xv = _mm256_loadu_ps(x + c);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + stride + c), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * stride + c), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * stride + c), xv, a3);
    }
    float out[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
    for (; c < n; c++) {
        out[0] += w[c] * x[c];
        out[1] += w[stride + c] * x[c];
        out[2] += w[2 * stride + c] * x[c];
        out[3] += w[3 * stride + c] * x[c];
    }
    y[0] = out[0]; y[1] = out[1]; y[2] = out[2]; y[3] = out[3];
}

/* Inside a parallel region: y = W x with W row-major [rows, n]; ends with a barrier. */
static void gemv_rows(const float *W, const float *x, float *y, int rows, int n) {
    const int blocks = rows / 4;
    #pragma omp for schedule(static) nowait
    for (int b = 0; b < blocks; b++) dot4(W + (size_t)4 * b * n, (size_t)n, x, n, y + 4 * b);
    #pragma omp single nowait
    for (int r = 4 * blocks; r < rows; r++) y[r] = dot(W + (size_t)r * n, x, n);
    #pragma omp barrier
}

/* y = w * (x * (1 / sqrt(mean(x^2) + eps))): LlamaRMSNorm's order (torch.rsqrt is 1/sqrt). */
static void rmsnorm(const float *x, const float *w, float *y, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* x [D] <- x * cos + swap_halves(x) * signed_sin (rotate_heads). */
static void rope(float *x, const float *cos_row, const float *signed_sin, int dim) {
    const int half = dim / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos_row[i] + b * signed_sin[i];
        x[i + half] = b * cos_row[i + half] + a * signed_sin[i + half];
    }
}

/* Inside a parallel region: one decoder layer for one row, h_out = layer(h_in) (distinct buffers);
 * writes the rotated key and the value of this row to slot `slot` of k_cache / v_cache
 * ([H_kv, S, D] each) before attention.  mask: [S] additive (0 visible, finfo.min hidden) or
 * NULL (every slot visible).  Ends with a barrier. */
static void layer_body(const Layer *w, const Dims *dm, const float *h_in, float *h_out,
                       const float *cos_row, const float *signed_sin, int32_t slot, const float *mask,
                       float *k_cache, float *v_cache, Scratch *s) {
    const int d = dm->hidden, H = dm->heads, Hkv = dm->kv_heads, D = dm->head_dim, F = dm->inter, S = dm->capacity;
    const int rep = H / Hkv;
    #pragma omp single
    rmsnorm(h_in, w->input_norm, s->xn, d, dm->eps);
    gemv_rows(w->qkv, s->xn, s->qkv, (H + 2 * Hkv) * D, d);
    #pragma omp single
    {
        for (int hd = 0; hd < H + Hkv; hd++) rope(s->qkv + hd * D, cos_row, signed_sin, D);
        for (int g = 0; g < Hkv; g++) {
            const float *k = s->qkv + (H + g) * D, *v = s->qkv + (H + Hkv + g) * D;
            float *kc = k_cache + ((size_t)g * S + slot) * D, *vc = v_cache + ((size_t)g * S + slot) * D;
            for (int i = 0; i < D; i++) { kc[i] = k[i]; vc[i] = v[i]; }
        }
    }
    #pragma omp for schedule(static)
    for (int hq = 0; hq < H; hq++) {
        const int g = hq / rep;
        const float *q = s->qkv + hq * D;
        const float *kc = k_cache + (size_t)g * S * D, *vc = v_cache + (size_t)g * S * D;
        float *sc = s->scores + (size_t)hq * S, mx = -INFINITY, sum = 0.0f;
        for (int j = 0; j < S; j++) {
            sc[j] = dot(kc + (size_t)j * D, q, D) * dm->scale + (mask ? mask[j] : 0.0f);
            if (sc[j] > mx) mx = sc[j];
        }
        for (int j = 0; j < S; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
        float *out = s->attn + hq * D;
        for (int i = 0; i < D; i++) out[i] = 0.0f;
        for (int j = 0; j < S; j++) {
            if (sc[j] == 0.0f) continue;  /* a hidden slot: exp underflowed to exactly zero weight */
            const float p = sc[j] / sum, *v = vc + (size_t)j * D;
            for (int i = 0; i < D; i++) out[i] += p * v[i];
        }
    }
    gemv_rows(w->o_proj, s->attn, h_out, d, H * D);
    #pragma omp single
    {
        for (int i = 0; i < d; i++) h_out[i] = h_in[i] + h_out[i];
        rmsnorm(h_out, w->post_norm, s->xn, d, dm->eps);
    }
    gemv_rows(w->gate_up, s->xn, s->gu, 2 * F, d);
    #pragma omp for schedule(static)
    for (int i = 0; i < F; i++) {
        const float g = s->gu[i];
        s->act[i] = (g / (1.0f + expf(-g))) * s->gu[F + i];
    }
    gemv_rows(w->down, s->act, s->xn, d, F);
    #pragma omp single
    for (int i = 0; i < d; i++) h_out[i] = h_out[i] + s->xn[i];
}

/* Layers 0..n-1 for one row in one parallel region: hidden [2, d] holds the input in row 0 on
 * entry; layer l reads row l % 2 and writes row (l + 1) % 2, so the output is row n % 2.
 * k_caches / v_caches: one [H_kv, S, D] buffer per layer.  With final_norm (else NULL) the
 * last output is normalised into row (n + 1) % 2; with head [vocab, d] (else NULL) the logits
 * of that normalised row are written to logits [vocab]. */
void decodespec_layers(const Layer *layers, int32_t n, const Dims *dm, float *hidden,
                       const float *cos_row, const float *signed_sin, int32_t slot, const float *mask,
                       float *const *k_caches, float *const *v_caches, Scratch *s, int32_t threads,
                       const float *final_norm, const float *head, int32_t vocab, float *logits) {
    const int d = dm->hidden;
    float *last = hidden + (size_t)(n % 2) * d, *normed = hidden + (size_t)((n + 1) % 2) * d;
    #pragma omp parallel num_threads(threads)
    {
        for (int l = 0; l < n; l++)
            layer_body(&layers[l], dm, hidden + (size_t)(l % 2) * d, hidden + (size_t)((l + 1) % 2) * d, cos_row, signed_sin, slot,
                       mask, k_caches[l], v_caches[l], s);
        if (final_norm) {
            #pragma omp single
            rmsnorm(last, final_norm, normed, d, dm->eps);
            if (head) gemv_rows(head, normed, logits, vocab, d);
        }
    }
}
