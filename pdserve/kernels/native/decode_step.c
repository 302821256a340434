/* A whole bfloat16 decode step of a Llama-family model with int4 projections, every layer
 * in one call (decode_step.py): the per-layer path's kernels (int4_gemm.c, decode_ops.c,
 * decode_attention.c) run inside one OpenMP team, with a barrier where a phase needs what
 * another thread wrote.
 *
 * Why: at batch 1 SmolLM2-135M's projections are 166-553 KiB of weights each, a few
 * microseconds of reading on two cores, while each kernel call from Python cost about as
 * much again (ctypes, tensor views, waking the team): 150 calls and 265 views a step, 2.2 ms
 * of a 4.7 ms step (benchmarks/RESULTS.md). Here a step is one call and about 5 barriers a
 * layer.
 *
 * The arithmetic is the per-layer path's, operation for operation and in its order, so the
 * hidden states are the same bits (tests/unit/test_native_decode_step.py):
 * - Small row-wise work (the norms with their residual adds, quantizing a projection's
 *   input) runs on every thread at once, each into its own copy: each thread keeps its own
 *   residual stream, identical to the others', so no thread waits for another's.
 * - Each projection's output blocks are split between the threads. q, k and v are split by
 *   whole heads, so a thread rotates the q and k heads it computed and stores its k and v
 *   heads into the cache; gate and up by matching columns, so a thread's silu * up needs
 *   only its own outputs.
 * - Attention runs decode_attention.c's tasks (planned once a step: every layer's lengths
 *   are the same), split further by kv head and spread over the team: a kv head's sums are
 *   its own, so the result depends on neither the thread nor the split.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

typedef uint16_t bf16;

typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down;    /* int4 packed: [N / 16, K / 32, 320] */
    const bf16 *ln1, *ln2;                      /* input and post-attention norms [hidden] */
    char *k_cache, *v_cache;                    /* [num_blocks, block_size, KVH, D] */
} pd_layer;

typedef struct {
    int L, hidden, H, KVH, D, I, block_size;
    float eps, scale;
} pd_model;

#define ALIGN(n) (((n) + 63) & ~(size_t)63)

/* One thread's own buffers: its residual stream and a projection's quantized input. */
typedef struct {
    bf16 *res, *xn;             /* [B, hidden] each */
    int8_t *xq;                 /* [B, K] */
    float *sx, *sumx, *l, *acc; /* [B, K / 32] twice; combining: [H], [H, D] */
} step_private;

static size_t private_bytes(const pd_model *m, int B, int kmax) {
    return 2 * ALIGN((size_t)B * m->hidden * 2) + ALIGN((size_t)B * kmax) +
           2 * ALIGN((size_t)B * (kmax / 32) * 4) + ALIGN((size_t)m->H * 4) +
           ALIGN((size_t)m->H * m->D * 4);
}

static step_private private_at(char *p, const pd_model *m, int B, int kmax) {
    step_private s;
    s.res = (bf16 *)p;
    p += ALIGN((size_t)B * m->hidden * 2);
    s.xn = (bf16 *)p;
    p += ALIGN((size_t)B * m->hidden * 2);
    s.xq = (int8_t *)p;
    p += ALIGN((size_t)B * kmax);
    s.sx = (float *)p;
    p += ALIGN((size_t)B * (kmax / 32) * 4);
    s.sumx = (float *)p;
    p += ALIGN((size_t)B * (kmax / 32) * 4);
    s.l = (float *)p;
    p += ALIGN((size_t)m->H * 4);
    s.acc = (float *)p;
    return s;
}

/* RMSNorm of every row of x (plus the residual after layer 0) into s->xn, then quantized
 * for the next projection */
static void norm_rows(const pd_model *m, int B, const bf16 *x, const bf16 *w, int first,
                      step_private *s) {
    const int n = m->hidden;
    for (int b = 0; b < B; b++) {
        bf16 *res = s->res + (size_t)b * n;
        if (first) {  /* layer 0: the residual is the embedding itself */
            memcpy(res, x + (size_t)b * n, (size_t)n * 2);
            pd_rms_norm_row(x + (size_t)b * n, 0, 0, w, s->xn + (size_t)b * n, n, m->eps);
        } else {
            pd_rms_norm_row(x + (size_t)b * n, res, res, w, s->xn + (size_t)b * n, n, m->eps);
        }
    }
    pd_int4_quantize(s->xn, 1, B, n, s->xq, s->sx, s->sumx);
}

/* [lo, hi) of n items for thread t of nt */
static inline void share(int n, int t, int nt, int *lo, int *hi) {
    *lo = (int)((int64_t)n * t / nt);
    *hi = (int)((int64_t)n * (t + 1) / nt);
}

/* q, k and v heads [h0, h1) of every row into qkv; this thread's q and k heads rotated, its
 * k and v heads stored into their cache slots */
static void qkv_heads(const pd_model *m, const pd_layer *ly, int B, int h0, int h1,
                      const step_private *s, bf16 *qkv, const bf16 *cos, const bf16 *sin,
                      const int64_t *slots) {
    const int H = m->H, KVH = m->KVH, D = m->D, nh = H + 2 * KVH;
    pd_int4_blocks(ly->qkv, m->hidden, h0 * (D / 16), h1 * (D / 16), s->xq, s->sx, s->sumx, B,
                   (char *)qkv, (size_t)nh * D * 2, 1);
    for (int b = 0; b < B; b++) {
        bf16 *row = qkv + (size_t)b * nh * D;
        for (int h = h0; h < h1 && h < H + KVH; h++)
            pd_rotate_head(row + (size_t)h * D, D, cos + (size_t)b * D, sin + (size_t)b * D);
        if (slots[b] < 0) continue;
        for (int h = h0 > H ? h0 : H; h < h1; h++) {
            const int is_k = h < H + KVH, kv = is_k ? h - H : h - H - KVH;
            char *cache = is_k ? ly->k_cache : ly->v_cache;
            memcpy(cache + (size_t)(slots[b] * KVH + kv) * D * 2, row + (size_t)h * D,
                   (size_t)D * 2);
        }
    }
}

/* The layers' forward for B decode tokens: x [B, hidden] the embeddings (overwritten: each
 * layer's output goes there), out [B, hidden] the final norm's. cos, sin [B, D] the
 * rotary tables (sin with rotate_half's sign), tables int32 [B, bt_s], seq_lens int32 [B]
 * (cached + this token), slots int64 [B]. Returns 0, -1 when out of memory, -2 for shapes
 * the kernels cannot take (the caller checks them first). */
int pd_decode_step(const pd_layer *layers, const pd_model *m, int B, bf16 *x,
                   const bf16 *norm_w, bf16 *out, const bf16 *cos, const bf16 *sin,
                   const int32_t *tables, int64_t bt_s, const int32_t *seq_lens,
                   const int64_t *slots) {
    const int H = m->H, KVH = m->KVH, D = m->D, hidden = m->hidden, I = m->I;
    if (!pd_da_shape_ok(H, KVH, D) || hidden % 32 || (H * D) % 32 || I % 32 || B <= 0
            || m->L <= 0)
        return -2;
    const int nh = H + 2 * KVH, kmax = I > hidden ? (I > H * D ? I : H * D)
                                                  : (hidden > H * D ? hidden : H * D);
    const int threads = omp_get_max_threads();
    int parallel;
    const int split = pd_da_split(B, seq_lens, 0, KVH, threads, &parallel);
    const int64_t per_task = (int64_t)H * (D + 2);
    const size_t ntasks = (size_t)B * split, priv = private_bytes(m, B, kmax);
    const size_t sizes[] = {ALIGN((size_t)B * nh * D * 2), ALIGN((size_t)B * H * D * 2),
                            ALIGN((size_t)B * 2 * I * 2), ALIGN((size_t)B * I * 2),
                            ALIGN(ntasks * per_task * 4), ALIGN(ntasks * sizeof(da_task)),
                            ALIGN(((size_t)B + 1) * sizeof(int))};
    size_t shared = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) shared += sizes[i];
    char *mem = aligned_alloc(64, shared + (size_t)threads * priv);
    if (!mem) return -1;
    char *p = mem;
    bf16 *qkv = (bf16 *)p, *att = (bf16 *)(p += sizes[0]), *gu = (bf16 *)(p += sizes[1]);
    bf16 *act = (bf16 *)(p += sizes[2]);
    float *parts = (float *)(p += sizes[3]);
    da_task *tasks = (da_task *)(p += sizes[4]);
    int *first = (int *)(p += sizes[5]);  /* sequence groups: tasks [first[g], first[g + 1]) */
    const int count = pd_da_tasks(B, seq_lens, 0, split, tasks);
    int groups = 0;
    for (int i = 0; i < count; i++)
        if (i == 0 || tasks[i].b != tasks[i - 1].b) first[groups++] = i;
    first[groups] = count;
    const int whole = split == 1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        step_private s = private_at(mem + shared + (size_t)t * priv, m, B, kmax);
        int h0, h1, o0, o1, g0, g1;
        share(nh, t, nt, &h0, &h1);
        share(hidden / 16, t, nt, &o0, &o1);
        share(I / 16, t, nt, &g0, &g1);
        for (int li = 0; li < m->L; li++) {
            const pd_layer *ly = &layers[li];
            norm_rows(m, B, x, ly->ln1, li == 0, &s);
            qkv_heads(m, ly, B, h0, h1, &s, qkv, cos, sin, slots);
#pragma omp barrier
            const da_args a = {(const char *)qkv, (int64_t)nh * D, D, ly->k_cache, ly->v_cache,
                               tables, bt_s, 0, (char *)att, H, KVH, D, m->block_size,
                               DA_BF16, m->scale};
            for (int b = t; b < B; b += nt)  /* batch padding: zeros, as the kernel's */
                if (seq_lens[b] == 0) memset(att + (size_t)b * H * D, 0, (size_t)H * D * 2);
            int j0, j1;  /* this thread's (task, kv head) pairs: the last thread, which has
                          * the most q, k and v heads, takes the fewest */
            share(count * KVH, nt - 1 - t, nt, &j0, &j1);
            for (int j = j0; j < j1;) {
                const int i = j / KVH, k0 = j % KVH, k1 = k0 + (j1 - j) < KVH ? k0 + j1 - j
                                                                            : KVH;
                float *pt = parts + i * per_task;
                pd_da_run(&a, &tasks[i], k0, k1, 0, qkv + (size_t)tasks[i].b * nh * D, pt,
                          pt + H, pt + 2 * H);
                if (whole)
                    pd_da_write(&a, tasks[i].b, k0 * (H / KVH), k1 * (H / KVH), pt + H,
                                pt + 2 * H);
                j += k1 - k0;
            }
            if (!whole) {
#pragma omp barrier
                for (int g = t; g < groups; g += nt)
                    pd_da_combine(&a, tasks, first[g], first[g + 1], parts, per_task, s.l,
                                  s.acc);
            }
#pragma omp barrier
            pd_int4_quantize(att, 1, B, H * D, s.xq, s.sx, s.sumx);
            pd_int4_blocks(ly->o, H * D, o0, o1, s.xq, s.sx, s.sumx, B, (char *)x,
                           (size_t)hidden * 2, 1);
#pragma omp barrier
            norm_rows(m, B, x, ly->ln2, 0, &s);
            pd_int4_blocks(ly->gate_up, hidden, g0, g1, s.xq, s.sx, s.sumx, B, (char *)gu,
                           (size_t)I * 4, 1);
            pd_int4_blocks(ly->gate_up, hidden, I / 16 + g0, I / 16 + g1, s.xq, s.sx, s.sumx,
                           B, (char *)gu, (size_t)I * 4, 1);
            for (int b = 0; b < B; b++) {
                const bf16 *row = gu + (size_t)b * 2 * I;
                pd_silu_mul_row(row + g0 * 16, row + I + g0 * 16,
                                act + (size_t)b * I + g0 * 16, (g1 - g0) * 16);
            }
#pragma omp barrier
            pd_int4_quantize(act, 1, B, I, s.xq, s.sx, s.sumx);
            pd_int4_blocks(ly->down, I, o0, o1, s.xq, s.sx, s.sumx, B, (char *)x,
                           (size_t)hidden * 2, 1);
#pragma omp barrier
        }
        for (int b = t; b < B; b += nt)  /* every thread's residual is the same */
            pd_rms_norm_row(x + (size_t)b * hidden, s.res + (size_t)b * hidden,
                            s.res + (size_t)b * hidden, norm_w, out + (size_t)b * hidden,
                            hidden, m->eps);
    }
    free(mem);
    return 0;
}
