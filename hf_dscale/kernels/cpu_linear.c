/* y = x @ w.T (+ b) in float32 for the few rows of a verify, on x86-64 with AVX-512F or AVX2 + FMA.
 *
 * A verify multiplies 2-16 token rows by every weight matrix of the target. That product is bound by reading the
 * weights, as a one-token step is, but MKL's SGEMM at 4-16 rows takes up to twice as long as at one (measured on a
 * 2-core Xeon). Here each weight row is read from memory once and used against every token row while it is in
 * cache: y[m, n] is the dot product of x row m and w row n (w is [N, K], as nn.Linear stores it).
 *
 * Work unit: a tile of TILE_N weight rows (n) x 4 token rows (m), its dot products held in vector accumulators over
 * K: 4 x 4 in 16-float vectors with AVX-512F, 4 x 2 in 8-float vectors with AVX2 (which has half the registers).
 * The token rows of all m tiles stay in L1/L2 across the n tiles; the weight rows two tiles ahead are prefetched into
 * L2, spread over the current tile's steps, so the stream from memory overlaps the arithmetic. Threads split
 * the n tiles (OpenMP, the runtime torch itself links on Linux). Summation order differs from MKL's, as MKL's own
 * order differs between widths.
 */
#include <immintrin.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <string.h>

/* y = v, or y += v where the product adds into its output (a residual stream). */
static inline void store(float *y, float v, int accumulate) { *y = accumulate ? *y + v : v; }

#if defined(__AVX512F__)
#define TILE_N 4
#define VEC 16  /* floats per vector */

/* The 16 horizontal sums of a[4][4] in one vector (a transpose-and-add tree); lane order is `sum_lanes`. */
static inline __m512 sum16(__m512 a[4][4]) {
    const __m512 *v = &a[0][0];
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

/* Lane p of sum16's result holds the sum of a[i][j] with 4 * i + j = lanes[p]; UNPERMUTE undoes that order (set
 * when the library loads). */
static int32_t UNPERMUTE[16];

__attribute__((constructor)) static void sum_lanes(void) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            float one[16] = {0};
            one[0] = (float)(4 * i + j);
            a[i][j] = _mm512_loadu_ps(one);
        }
    float out[16];
    _mm512_storeu_ps(out, sum16(a));
    for (int p = 0; p < 16; p++) UNPERMUTE[(int)out[p]] = p;
}

/* Rows m0..m0+3 of x against rows n0..n0+nr-1 of w into y (+ bias). Rows past the ends repeat the last row and are
 * not stored. Each step of 16 k also prefetches `per_step` cache lines at *prefetch (up to `prefetch_end`). */
static inline void tile(const float *x, int64_t ldx, const float *w, const float *bias, int64_t K, float *y,
                        int64_t ldy, int64_t M, int64_t m0, int64_t n0, int64_t nr,
                        const char **prefetch, const char *prefetch_end, int64_t per_step, int accumulate) {
    const float *xr[4], *wr[4];
    for (int i = 0; i < 4; i++) xr[i] = x + (m0 + i < M ? m0 + i : M - 1) * ldx;
    for (int j = 0; j < 4; j++) wr[j] = w + (n0 + (j < nr ? j : nr - 1)) * K;
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t whole = K & ~(int64_t)15;
    const char *p = *prefetch;
    for (int64_t k = 0; k < whole; k += 16) {
        for (int64_t s = 0; s < per_step; s++, p += 64)
            if (p < prefetch_end) _mm_prefetch(p, _MM_HINT_T1);
        const __m512 w0 = _mm512_loadu_ps(wr[0] + k), w1 = _mm512_loadu_ps(wr[1] + k);
        const __m512 w2 = _mm512_loadu_ps(wr[2] + k), w3 = _mm512_loadu_ps(wr[3] + k);
        for (int i = 0; i < 4; i++) {
            const __m512 xv = _mm512_loadu_ps(xr[i] + k);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    if (whole < K) {  /* the last K % 16 columns, masked */
        const __mmask16 mask = (__mmask16)((1u << (K - whole)) - 1u);
        __m512 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm512_maskz_loadu_ps(mask, wr[j] + whole);
        for (int i = 0; i < 4; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[i] + whole);
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    *prefetch = p;
    float sums[16];
    _mm512_storeu_ps(sums, _mm512_permutexvar_ps(_mm512_loadu_si512(UNPERMUTE), sum16(acc)));
    for (int i = 0; i < 4 && m0 + i < M; i++)
        for (int j = 0; j < nr; j++)
            store(y + (m0 + i) * ldy + n0 + j, bias ? sums[4 * i + j] + bias[n0 + j] : sums[4 * i + j], accumulate);
}

#else /* AVX2 + FMA */
#define TILE_N 2
#define VEC 8

/* The 8 horizontal sums of a[4][2], in the order a[0][0], a[0][1], a[1][0], ... */
static inline __m256 sum8(__m256 a[4][2]) {
    const __m256 t0 = _mm256_hadd_ps(a[0][0], a[0][1]), t1 = _mm256_hadd_ps(a[1][0], a[1][1]);
    const __m256 t2 = _mm256_hadd_ps(a[2][0], a[2][1]), t3 = _mm256_hadd_ps(a[3][0], a[3][1]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  /* halves' sums of a0..3, a4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline void tile(const float *x, int64_t ldx, const float *w, const float *bias, int64_t K, float *y,
                        int64_t ldy, int64_t M, int64_t m0, int64_t n0, int64_t nr,
                        const char **prefetch, const char *prefetch_end, int64_t per_step, int accumulate) {
    const float *xr[4], *wr[2];
    for (int i = 0; i < 4; i++) xr[i] = x + (m0 + i < M ? m0 + i : M - 1) * ldx;
    for (int j = 0; j < 2; j++) wr[j] = w + (n0 + (j < nr ? j : nr - 1)) * K;
    __m256 acc[4][2];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t whole = K & ~(int64_t)7;
    const char *p = *prefetch;
    for (int64_t k = 0; k < whole; k += 8) {
        for (int64_t s = 0; s < per_step; s++, p += 64)
            if (p < prefetch_end) _mm_prefetch(p, _MM_HINT_T1);
        const __m256 w0 = _mm256_loadu_ps(wr[0] + k), w1 = _mm256_loadu_ps(wr[1] + k);
        for (int i = 0; i < 4; i++) {
            const __m256 xv = _mm256_loadu_ps(xr[i] + k);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    if (whole < K) {  /* the last K % 8 columns, masked */
        int32_t lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = l < K - whole ? -1 : 0;
        const __m256i mask = _mm256_loadu_si256((const __m256i *)lanes);
        const __m256 w0 = _mm256_maskload_ps(wr[0] + whole, mask), w1 = _mm256_maskload_ps(wr[1] + whole, mask);
        for (int i = 0; i < 4; i++) {
            const __m256 xv = _mm256_maskload_ps(xr[i] + whole, mask);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    *prefetch = p;
    float sums[8];
    _mm256_storeu_ps(sums, sum8(acc));
    for (int i = 0; i < 4 && m0 + i < M; i++)
        for (int j = 0; j < nr; j++)
            store(y + (m0 + i) * ldy + n0 + j, bias ? sums[2 * i + j] + bias[n0 + j] : sums[2 * i + j], accumulate);
}
#endif

/* Tile t of w [N, K] (TILE_N rows each): every 4-row group of x against it, prefetching the tile after next. */
static inline void column_tile(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
                               int64_t M, int64_t N, int64_t K, int64_t t, int64_t per_step, int accumulate) {
    const char *end = (const char *)(w + N * K);
    const int64_t n0 = TILE_N * t, nr = N - n0 < TILE_N ? N - n0 : TILE_N;
    const int64_t ahead = n0 + 2 * TILE_N;  /* the tile after next */
    const char *prefetch = ahead < N ? (const char *)(w + ahead * K) : end;
    for (int64_t m0 = 0; m0 < M; m0 += 4)
        tile(x, ldx, w, bias, K, y, ldy, M, m0, n0, nr, &prefetch, end, per_step, accumulate);
}

static inline int64_t prefetch_per_step(int64_t M, int64_t K) {
    const int64_t steps = ((M + 3) / 4) * ((K + VEC - 1) / VEC);
    const int64_t lines = (TILE_N * K * (int64_t)sizeof(float) + 63) / 64;  /* cache lines of one tile of w */
    return (lines + steps - 1) / steps;
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w [N, K].T + bias [N] (or NULL), on `threads` threads;
 * `accumulate`: y += instead of y =. */
void hf_dscale_linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K, int threads, int accumulate) {
    const int64_t tiles = (N + TILE_N - 1) / TILE_N, per_step = prefetch_per_step(M, K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++)
        column_tile(x, ldx, w, bias, y, ldy, M, N, K, t, per_step, accumulate);
}

/* The products of one x with `count` weights in one parallel pass (a layer's q, k and v, or its gate and up):
 * y[i] [M, N[i]] (row stride ldy) = x @ w[i].T + bias[i]. The threads split all the weights' tiles together. */
void hf_dscale_linear_many_f32(const float *x, int64_t ldx, int count, const float *const *w,
                               const float *const *bias, float *const *y, int64_t ldy, const int64_t *N, int64_t M,
                               int64_t K, int threads) {
    int64_t first[9] = {0};  /* first[i]: matrix i's first tile in the joint numbering (count <= 8) */
    for (int i = 0; i < count; i++) first[i + 1] = first[i] + (N[i] + TILE_N - 1) / TILE_N;
    const int64_t per_step = prefetch_per_step(M, K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < first[count]; t++) {
        int i = 0;
        while (t >= first[i + 1]) i++;
        column_tile(x, ldx, w[i], bias[i], y[i], ldy, M, N[i], K, t - first[i], per_step, 0);
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * The rest of a Llama-style decoder layer between its products, for `engine/direct_forward.py`: RMS norms, the
 * rotary embedding, attention over the cache with an additive mask, and SiLU(gate) * up. Plain loops the compiler
 * vectorizes (each lane its own sum), so their sums run in another order than torch's, as the products' do. */

/* e^x for x in [-87, 88] (clamped there; below -87 the result is 0): 2^n * p(r), x = n ln 2 + r, |r| <= ln 2 / 2,
 * p the degree-7 Taylor polynomial of e^r (relative error under 1e-8 before rounding). */
static inline float exp_f32(float x) {
    const float below = x < -87.0f;
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return below ? 0.0f : p * scale;
}

/* The sum and the largest of x[0..n), in 16 lanes the compiler vectorizes. */
static inline float sum_f32(const float *x, int64_t n) {
    float lanes[16] = {0}, sum = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[i + l];
    for (; i < n; i++) lanes[i % 16] += x[i];
    for (int l = 0; l < 16; l++) sum += lanes[l];
    return sum;
}

static inline float max_f32(const float *x, int64_t n) {
    float lanes[16], top = -INFINITY;
    for (int l = 0; l < 16; l++) lanes[l] = -INFINITY;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    for (int l = 0; l < 16; l++) top = lanes[l] > top ? lanes[l] : top;
    return top;
}

/* out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps) for `rows` rows of n (row strides ldx, ldo). */
void hf_dscale_rms_norm_f32(const float *x, int64_t ldx, const float *w, float eps, float *out, int64_t ldo,
                            int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * ldo;
        float lanes[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += xr[i + l] * xr[i + l];
        for (; i < n; i++) lanes[i % 16] += xr[i] * xr[i];
        float sum = 0.0f;
        for (int l = 0; l < 16; l++) sum += lanes[l];
        const float scale = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = w[i] * (xr[i] * scale);
    }
}

/* The rotary embedding in place on `heads` heads of d floats in each of `rows` rows (row stride ld; heads side by
 * side): x * cos + rotate_half(x) * sin, cos and sin [rows, d]; with `norm_w` (or NULL) each head is first
 * RMS-normed over its d floats (Qwen3's q_norm / k_norm). */
void hf_dscale_rope_f32(float *x, int64_t ld, int64_t rows, int64_t heads, int64_t d, const float *cos_,
                        const float *sin_, const float *norm_w, float eps) {
    const int64_t half = d / 2;
    float tmp[512];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * ld + h * d;
            if (norm_w) hf_dscale_rms_norm_f32(v, d, norm_w, eps, v, d, 1, d);
            const float *c = cos_ + r * d, *s = sin_ + r * d;
            for (int64_t i = 0; i < half; i++) tmp[i] = v[i] * c[i] - v[i + half] * s[i];
            for (int64_t i = half; i < d; i++) tmp[i] = v[i] * c[i] + v[i - half] * s[i];
            memcpy(v, tmp, d * sizeof(float));
        }
}

/* o[i] = inverse[i] * sum_j p[i, j] v[j] for the Q rows of p [Q, L] (row stride L) and v [L, d] (rows of d),
 * o rows of stride ldo. With AVX-512 and d a multiple of 64, 4 rows x 64 floats are held in 16 accumulators
 * while the value rows stream past once per 4 rows. */
static void mix_values(const float *p, int64_t L, int64_t Q, const float *v, int64_t d, float *o, int64_t ldo,
                       const float *inverse) {
#if defined(__AVX512F__)
    if (d % 64 == 0) {
        for (int64_t i0 = 0; i0 < Q; i0 += 4)
            for (int64_t e0 = 0; e0 < d; e0 += 64) {
                const float *pr[4];
                for (int r = 0; r < 4; r++) pr[r] = p + (i0 + r < Q ? i0 + r : Q - 1) * L;
                __m512 acc[4][4];
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
                for (int64_t j = 0; j < L; j++) {
                    const float *vr = v + j * d + e0;
                    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                    const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
                    for (int r = 0; r < 4; r++) {
                        const __m512 pj = _mm512_set1_ps(pr[r][j]);
                        acc[r][0] = _mm512_fmadd_ps(pj, v0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(pj, v1, acc[r][1]);
                        acc[r][2] = _mm512_fmadd_ps(pj, v2, acc[r][2]);
                        acc[r][3] = _mm512_fmadd_ps(pj, v3, acc[r][3]);
                    }
                }
                for (int r = 0; r < 4 && i0 + r < Q; r++) {
                    const __m512 scale = _mm512_set1_ps(inverse[i0 + r]);
                    for (int c = 0; c < 4; c++)
                        _mm512_storeu_ps(o + (i0 + r) * ldo + e0 + 16 * c, _mm512_mul_ps(acc[r][c], scale));
                }
            }
        return;
    }
#endif
    for (int64_t i = 0; i < Q; i++) {
        float *oi = o + i * ldo;
        for (int64_t e = 0; e < d; e++) oi[e] = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            const float pj = p[i * L + j];
            for (int64_t e = 0; e < d; e++) oi[e] += pj * v[j * d + e];
        }
        for (int64_t e = 0; e < d; e++) oi[e] *= inverse[i];
    }
}

/* out[b, i, h*d : (h+1)*d] = softmax(q_bih . k_bg^T * scale + mask[b, i]) v_bg for every row b, query i and head h,
 * g = h / (heads / kv_heads). q: element strides (qb, qi, qh), d contiguous; k and v: rows of d contiguous floats,
 * strides (kb, kh) per row b and kv head, L keys each; mask: additive, strides (mb, mi), L contiguous; out:
 * strides (ob, oi), heads side by side. `scores`: room for threads * Q * (L + 1) floats. */
void hf_dscale_attention_f32(const float *q, int64_t qb, int64_t qi, int64_t qh, const float *k, const float *v,
                             int64_t kb, int64_t kh, const float *mask, int64_t mb, int64_t mi, float *out,
                             int64_t ob, int64_t oi, int64_t B, int64_t Q, int64_t heads, int64_t kv_heads,
                             int64_t L, int64_t d, float scale, float *scores, int threads) {
    const int64_t group = heads / kv_heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t job = 0; job < B * heads; job++) {
        const int64_t b = job / heads, h = job % heads, g = h / group;
        const float *keys = k + b * kb + g * kh, *values = v + b * kb + g * kh, *qr = q + b * qb + h * qh;
#ifdef _OPENMP
        float *s = scores + (int64_t)omp_get_thread_num() * Q * (L + 1);
#else
        float *s = scores;
#endif
        float *inverse = s + Q * L;  /* 1 / each row's sum, after the rows' scores */
        const char *none = NULL;
        for (int64_t m0 = 0; m0 < Q; m0 += 4)  /* scores [Q, L] = q rows . key rows, as a product's tiles */
            for (int64_t n0 = 0; n0 < L; n0 += TILE_N)
                tile(qr, qi, keys, NULL, d, s, L, Q, m0, n0, L - n0 < TILE_N ? L - n0 : TILE_N, &none, none, 0, 0);
        for (int64_t i = 0; i < Q; i++) {
            float *row = s + i * L;
            const float *m = mask + b * mb + i * mi;
            for (int64_t j = 0; j < L; j++) row[j] = row[j] * scale + m[j];
            const float top = max_f32(row, L);
            for (int64_t j = 0; j < L; j++) row[j] = exp_f32(row[j] - top);
            const float sum = sum_f32(row, L);
            inverse[i] = 1.0f / sum;
        }
        mix_values(s, L, Q, values, d, out + b * ob + h * d, oi, inverse);
    }
}

/* out[r] = silu(x[r, :n]) * x[r, n : 2n] for `rows` rows of 2n (a gated MLP's gate and up side by side). */
void hf_dscale_silu_mul_f32(const float *x, int64_t rows, int64_t n, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * n, *up = gate + n;
        float *o = out + r * n;
        for (int64_t i = 0; i < n; i++) o[i] = gate[i] / (1.0f + exp_f32(-gate[i])) * up[i];
    }
}
