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
 * - A thread done with its share of a phase takes what is left of the others' (take).
 * - While gate and up stream their weights, each thread asks for the next layer's K and V
 *   rows that its share of that layer's attention will read (kv_ahead).
 * A greedy batch's step can also look its tokens up (look_up) and pick them from a Q8_0
 * LM head (final_rows), so that a decode step is one call from token ids to tokens.
 */
#include <math.h>
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

/* A step's tokens for the step to look up itself (the embedding's rows, the rotary tables)
 * instead of taking x, cos and sin: at batch 1 the two torch lookups took 0.1 ms of a step,
 * their memory cold after the weights had streamed through the caches */
typedef struct {
    const int64_t *ids, *positions;  /* [B] */
    const uint8_t *emb_q8;           /* the embedding: Q8_0 packed as q8_gemm.c packs it, */
    const bf16 *emb;                 /* or bfloat16 [vocab, hidden] */
    int64_t vocab;
    const float *cos_sin;            /* [max_pos, D] float32: cos, then sin (model/rope.py) */
    int64_t max_pos;
} pd_lookup;

/* float32 -> bfloat16, nearest even (finite values: torch's .to(torch.bfloat16)) */
static inline bf16 bf16_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (bf16)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* Whether every id and position of lk is in its tables' range */
static int lookup_ok(const pd_lookup *lk, int B) {
    for (int b = 0; b < B; b++)
        if (lk->ids[b] < 0 || lk->ids[b] >= lk->vocab || lk->positions[b] < 0
                || lk->positions[b] >= lk->max_pos)
            return 0;
    return 1;
}

/* x [B, hidden], cos and sin [B, D] of lk's tokens (lookup_ok), the torch path's bits: the
 * embedding's rows as dequantized (q8_rows), kernels/rotary.py's tables (sin with
 * rotate_half's sign in its first half). Returns 0, or -3 for an id out of range. */
static int look_up(const pd_lookup *lk, const pd_model *m, int B, bf16 *x, bf16 *cos,
                   bf16 *sin) {
    const int D = m->D, half = m->D / 2, n = m->hidden;
    if (lk->emb_q8) {
        if (q8_rows(lk->emb_q8, n, (int)lk->vocab, lk->ids, B, x, 1)) return -3;
    } else {
        for (int b = 0; b < B; b++)
            memcpy(x + (size_t)b * n, lk->emb + (size_t)lk->ids[b] * n, (size_t)n * 2);
    }
    for (int b = 0; b < B; b++) {
        const float *cs = lk->cos_sin + (size_t)lk->positions[b] * D;
        bf16 *c = cos + (size_t)b * D, *s = sin + (size_t)b * D;
        for (int j = 0; j < half; j++) {
            c[j] = c[half + j] = bf16_of(cs[j]);
            s[half + j] = bf16_of(cs[half + j]);
            s[j] = s[half + j] ^ 0x8000;  /* -sin: the same rounding, negated */
        }
    }
    return 0;
}

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

/* Work: each phase's chunks are split evenly between the threads, and each thread takes
 * its own in order, one at a time, from the front of its span; a thread that has run out
 * takes the others' from the back. On a shared machine one core is often slower for a
 * while (another tenant, an interrupt, the node's I/O thread): with a fixed split the
 * other would wait for it at every barrier. A thread's own chunks stay one forward stream
 * through the weights, which is what the memory's prefetchers keep up with (handing
 * chunks out in turn from one counter made the step 1.3 times as long). Which thread
 * computes an output does not change its bits.
 * A span is [lo, hi) of chunk indices in one word, lo in the low 32 bits. */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 12288
#endif
#define PHASES 5        /* a layer's: q/k/v heads, attention, o, gate and up, down */
#define HEAD_CHUNK 4    /* Q8_0 head blocks of 16 outputs a chunk (K = 576: 39 KiB) */

static inline int min_int(int a, int b) { return a < b ? a : b; }

static inline int take_front(uint64_t *span) {
    uint64_t v = __atomic_load_n(span, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        if (__atomic_compare_exchange_n(span, &v, v + 1, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return (int)lo;
    }
}

static inline int take_back(uint64_t *span) {
    uint64_t v = __atomic_load_n(span, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        if (__atomic_compare_exchange_n(span, &v, v - ((uint64_t)1 << 32), 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int)(hi - 1);
    }
}

/* The next chunk for thread t: spans [n][stride], this phase's at offset 0, one for each
 * thread asked for (a team that came smaller leaves the missing threads' to be taken) */
static inline int take(uint64_t *spans, size_t stride, int t, int n) {
    int c = take_front(spans + (size_t)t * stride);
    for (int k = 1; c < 0 && k < n; k++)
        c = take_back(spans + (size_t)((t + k) % n) * stride);
    return c;
}

/* phase's span of n chunks for each of nt threads: an even split */
static void split_spans(uint64_t *spans, size_t stride, int phase, int n, int nt) {
    for (int t = 0; t < nt; t++) {
        const uint64_t lo = (uint64_t)((int64_t)n * t / nt), hi = (uint64_t)((int64_t)n * (t + 1) / nt);
        spans[(size_t)t * stride + phase] = lo | hi << 32;
    }
}

/* The next layer's K and V, asked for into L2 while this layer's gate and up stream their
 * weights: attention reads a few hundred positions of cache rows scattered over pages, and
 * after a step's ~100 MB of weights have passed through the caches every row is a miss
 * that the next one waits behind (the kernel's own prefetch, one tile ahead, is too short
 * a distance). Asked for during gate/up, the misses overlap the weights' stream. A thread
 * asks for the rows of its own share of the next layer's attention items (the even split
 * of their span, which it takes first), a few rows per gate/up chunk it computes. */
typedef struct {
    int c, c1;   /* attention items [c, c1): (task, kv head) as the attention phase numbers them */
    int t;       /* the next position of item c */
    int per;     /* positions asked for per gate/up chunk */
} kv_ahead;

#ifndef KV_AHEAD
#define KV_AHEAD 1  /* 0: not asked for ahead (benchmarks/decode_step_builds.py compares) */
#endif

/* items: the thread's span of the next layer's attention items; chunks: its span of this
 * layer's gate/up chunks (the rows are spread over them) */
static kv_ahead kv_ahead_plan(const uint64_t *items, const uint64_t *chunks,
                              const da_task *tasks, int KVH) {
    const uint64_t v = __atomic_load_n(items, __ATOMIC_RELAXED);
    const uint64_t w = __atomic_load_n(chunks, __ATOMIC_RELAXED);
    const int n = (int)(uint32_t)(w >> 32) - (int)(uint32_t)w;
    kv_ahead k = {(int)(uint32_t)v, (int)(uint32_t)(v >> 32), 0, 0};
    int64_t rows = 0;
    for (int c = k.c; c < k.c1; c++) rows += tasks[c / KVH].t1 - tasks[c / KVH].t0;
    k.per = n > 0 ? (int)((rows + n - 1) / n) : 0;
    return k;
}

static void kv_ahead_next(kv_ahead *k, const pd_model *m, const pd_layer *ly,
                          const da_task *tasks, const int32_t *tables, int64_t bt_s) {
    const int KVH = m->KVH, D = m->D;
    const int64_t row = (int64_t)KVH * D;
    for (int n = KV_AHEAD ? k->per : 0; n > 0 && k->c < k->c1;) {
        const da_task *tk = &tasks[k->c / KVH];
        if (k->t < tk->t0) k->t = tk->t0;
        if (k->t >= tk->t1) {
            k->c++;
            k->t = 0;
            continue;
        }
        const int64_t blk = tables[tk->b * bt_s + k->t / m->block_size];
        if (blk >= 0) {
            const int64_t at = (pd_kv_slot(blk, k->t, m->block_size) * row
                                + (int64_t)(k->c % KVH) * D) * (int64_t)sizeof(bf16);
            for (int x = 0; x < D * (int)sizeof(bf16); x += 64) {
                _mm_prefetch(ly->k_cache + at + x, _MM_HINT_T1);
                _mm_prefetch(ly->v_cache + at + x, _MM_HINT_T1);
            }
        }
        k->t++;
        n--;
    }
}

/* blocks of 16 outputs of an int4 projection with k inputs (10 bytes a group of 32 an
 * output) in about CHUNK_BYTES of weights */
static inline int chunk_blocks(int k) {
    const int n = CHUNK_BYTES / (k / 32 * 320);
    return n > 0 ? n : 1;
}

static inline int chunks(int n, int per) { return (n + per - 1) / per; }

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

/* The final norm of every row into this thread's s->xn (each thread's residual is the
 * same), its own rows [b % nt == t] stored to out; then, with a Q8_0 head, the greedy pick
 * over the chunks of the vocabulary this thread takes into best, at [B]: its largest logit
 * and the first index of it, at -1 for a NaN */
static void final_rows(const pd_model *m, int B, const bf16 *x, const bf16 *norm_w,
                       const uint8_t *head, int vocab, uint64_t *spans, size_t stride,
                       int threads, int t, int nt, step_private *s, bf16 *out, float *best,
                       int64_t *at) {
    const int n = m->hidden;
    for (int b = 0; b < B; b++) {
        if (!head && b % nt != t) continue;
        bf16 *res = s->res + (size_t)b * n, *xn = s->xn + (size_t)b * n;
        pd_rms_norm_row(x + (size_t)b * n, res, res, norm_w, xn, n, m->eps);
        if (b % nt == t) memcpy(out + (size_t)b * n, xn, (size_t)n * 2);
    }
    if (!head) return;
    for (int b = 0; b < B; b++) {
        best[b] = -INFINITY;
        at[b] = INT64_MAX;
    }
    int32_t *corr = (int32_t *)s->sumx;
    pd_q8_quantize(s->xn, 1, B, n, s->xq, s->sx, corr);
    const int blocks = (vocab + 15) / 16, hc = HEAD_CHUNK;
    for (int c; (c = take(spans, stride, t, threads)) >= 0;)
        pd_q8_argmax_blocks(head, n, vocab, c * hc, min_int((c + 1) * hc, blocks), s->xq,
                            s->sx, corr, B, best, at);
}

/* The layers' forward for B decode tokens: x [B, hidden] the embeddings (overwritten: each
 * layer's output goes there), out [B, hidden] the final norm's. cos, sin [B, D] the
 * rotary tables (sin with rotate_half's sign), tables int32 [B, bt_s], seq_lens int32 [B]
 * (cached + this token), slots int64 [B]. With head (q8_gemm.c's packing of a Q8_0 LM
 * head of vocab outputs), tokens [B] gets each row's greedy token: the index of its
 * largest logit, the first on ties, the logits q8_mm computes from out; -1 for a row
 * whose logits hold a NaN. With lk, the step looks its tokens up itself and x, cos and
 * sin are not read (x may be NULL). Returns 0, -1 when out of memory, -2 for shapes the
 * kernels cannot take (the caller checks them first), -3 for a token id or position out
 * of lk's range. */
int pd_decode_step(const pd_layer *layers, const pd_model *m, int B, bf16 *x,
                   const bf16 *norm_w, bf16 *out, const bf16 *cos, const bf16 *sin,
                   const int32_t *tables, int64_t bt_s, const int32_t *seq_lens,
                   const int64_t *slots, const uint8_t *head, int vocab, int64_t *tokens,
                   const pd_lookup *lk) {
    const int H = m->H, KVH = m->KVH, D = m->D, hidden = m->hidden, I = m->I;
    if (!pd_da_shape_ok(H, KVH, D) || hidden % 32 || (H * D) % 32 || I % 32 || B <= 0
            || m->L <= 0)
        return -2;
    if (lk && !lookup_ok(lk, B)) return -3;  /* before the plan reads the lengths */
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
                            ALIGN(((size_t)B + 1) * sizeof(int)),
                            ALIGN((size_t)threads * B * 4), ALIGN((size_t)threads * B * 8),
                            (size_t)threads * ALIGN(((size_t)m->L * PHASES + 1) * 8),
                            lk ? ALIGN((size_t)B * hidden * 2) + 2 * ALIGN((size_t)B * D * 2)
                               : 0};
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
    float *best = (float *)(p += sizes[6]);  /* the head's pick: [thread][B] */
    int64_t *at = (int64_t *)(p += sizes[7]);
    int team = 1;
    const int count = pd_da_tasks(B, seq_lens, 0, split, tasks);
    int groups = 0;
    for (int i = 0; i < count; i++)
        if (i == 0 || tasks[i].b != tasks[i - 1].b) first[groups++] = i;
    first[groups] = count;
    const int whole = split == 1;
    /* every phase's spans, [thread][layer * PHASES + phase, then the head's], a thread's
     * own on cache lines of their own */
    const size_t stride = ALIGN(((size_t)m->L * PHASES + 1) * 8) / 8;
    uint64_t *spans = (uint64_t *)(p += sizes[8]);
    if (lk) {  /* x, cos and sin from the step's own lookup, in its scratch */
        bf16 *own = (bf16 *)(p += sizes[9]);
        x = own;
        bf16 *c = (bf16 *)((char *)own + ALIGN((size_t)B * hidden * 2));
        bf16 *sn = (bf16 *)((char *)c + ALIGN((size_t)B * D * 2));
        cos = c, sin = sn;
        if (look_up(lk, m, B, x, c, sn)) {
            free(mem);
            return -3;
        }
    }
    const int oc = chunk_blocks(H * D), gc = (chunk_blocks(hidden) + 1) / 2, dc = chunk_blocks(I);
    for (int li = 0; li < m->L; li++) {
        const int n[PHASES] = {nh, count * KVH, chunks(hidden / 16, oc), chunks(I / 16, gc),
                               chunks(hidden / 16, dc)};
        for (int ph = 0; ph < PHASES; ph++)
            split_spans(spans, stride, li * PHASES + ph, n[ph], threads);
    }
    split_spans(spans, stride, m->L * PHASES, chunks((vocab + 15) / 16, HEAD_CHUNK), threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        step_private s = private_at(mem + shared + (size_t)t * priv, m, B, kmax);
        for (int li = 0; li < m->L; li++) {
            const pd_layer *ly = &layers[li];
            uint64_t *sp = spans + li * PHASES;
            int c;
            norm_rows(m, B, x, ly->ln1, li == 0, &s);
            while ((c = take(sp, stride, t, threads)) >= 0)
                qkv_heads(m, ly, B, c, c + 1, &s, qkv, cos, sin, slots);
#pragma omp barrier
            const da_args a = {(const char *)qkv, (int64_t)nh * D, D, ly->k_cache, ly->v_cache,
                               tables, bt_s, 0, (char *)att, H, KVH, D, m->block_size,
                               DA_BF16, m->scale};
            for (int b = t; b < B; b += nt)  /* batch padding: zeros, as the kernel's */
                if (seq_lens[b] == 0) memset(att + (size_t)b * H * D, 0, (size_t)H * D * 2);
            while ((c = take(sp + 1, stride, t, threads)) >= 0) {  /* (task, kv head) */
                const int i = c / KVH, k = c % KVH;
                float *pt = parts + i * per_task;
                pd_da_run(&a, &tasks[i], k, k + 1, 0, qkv + (size_t)tasks[i].b * nh * D, pt,
                          pt + H, pt + 2 * H);
                if (whole)
                    pd_da_write(&a, tasks[i].b, k * (H / KVH), (k + 1) * (H / KVH), pt + H,
                                pt + 2 * H);
            }
            if (!whole) {
#pragma omp barrier
                for (int g = t; g < groups; g += nt)
                    pd_da_combine(&a, tasks, first[g], first[g + 1], parts, per_task, s.l,
                                  s.acc);
            }
#pragma omp barrier
            pd_int4_quantize(att, 1, B, H * D, s.xq, s.sx, s.sumx);
            while ((c = take(sp + 2, stride, t, threads)) >= 0)
                pd_int4_blocks(ly->o, H * D, c * oc, min_int((c + 1) * oc, hidden / 16), s.xq,
                               s.sx, s.sumx, B, (char *)x, (size_t)hidden * 2, 1);
#pragma omp barrier
            norm_rows(m, B, x, ly->ln2, 0, &s);
            kv_ahead ahead = {0, 0, 0, 0};
            if (li + 1 < m->L)
                ahead = kv_ahead_plan(sp + PHASES + 1 + (size_t)t * stride,
                                      sp + 3 + (size_t)t * stride, tasks, KVH);
            while ((c = take(sp + 3, stride, t, threads)) >= 0) {  /* gate's blocks and up's */
                kv_ahead_next(&ahead, m, &layers[li + 1], tasks, tables, bt_s);
                const int c0 = c * gc, c1 = min_int(c0 + gc, I / 16);
                pd_int4_blocks(ly->gate_up, hidden, c0, c1, s.xq, s.sx, s.sumx, B, (char *)gu,
                               (size_t)I * 4, 1);
                pd_int4_blocks(ly->gate_up, hidden, I / 16 + c0, I / 16 + c1, s.xq, s.sx,
                               s.sumx, B, (char *)gu, (size_t)I * 4, 1);
                for (int b = 0; b < B; b++) {
                    const bf16 *row = gu + (size_t)b * 2 * I;
                    pd_silu_mul_row(row + c0 * 16, row + I + c0 * 16,
                                    act + (size_t)b * I + c0 * 16, (c1 - c0) * 16);
                }
            }
#pragma omp barrier
            pd_int4_quantize(act, 1, B, I, s.xq, s.sx, s.sumx);
            while ((c = take(sp + 4, stride, t, threads)) >= 0)
                pd_int4_blocks(ly->down, I, c * dc, min_int((c + 1) * dc, hidden / 16), s.xq,
                               s.sx, s.sumx, B, (char *)x, (size_t)hidden * 2, 1);
#pragma omp barrier
        }
        if (t == 0) team = nt;
        final_rows(m, B, x, norm_w, head, vocab, spans + m->L * PHASES, stride, threads, t, nt,
                   &s, out, best + (size_t)t * B, at + (size_t)t * B);
    }
    if (head)  /* the largest of the threads' picks; of equals, the first in the vocabulary */
        for (int b = 0; b < B; b++) {
            float top = -INFINITY;
            tokens[b] = INT64_MAX;
            for (int t = 0; t < team && tokens[b] >= 0; t++) {
                const float v = best[(size_t)t * B + b];
                const int64_t i = at[(size_t)t * B + b];
                if (i < 0) tokens[b] = -1;
                else if (v > top || (v == top && i < tokens[b])) top = v, tokens[b] = i;
            }
        }
    free(mem);
    return 0;
}
