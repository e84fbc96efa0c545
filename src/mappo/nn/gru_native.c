/* A GRU's loop over time, forward and backward, for mappo.nn.gru_sequence on a CPU.
 *
 * The per-step work of SequenceGRU (one small matrix product and a few gate operations on a
 * dozen rows) costs microseconds of Python and dispatch per tensor operation when written in
 * torch; here each step is a plain loop. REAL is float or double (one library per type), and
 * every array is contiguous and row-major. The bulk work around the loops (the input
 * projection, the weight gradient) stays in torch.
 *
 * Equations (those of mappo.nn.layers.RecurrentCore._cell), gates r, z, n:
 *   gh = h @ W + b;  r = s(gx_r + gh_r);  z = s(gx_z + gh_z);  n = tanh(gx_n + r * gh_n);
 *   h' = n + z (h - n)
 * with h multiplied by keep[t] (and inject[t] added) before the steps flagged in cut[].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef REAL
#define REAL float
#endif
#define REAL_IS_FLOAT (sizeof(REAL) == sizeof(float))

/* A vector as wide as the target's vector registers (GCC's and Clang's vector extensions):
 * 512 bits with AVX-512, 256 with AVX, 128 otherwise; loaded and stored at any alignment. A
 * register tile is four rows of two vectors: eight accumulators, two vectors of B and a
 * broadcast, which fit in the 16 registers of AVX2 or SSE. (512-bit vectors there take two or
 * four registers each: the tile spilled to memory, and the loops ran 3x slower than torch's
 * ops on an AVX2 CPU.) */
#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
#define VL (int64_t)(VBYTES / sizeof(REAL))
#define NT (2 * VL)
typedef REAL vec __attribute__((vector_size(VBYTES), aligned(sizeof(REAL)), __may_alias__));
static inline vec load(const REAL *p) { return *(const vec *)p; }
static inline void store(REAL *p, vec v) { *(vec *)p = v; }

/* exp(x) for float from 2^k exp(r), |r| <= ln2 / 2, with a degree-7 Taylor polynomial
 * (truncation error below 1e-8 relative, under float's rounding); written with plain
 * arithmetic so that the compiler vectorises the loops that call it. */
static inline float exp_f(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* round to nearest by adding and taking away 1.5 * 2^23 */
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693145751953125f; /* ln 2 split in two for an exact product */
    r = r - k * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    /* (k == k: a NaN input keeps NaN in p but must not reach the conversion) */
    int32_t bits = ((int32_t)(k == k ? k : 0.0f) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline REAL sigmoid_(REAL x) {
    if (REAL_IS_FLOAT) return (REAL)(1.0f / (1.0f + exp_f((float)-x)));
    return (REAL)(1.0 / (1.0 + exp(-(double)x)));
}

/* tanh from exp: within 2e-7 absolutely (not relatively near 0, where the GRU's state adds
 * terms of order one anyway) */
static inline REAL tanh_(REAL x) {
    if (REAL_IS_FLOAT) return (REAL)(1.0f - 2.0f / (1.0f + exp_f(2.0f * (float)x)));
    return (REAL)tanh((double)x);
}

/* C[M, N] += A[M, K] @ B[K, N]; rows in tiles of four and
 * columns in tiles of NT, accumulated in registers. */
static void gemm_acc(int64_t M, int64_t N, int64_t K, const REAL *restrict A,
                     const REAL *restrict B, REAL *restrict C) {
    int64_t j = 0;
    /* column strips outside, row tiles inside: a strip of B (K x NT) is read from memory once
     * and from the first level of cache by every further tile of rows */
    for (; j + NT <= N; j += NT) {
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            const REAL *a0 = A + m * K, *a1 = a0 + K, *a2 = a1 + K, *a3 = a2 + K;
            REAL *o = C + m * N + j;
            vec c00 = load(o), c01 = load(o + VL), c10 = load(o + N), c11 = load(o + N + VL);
            vec c20 = load(o + 2 * N), c21 = load(o + 2 * N + VL);
            vec c30 = load(o + 3 * N), c31 = load(o + 3 * N + VL);
            for (int64_t k = 0; k < K; k++) {
                const REAL *b = B + k * N + j;
                vec b0 = load(b), b1 = load(b + VL);
                c00 += a0[k] * b0, c01 += a0[k] * b1;
                c10 += a1[k] * b0, c11 += a1[k] * b1;
                c20 += a2[k] * b0, c21 += a2[k] * b1;
                c30 += a3[k] * b0, c31 += a3[k] * b1;
            }
            store(o, c00), store(o + VL, c01), store(o + N, c10), store(o + N + VL, c11);
            store(o + 2 * N, c20), store(o + 2 * N + VL, c21);
            store(o + 3 * N, c30), store(o + 3 * N + VL, c31);
        }
        for (; m < M; m++) { /* the rows left over, one at a time */
            const REAL *a = A + m * K;
            REAL *o = C + m * N + j;
            vec c0 = load(o), c1 = load(o + VL);
            for (int64_t k = 0; k < K; k++) {
                const REAL *b = B + k * N + j;
                c0 += a[k] * load(b), c1 += a[k] * load(b + VL);
            }
            store(o, c0), store(o + VL, c1);
        }
    }
    if (j < N) /* columns left over (a width that is not a multiple of NT) */
        for (int64_t m = 0; m < M; m++) {
            const REAL *a = A + m * K;
            REAL *o = C + m * N;
            for (int64_t k = 0; k < K; k++) {
                const REAL x = a[k], *b = B + k * N;
                for (int64_t q = j; q < N; q++) o[q] += x * b[q];
            }
        }
}

/* One row's gates: from the input projection x [3H] and the hidden
 * projection gh [3H] of the state h [H], the new state o, the gates r and z (rz [2H]), n and
 * gh's n part (hn). */
static void gates_forward(int64_t H, const REAL *restrict x,
                          const REAL *restrict gh, const REAL *restrict h, REAL *restrict o,
                          REAL *restrict rz, REAL *restrict n, REAL *restrict hn) {
    for (int64_t j = 0; j < H; j++) {
        REAL r = sigmoid_(x[j] + gh[j]);
        REAL z = sigmoid_(x[H + j] + gh[H + j]);
        REAL nv = tanh_(x[2 * H + j] + r * gh[2 * H + j]);
        rz[j] = r;
        rz[H + j] = z;
        n[j] = nv;
        hn[j] = gh[2 * H + j];
        o[j] = nv + z * (h[j] - nv);
    }
}

/* One row's gate gradients from the incoming gradient g = dh + d:
 * dgx [3H] (the input projection's: r, z and n before their nonlinearities), dgh [3H] (the
 * hidden projection's: its n part also through r) and the part of the state's gradient that
 * reaches it directly, zg = z g (h' = n + z (h - n)). */
static void gates_backward(int64_t H, const REAL *restrict dh,
                           const REAL *restrict d, const REAL *restrict h,
                           const REAL *restrict rz, const REAL *restrict n,
                           const REAL *restrict hn, REAL *restrict dgx, REAL *restrict dgh,
                           REAL *restrict zg) {
    for (int64_t j = 0; j < H; j++) {
        REAL g = dh[j] + d[j];
        REAL r = rz[j], z = rz[H + j], nv = n[j];
        REAL a = g * (1 - z) * (1 - nv * nv);
        REAL dr = a * hn[j] * r * (1 - r);
        REAL dz = g * (h[j] - nv) * z * (1 - z);
        dgx[j] = dgh[j] = dr;
        dgx[H + j] = dgh[H + j] = dz;
        dgh[2 * H + j] = a * r;
        dgx[2 * H + j] = a;
        zg[j] = g * z;
    }
}

/* The rows [m0, m1) of gru_forward: a row's recurrence reads only its own state, so threads
 * given rows of their own never wait for each other. */
static void forward_rows(int64_t L, int64_t M, int64_t H, int64_t m0, int64_t m1,
                         const REAL *gx, const REAL *h0, const REAL *W, const REAL *b,
                         const REAL *keep, const REAL *inject, const uint8_t *cut, REAL *out,
                         REAL *prev, REAL *rz, REAL *n, REAL *hn, REAL *gh) {
    const int64_t G = 3 * H;
    for (int64_t t = 0; t < L; t++) {
        const REAL *h = t ? out + (t - 1) * M * H : h0;
        REAL *p = prev + t * M * H;
        for (int64_t m = m0; m < m1; m++) {
            const REAL k = cut[t] ? keep[t * M + m] : 1;
            const REAL *add = cut[t] && inject ? inject + (t * M + m) * H : NULL;
            for (int64_t j = 0; j < H; j++)
                p[m * H + j] = add ? h[m * H + j] * k + add[j] : h[m * H + j] * k;
            for (int64_t j = 0; j < G; j++) gh[m * G + j] = b[j];
        }
        gemm_acc(m1 - m0, G, H, p + m0 * H, W, gh + m0 * G);
        for (int64_t m = m0; m < m1; m++) {
            const int64_t row = t * M + m;
            gates_forward(H, gx + row * G, gh + m * G, p + m * H, out + row * H,
                          rz + row * 2 * H, n + row * H, hn + row * H);
        }
    }
}

/* The rows [m0, m1) of gru_backward. */
static void backward_rows(int64_t L, int64_t M, int64_t H, int64_t m0, int64_t m1,
                          const REAL *dout, const REAL *WT, const REAL *keep, const uint8_t *cut,
                          const REAL *prev, const REAL *rz, const REAL *n, const REAL *hn,
                          REAL *dgx, REAL *dgh, REAL *dh, REAL *g) {
    const int64_t G = 3 * H;
    memset(dh + m0 * H, 0, (size_t)((m1 - m0) * H) * sizeof(REAL));
    for (int64_t t = L - 1; t >= 0; t--) {
        /* every unit's gate gradients from g = dh + dout[t] */
        for (int64_t m = m0; m < m1; m++) {
            const int64_t row = t * M + m;
            gates_backward(H, dh + m * H, dout + row * H, prev + row * H, rz + row * 2 * H,
                           n + row * H, hn + row * H, dgx + row * G, dgh + row * G, g + m * H);
        }
        /* dh = z g + dgh @ W^T, then through the reset of a cut */
        gemm_acc(m1 - m0, H, G, dgh + (t * M + m0) * G, WT, g + m0 * H);
        for (int64_t m = m0; m < m1; m++) {
            const REAL k = cut[t] ? keep[t * M + m] : 1;
            for (int64_t j = 0; j < H; j++) dh[m * H + j] = g[m * H + j] * k;
        }
    }
}

/* Part `part` of `parts` of M rows, in whole tiles of four rows where there are enough. */
static void rows_of(int64_t M, int64_t part, int64_t parts, int64_t *m0, int64_t *m1) {
    int64_t tiles = (M + 3) / 4, per = tiles / parts, extra = tiles % parts;
    int64_t first = part * per + (part < extra ? part : extra);
    int64_t last = first + per + (part < extra);
    *m0 = first * 4 < M ? first * 4 : M;
    *m1 = last * 4 < M ? last * 4 : M;
}

/* Forward over L steps of M rows and H units, the rows split between `threads` OpenMP
 * threads (one where the library is built without OpenMP).
 * In:  gx [L, M, 3H] (input projection with its bias), h0 [M, H], W [H, 3H], b [3H],
 *      keep [L, M] and inject [L, M, H] or NULL (read at the steps with cut[t] != 0),
 *      cut [L] (uint8).
 * Out: out [L, M, H] (state after each step), prev [L, M, H] (state each step read),
 *      rz [L, M, 2H] (gates r and z), n [L, M, H], hn [L, M, H] (gh's n part, bias included);
 *      gh [M, 3H] is scratch. */
void gru_forward(int threads, int64_t L, int64_t M, int64_t H, const REAL *gx, const REAL *h0,
                 const REAL *W, const REAL *b, const REAL *keep, const REAL *inject,
                 const uint8_t *cut, REAL *out, REAL *prev, REAL *rz, REAL *n, REAL *hn,
                 REAL *gh) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int part = 0; part < threads; part++) {
        int64_t m0, m1;
        rows_of(M, part, threads, &m0, &m1);
        if (m0 < m1)
            forward_rows(L, M, H, m0, m1, gx, h0, W, b, keep, inject, cut, out, prev, rz, n,
                         hn, gh);
    }
}

/* Backward through the steps of gru_forward, last to first, the rows split likewise.
 * In:  dout [L, M, H] (gradient of each step's output), WT [3H, H] (W transposed), keep, cut,
 *      and the forward's prev, rz, n, hn.
 * Out: dgx [L, M, 3H] (gradient of the input projection), dgh [L, M, 3H] (of each step's
 *      hidden projection, for the weight and bias gradients), dh [M, H] (of h0);
 *      g [M, H] is scratch. */
void gru_backward(int threads, int64_t L, int64_t M, int64_t H, const REAL *dout, const REAL *WT,
                  const REAL *keep, const uint8_t *cut, const REAL *prev, const REAL *rz,
                  const REAL *n, const REAL *hn, REAL *dgx, REAL *dgh, REAL *dh, REAL *g) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int part = 0; part < threads; part++) {
        int64_t m0, m1;
        rows_of(M, part, threads, &m0, &m1);
        if (m0 < m1)
            backward_rows(L, M, H, m0, m1, dout, WT, keep, cut, prev, rz, n, hn, dgx, dgh, dh,
                          g);
    }
}
