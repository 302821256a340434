/* A whole bfloat16 decode step of a Llama-family model with int4 projections, every layer
 * in one call (decode_step.py): the per-layer path's kernels (int4_gemm.c, decode_ops.c,
 * decode_attention.c) run inside one OpenMP team, each phase of a layer starting once the
 * one before is done.
 *
 * Why: at batch 1 SmolLM2-135M's projections are 166-553 KiB of weights each, a few
 * microseconds of reading on two cores, while each kernel call from Python cost about as
 * much again (ctypes, tensor views, waking the team): 150 calls and 265 views a step, 2.2 ms
 * of a 4.7 ms step (benchmarks/RESULTS.md). Here a step is one call and 5 or 6 phases a
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
 *   its own, so the result depends on neither the thread nor the split. A split context's
 *   chunks are combined by one thread a sequence, or, where the sequences (those with
 *   tasks: not batch padding) are fewer than the threads (batch 1), by every thread for
 *   itself, so that none waits for another's.
 * - A thread done with its share of a phase takes what is left of the others' (take), and
 *   one whose last chunk runs far too long (its thread preempted) it computes itself
 *   (take_over): a phase does not wait for a thread the machine is not running.
 * - While q, k and v stream their weights, each thread asks for the K and V rows that its
 *   share of the layer's attention will read (kv_ahead); as a phase ends, and while
 *   attention computes, for the first lines of its share of the next weights (w_ahead).
 * A greedy batch's step can also look its tokens up (look_up) and pick them from a Q8_0
 * LM head (final_rows), so that a decode step is one call from token ids to tokens.
 */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* bytes at *at, the next offset ALIGNed past them: a scratch's layout, planned before
 * it is allocated */
static size_t put(size_t *at, size_t bytes) {
    const size_t o = *at;
    *at += ALIGN(bytes);
    return o;
}

/* One thread's own buffers: its residual stream, a projection's quantized input, and what
 * a chunk computes before its final values are stored where the others read them (a chunk
 * another thread may be computing again at the same time writes only final values there,
 * the same bits: see "Work") */
typedef struct {
    bf16 *res, *xn;             /* [B, hidden] each */
    int8_t *xq;                 /* [B, K] */
    float *sx, *sumx, *l, *acc; /* [B, K / 32] twice; combining: [H], [H, D] */
    bf16 *head, *gu;            /* a q, k or v head [B, D]; gate then up [B, 2 * I] */
    float *parts;               /* an attention item's m [H], l [H], acc [H, D] */
    bf16 *att;                  /* attention's output combined by this thread [B, H, D] */
} step_private;

/* the private buffers' offsets from their start (s's pointers), and their size */
static size_t private_layout(const pd_model *m, int B, int kmax, int comb_each,
                             step_private *s) {
    size_t at = 0;
    size_t o[11];
    o[0] = put(&at, (size_t)B * m->hidden * 2);
    o[1] = put(&at, (size_t)B * m->hidden * 2);
    o[2] = put(&at, (size_t)B * kmax);
    o[3] = put(&at, (size_t)B * (kmax / 32) * 4);
    o[4] = put(&at, (size_t)B * (kmax / 32) * 4);
    o[5] = put(&at, (size_t)m->H * 4);
    o[6] = put(&at, (size_t)m->H * m->D * 4);
    o[7] = put(&at, (size_t)B * m->D * 2);
    o[8] = put(&at, (size_t)B * 2 * m->I * 2);
    o[9] = put(&at, (size_t)m->H * (m->D + 2) * 4);
    o[10] = put(&at, comb_each ? (size_t)B * m->H * m->D * 2 : 0);
    if (s) {
        char *p = (char *)s->res;  /* the start */
        s->res = (bf16 *)(p + o[0]), s->xn = (bf16 *)(p + o[1]), s->xq = (int8_t *)(p + o[2]);
        s->sx = (float *)(p + o[3]), s->sumx = (float *)(p + o[4]);
        s->l = (float *)(p + o[5]), s->acc = (float *)(p + o[6]);
        s->head = (bf16 *)(p + o[7]), s->gu = (bf16 *)(p + o[8]);
        s->parts = (float *)(p + o[9]), s->att = (bf16 *)(p + o[10]);
    }
    return at;
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
 * takes half of what is left of another's, from the back, and makes it its own span. On
 * a shared machine one core is often slower for a while (another tenant, an interrupt,
 * the node's I/O thread): with a fixed split the other would wait for it at the end of
 * every phase. A thread's own chunks stay one forward stream through the weights, which is
 * what the memory's prefetchers keep up with (handing chunks out in turn from one counter
 * made the step 1.3 times as long), and so do the halves a thread takes: while another
 * thread is preempted the one left runs through its share in a few forward streams, not
 * one stream a chunk from the back (a thread asleep 900 us a step made the step 0.46 ms
 * longer with chunks taken one at a time from the back, 0.27 ms with halves; RESULTS.md).
 * Which thread computes an output does not change its bits.
 * A span is [lo, hi) of chunk indices in one word, lo in the low 32 bits.
 *
 * A phase ends when all its chunks are done, not at a barrier: a thread that has run out
 * of chunks waits for the others' last ones, and if one of them runs far longer than a
 * chunk takes (its thread is preempted: on a machine whose cores the router, the clients
 * and the node's I/O threads share, one of the team is, every few milliseconds, for tens
 * to hundreds of microseconds), it computes that chunk itself and goes on. The chunk's
 * thread, when it runs again, finishes it and writes the same bits where they already
 * are, then runs through what is left, having no chunks to wait for. So every chunk writes
 * only final values where the others read them (its partial results stay in its thread's
 * own buffers), and each layer's outputs have buffers of their own (a ring of layers, see
 * step_ctx), so that a late write never lands on a later layer's values. Each thread
 * publishes the chunk it is running (worker); a chunk counts as done once: by its thread,
 * or by the one that took it over, whichever's compare-and-swap on that word came first. */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 12288
#endif
/* a layer's phases, in order: q/k/v heads, attention, combining a split context's chunks,
 * o, gate and up, down */
enum { PH_QKV, PH_ATT, PH_COMB, PH_O, PH_GU, PH_DOWN, PHASES };
#define HEAD_CHUNK 4    /* Q8_0 head blocks of 16 outputs a chunk (K = 576: 39 KiB) */

/* Profiling (benchmarks/decode_step_phases.py builds the library with -DSTEP_PROFILE=1):
 * time-stamp counter ticks per thread in each part of a step, read and cleared by
 * pd_step_profile. In the build the nodes load every hook compiles to nothing. */
#ifndef STEP_PROFILE
#define STEP_PROFILE 0
#endif
/* the parts: each phase's chunks (PH_*), its wait (PR_WAIT + PH_*), the norms and
 * quantizing, the wait for a ring slot, the LM head (final_rows), the team's whole work */
enum { PR_WAIT = PHASES, PR_NORMS = 2 * PHASES, PR_RING, PR_HEAD, PR_TEAM, PR_PARTS };
#define PROFILE_THREADS 64
static uint64_t profile[PROFILE_THREADS][PR_PARTS];  /* only thread t writes row t */

static inline uint64_t prof_now(void) { return STEP_PROFILE ? __rdtsc() : 0; }
static inline void prof_add(int t, int part, uint64_t from, uint64_t to) {
    if (STEP_PROFILE && t < PROFILE_THREADS) profile[t][part] += to - from;
}

/* [PROFILE_THREADS][PR_PARTS] ticks into out, then zeros (all zeros without STEP_PROFILE) */
void pd_step_profile(uint64_t *out) {
    memcpy(out, profile, sizeof(profile));
    memset(profile, 0, sizeof(profile));
}

uint64_t pd_step_ticks(void) { return __rdtsc(); }

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

#ifndef TAKE_HALF
#define TAKE_HALF 1  /* 0: one chunk at a time from the back (decode_step_builds.py compares) */
#endif

/* From another thread's span, the back half of what is left (rounded up): its first
 * chunk returned, the rest stored as `own`, the taker's span, which is empty (no other
 * thread changes an empty span, and only its thread fills it) */
static inline int take_half(uint64_t *span, uint64_t *own) {
    uint64_t v = __atomic_load_n(span, __ATOMIC_RELAXED);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        const uint32_t from = TAKE_HALF ? hi - (hi - lo + 1) / 2 : hi - 1;
        if (__atomic_compare_exchange_n(span, &v, (uint64_t)lo | (uint64_t)from << 32, 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            if (from + 1 < hi)
                __atomic_store_n(own, (uint64_t)(from + 1) | (uint64_t)hi << 32,
                                 __ATOMIC_RELAXED);
            return (int)from;
        }
    }
}

/* The next chunk for thread t: spans [n][stride], this phase's at offset 0, one for each
 * thread asked for (a team that came smaller leaves the missing threads' to be taken) */
static inline int take(uint64_t *spans, size_t stride, int t, int n) {
    uint64_t *own = spans + (size_t)t * stride;
    int c = take_front(own);
    for (int k = 1; c < 0 && k < n; k++)
        c = take_half(spans + (size_t)((t + k) % n) * stride, own);
    return c;
}

/* phase's span of n chunks for each of nt threads: an even split */
static void split_spans(uint64_t *spans, size_t stride, int phase, int n, int nt) {
    for (int t = 0; t < nt; t++) {
        const uint64_t lo = (uint64_t)((int64_t)n * t / nt), hi = (uint64_t)((int64_t)n * (t + 1) / nt);
        spans[(size_t)t * stride + phase] = lo | hi << 32;
    }
}

/* Attention item c of a layer: task c / KVH (a sequence's chunk of positions), kv head
 * c % KVH. Kv heads innermost: a thread's share of the items then reads whole positions
 * of the cache (every kv head's row), one stream a task. (Tasks innermost, its share read
 * a third of each position's lines: at batch 2 the q/k/v phase, which asks for them,
 * took 1.11 times as long and attention 1.16.) */
static inline int item_task(int c, int KVH) { return c / KVH; }
static inline int item_head(int c, int KVH) { return c % KVH; }

/* A layer's K and V, asked for into L2 while its q, k and v stream their weights:
 * attention reads a few hundred positions of cache rows scattered over pages, and after a
 * step's ~100 MB of weights have passed through the caches every row is a miss that the
 * next one waits behind (the kernel's own prefetch, one tile ahead, is too short a
 * distance). Asked for during q/k/v, the misses overlap the weights' stream. A thread asks
 * for the rows of its own share of the layer's attention items (the even split of their
 * span, which it takes first), a few rows per q/k/v chunk it computes. (Asked for earlier,
 * during the layer before's gate and up, the step was 2-3 % longer at batch 1: ~450 KiB a
 * core of weights then pass through L2 before attention reads the rows; RESULTS.md.) */
typedef struct {
    int c, c1;   /* attention items [c, c1): (task, kv head) as the attention phase numbers them */
    int t;       /* the next position of item c */
    int per;     /* positions asked for per q/k/v chunk */
} kv_ahead;

#ifndef KV_AHEAD
#define KV_AHEAD 1  /* 0: not asked for ahead (benchmarks/decode_step_builds.py compares) */
#endif

/* items: the thread's span of the layer's attention items; chunks: its span of the layer's
 * q/k/v chunks (the rows are spread over them) */
static kv_ahead kv_ahead_plan(const uint64_t *items, const uint64_t *chunks,
                              const da_task *tasks, int KVH) {
    const uint64_t v = __atomic_load_n(items, __ATOMIC_RELAXED);
    const uint64_t w = __atomic_load_n(chunks, __ATOMIC_RELAXED);
    const int n = (int)(uint32_t)(w >> 32) - (int)(uint32_t)w;
    kv_ahead k = {(int)(uint32_t)v, (int)(uint32_t)(v >> 32), 0, 0};
    int64_t rows = 0;
    for (int c = k.c; c < k.c1; c++) {
        const da_task *tk = &tasks[item_task(c, KVH)];
        rows += tk->t1 - tk->t0;
    }
    k.per = n > 0 ? (int)((rows + n - 1) / n) : 0;
    return k;
}

static void kv_ahead_next(kv_ahead *k, const pd_model *m, const pd_layer *ly,
                          const da_task *tasks, const int32_t *tables, int64_t bt_s) {
    const int KVH = m->KVH, D = m->D;
    const int64_t row = (int64_t)KVH * D;
    for (int n = KV_AHEAD ? k->per : 0; n > 0 && k->c < k->c1;) {
        const da_task *tk = &tasks[item_task(k->c, KVH)];
        if (k->t < tk->t0) k->t = tk->t0;
        if (k->t >= tk->t1) {
            k->c++;
            k->t = 0;
            continue;
        }
        const int64_t blk = tables[tk->b * bt_s + k->t / m->block_size];
        if (blk >= 0) {
            const int64_t at = (pd_kv_slot(blk, k->t, m->block_size) * row
                                + (int64_t)item_head(k->c, KVH) * D) * (int64_t)sizeof(bf16);
            for (int x = 0; x < D * (int)sizeof(bf16); x += 64) {
                _mm_prefetch(ly->k_cache + at + x, _MM_HINT_T1);
                _mm_prefetch(ly->v_cache + at + x, _MM_HINT_T1);
            }
        }
        k->t++;
        n--;
    }
}

/* The next phase's weights, asked for while this one ends. Each phase's share of a
 * thread is a stream of its own, 100-550 KiB at batch 1, and the hardware's prefetchers
 * only take up a stream after its first misses: 150 times a step a thread would start
 * one from cold. So a thread asks for the first lines of its share of the next phase's
 * weights (the even split of their span, which it takes first) as it computes its last
 * chunks of this one, and more while it waits for the others; and for the o projection's
 * share while the layer's attention computes, which reads no weights. Software prefetches
 * issued in a burst of hundreds are dropped (a prefetched 104 KiB range read no faster
 * than a cold one on the 2-core EPYC), so they go a few at a time. */
typedef struct {
    const char *p[2], *end[2];  /* the lines still to ask for: up to two ranges (gate, up) */
} w_ahead;

#ifndef W_AHEAD
#define W_AHEAD 1  /* 0: not asked for ahead (benchmarks/decode_step_builds.py compares) */
#endif
#ifndef W_AHEAD_LAST
#define W_AHEAD_LAST 16  /* lines of each range per chunk: a phase's last two own chunks and
                          * those a thread takes from the others */
#endif
#ifndef W_AHEAD_WAIT
#define W_AHEAD_WAIT 4  /* lines of each range on each look at the others' progress */
#endif
#ifndef W_AHEAD_ITEM
#define W_AHEAD_ITEM 32  /* lines of each range before each attention item */
#endif

static inline void w_ahead_next(w_ahead *w, int lines) {
    if (!W_AHEAD || !w) return;
    for (int r = 0; r < 2; r++)
        for (int n = lines; n > 0 && w->p[r] < w->end[r]; n--, w->p[r] += 64)
            _mm_prefetch(w->p[r], _MM_HINT_T0);
}

/* blocks of 16 outputs of an int4 projection with k inputs (10 bytes a group of 32 an
 * output) in about CHUNK_BYTES of weights */
static inline int chunk_blocks(int k) {
    const int n = CHUNK_BYTES / (k / 32 * 320);
    return n > 0 ? n : 1;
}

static inline int chunks(int n, int per) { return (n + per - 1) / per; }

/* A chunk's thread, as the others see it: the chunk it runs (RUNNING | layer * PHASES +
 * phase in the high word | the chunk), TAKEN instead once another took it over, 0 between
 * chunks; and the earliest layer whose buffers it may still read (the ring's guard; -1
 * before it has begun the step). */
typedef struct {
    uint64_t v;
    int layer;
    char pad[64 - 12];
} worker;

#define RUNNING ((uint64_t)1 << 63)
#define TAKEN ((uint64_t)1 << 62)

/* How long a thread that has run out of chunks waits for the others' last before it
 * computes them itself, in time-stamp counter ticks (~0.4 ns each on the 2.6 GHz dev
 * machine): three times its own
 * mean chunk in this phase, plus REDO_AFTER; REDO_IDLE when it ran none. Past
 * YIELD_AFTER, a wait gives up its core between looks (a team larger than the cores). */
#ifndef REDO_AFTER
#define REDO_AFTER 5000
#endif
#define REDO_IDLE 20000
#define YIELD_AFTER 200000
#ifndef TAKE_OVER
#define TAKE_OVER 1  /* 0: wait for every chunk however long (decode_step_builds.py compares) */
#endif
/* The ring's size: as many layers' buffers as fit in RING_BYTES, at least 2, at most all */
#ifndef RING_BYTES
#define RING_BYTES (256 << 10)
#endif

/* What every thread of a step reads. Layer li's outputs lie in ring slot li % ring: q, k,
 * v [B, nh, D], attention's [B, H, D] (with comb_each, each thread's own s->att instead:
 * the slot's holds only batch padding's zeros) and a split context's parts (per task: m [H],
 * l [H], acc [H, D]), o's [B, hidden], silu(gate) * up [B, I] and down's [B, hidden]. A
 * thread writes a layer's slot once every thread has passed the layer that used it before
 * (wait_ring). */
typedef struct {
    const pd_layer *layers;
    const pd_model *m;
    int B, threads, ring;
    const bf16 *x0, *cos, *sin;  /* layer 0's input (the embeddings), the rotary tables */
    const int32_t *tables, *seq_lens;
    int64_t bt_s, per_task;
    const int64_t *slots;
    const da_task *tasks;
    const int *first;            /* sequence g's tasks: [first[g], first[g + 1]) */
    int whole, oc, gc, dc;
    int count;                   /* attention tasks (every layer's alike) */
    int comb_each;               /* a split context combined by every thread for itself */
    const uint8_t *head;         /* the Q8_0 LM head, or NULL */
    int vocab_blocks;
    int n[PHASES];               /* each phase's chunks (every layer's alike) */
    char *slot0;
    size_t slot_bytes, at_att, at_parts, at_xo, at_act, at_xd;
    uint64_t *spans;             /* [thread][layer * PHASES + phase, then the head's] */
    size_t stride;
    uint32_t *done;              /* chunks done, [thread][layer * PHASES + phase] */
    size_t done_stride;
    worker *workers;             /* [thread] */
} step_ctx;

static inline char *slot(const step_ctx *x, int li) {
    return x->slot0 + (size_t)(li % x->ring) * x->slot_bytes;
}
static inline bf16 *qkv_of(const step_ctx *x, int li) { return (bf16 *)slot(x, li); }
static inline bf16 *att_of(const step_ctx *x, int li) {
    return (bf16 *)(slot(x, li) + x->at_att);
}
static inline float *parts_of(const step_ctx *x, int li) {
    return (float *)(slot(x, li) + x->at_parts);
}
static inline bf16 *xo_of(const step_ctx *x, int li) { return (bf16 *)(slot(x, li) + x->at_xo); }
static inline bf16 *act_of(const step_ctx *x, int li) {
    return (bf16 *)(slot(x, li) + x->at_act);
}
static inline bf16 *xd_of(const step_ctx *x, int li) { return (bf16 *)(slot(x, li) + x->at_xd); }
/* layer li's input: the embeddings, then the layer before's down projection */
static inline const bf16 *input_of(const step_ctx *x, int li) {
    return li ? xd_of(x, li - 1) : x->x0;
}

static da_args att_args(const step_ctx *x, int li) {
    const pd_model *m = x->m;
    const da_args a = {(const char *)qkv_of(x, li), (int64_t)(m->H + 2 * m->KVH) * m->D, m->D,
                       x->layers[li].k_cache, x->layers[li].v_cache, x->tables, x->bt_s, 0,
                       (char *)att_of(x, li), m->H, m->KVH, m->D, m->block_size, DA_BF16,
                       m->scale};
    return a;
}

/* q, k or v head h of every row: computed in s->head, q and k rotated, then stored into
 * the layer's q/k/v, and k and v into their cache slots */
static void qkv_head(const step_ctx *x, step_private *s, int li, int h) {
    const pd_model *m = x->m;
    const int H = m->H, KVH = m->KVH, D = m->D, nh = H + 2 * KVH;
    const pd_layer *ly = &x->layers[li];
    const uint8_t *w = ly->qkv + (size_t)h * (D / 16) * (m->hidden / 32) * 320;
    pd_int4_blocks(w, m->hidden, 0, D / 16, s->xq, s->sx, s->sumx, x->B, (char *)s->head,
                   (size_t)D * 2, 1);
    bf16 *qkv = qkv_of(x, li);
    for (int b = 0; b < x->B; b++) {
        bf16 *row = s->head + (size_t)b * D;
        if (h < H + KVH)
            pd_rotate_head(row, D, x->cos + (size_t)b * D, x->sin + (size_t)b * D);
        memcpy(qkv + ((size_t)b * nh + h) * D, row, (size_t)D * 2);
        if (h < H || x->slots[b] < 0) continue;
        const int is_k = h < H + KVH, kv = is_k ? h - H : h - H - KVH;
        char *cache = is_k ? ly->k_cache : ly->v_cache;
        memcpy(cache + (size_t)(x->slots[b] * KVH + kv) * D * 2, row, (size_t)D * 2);
    }
}

/* Chunk c of layer li's phase ph, from this thread's s (its quantized input of the phase) */
static void run_chunk(const step_ctx *x, step_private *s, int li, int ph, int c) {
    const pd_model *m = x->m;
    const pd_layer *ly = &x->layers[li];
    const int B = x->B, H = m->H, KVH = m->KVH, D = m->D, hidden = m->hidden, I = m->I;
    switch (ph) {
    case PH_QKV:
        qkv_head(x, s, li, c);
        return;
    case PH_ATT: {  /* (task, kv head): its heads' sums in s->parts, then stored */
        const int i = item_task(c, KVH), k = item_head(c, KVH), G = H / KVH;
        const da_args a = att_args(x, li);
        float *p = s->parts;
        pd_da_run(&a, &x->tasks[i], k, k + 1, 0,
                  qkv_of(x, li) + (size_t)x->tasks[i].b * (H + 2 * KVH) * D, p, p + H,
                  p + 2 * H);
        if (x->whole) {
            pd_da_write(&a, x->tasks[i].b, k * G, (k + 1) * G, p + H, p + 2 * H);
            return;
        }
        float *to = parts_of(x, li) + i * x->per_task;
        memcpy(to + k * G, p + k * G, sizeof(float) * G);
        memcpy(to + H + k * G, p + H + k * G, sizeof(float) * G);
        memcpy(to + 2 * H + (size_t)k * G * D, p + 2 * H + (size_t)k * G * D,
               sizeof(float) * G * D);
        return;
    }
    case PH_COMB: {  /* sequence c's chunks */
        const da_args a = att_args(x, li);
        pd_da_combine(&a, x->tasks, x->first[c], x->first[c + 1], parts_of(x, li),
                      x->per_task, s->l, s->acc);
        return;
    }
    case PH_O:
        pd_int4_blocks(ly->o, H * D, c * x->oc, min_int((c + 1) * x->oc, hidden / 16), s->xq,
                       s->sx, s->sumx, B, (char *)xo_of(x, li), (size_t)hidden * 2, 1);
        return;
    case PH_GU: {  /* gate's blocks and up's, then silu(gate) * up of those columns */
        const int c0 = c * x->gc, c1 = min_int(c0 + x->gc, I / 16);
        pd_int4_blocks(ly->gate_up, hidden, c0, c1, s->xq, s->sx, s->sumx, B, (char *)s->gu,
                       (size_t)I * 4, 1);
        pd_int4_blocks(ly->gate_up, hidden, I / 16 + c0, I / 16 + c1, s->xq, s->sx, s->sumx, B,
                       (char *)s->gu, (size_t)I * 4, 1);
        bf16 *act = act_of(x, li);
        for (int b = 0; b < B; b++) {
            const bf16 *row = s->gu + (size_t)b * 2 * I;
            pd_silu_mul_row(row + c0 * 16, row + I + c0 * 16, act + (size_t)b * I + c0 * 16,
                            (c1 - c0) * 16);
        }
        return;
    }
    case PH_DOWN:
        pd_int4_blocks(ly->down, I, c * x->dc, min_int((c + 1) * x->dc, hidden / 16), s->xq,
                       s->sx, s->sumx, B, (char *)xd_of(x, li), (size_t)hidden * 2, 1);
        return;
    }
}

/* For tests only (tests/unit/test_native_decode_step.py), process-wide: a stall
 * (pd_decode_step_stall). Thread `thread` sleeps `us` microseconds in its first chunk of
 * layer `layer`'s phase `phase`, or with thread -1 whichever thread runs the phase's chunk
 * 0, before computing it (where 0) or after (where 1); or (layer and phase -1, where 0)
 * thread `thread` sleeps before its first layer. In every step until it is cleared (us 0). While one is set, each step's
 * scratch is filled with NaNs first: a chunk no thread computed cannot pass for one
 * computed by an earlier step at the same address. */
static struct {
    int thread, layer, phase, where;
    int64_t us;
} stall = {-1, -1, -1, -1, 0};
static uint64_t redone;  /* chunks computed again by a thread that did not take them */

void pd_decode_step_stall(int thread, int layer, int phase, int where, int64_t us) {
    stall.thread = thread, stall.layer = layer, stall.phase = phase, stall.where = where;
    __atomic_store_n(&stall.us, us, __ATOMIC_RELEASE);
}

uint64_t pd_decode_step_redone(void) { return __atomic_load_n(&redone, __ATOMIC_RELAXED); }

static inline void stall_point(int t, int li, int ph, int where, int first, int c) {
    if (__builtin_expect(__atomic_load_n(&stall.us, __ATOMIC_ACQUIRE) > 0, 0)
            && (stall.thread < 0 ? c == 0 : first && t == stall.thread) && li == stall.layer
            && ph == stall.phase && where == stall.where) {
        const struct timespec ts = {stall.us / 1000000, stall.us % 1000000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static inline void count_done(const step_ctx *x, int t, size_t at) {
    uint32_t *d = &x->done[(size_t)t * x->done_stride + at];
    __atomic_store_n(d, *d + 1, __ATOMIC_RELEASE);  /* only thread t writes its counts */
}

/* Each other thread's chunk of this phase that it is still running: taken over (its
 * thread will not count it) and computed here */
static void take_over(const step_ctx *x, step_private *s, int t, int li, int ph) {
    const uint64_t at = (uint64_t)li * PHASES + ph;
    for (int u = 0; u < x->threads; u++) {
        if (u == t) continue;
        uint64_t v = __atomic_load_n(&x->workers[u].v, __ATOMIC_ACQUIRE);
        if (!(v & RUNNING) || ((v >> 32) & ~(uint64_t)0xC0000000u) != at) continue;
        if (!__atomic_compare_exchange_n(&x->workers[u].v, &v, (v & ~RUNNING) | TAKEN, 0,
                                         __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;  /* it finished meanwhile */
        run_chunk(x, s, li, ph, (int)(uint32_t)v);
        count_done(x, t, at);
        __atomic_add_fetch(&redone, 1, __ATOMIC_RELAXED);
    }
}

/* Until every chunk of layer li's phase ph is done: this thread ran `mine` of them since
 * tick t0 (wa: the next weights, asked for on each look) */
static void wait_phase(const step_ctx *x, step_private *s, int t, int li, int ph,
                       uint64_t t0, int mine, w_ahead *wa) {
    const size_t at = (size_t)li * PHASES + ph;
    uint64_t start = 0, patience = 0;
    for (;;) {
        uint32_t sum = 0;
        for (int u = 0; u < x->threads; u++)
            sum += __atomic_load_n(&x->done[(size_t)u * x->done_stride + at],
                                   __ATOMIC_ACQUIRE);
        if (sum >= (uint32_t)x->n[ph]) return;
        const uint64_t now = __rdtsc();
        if (!start) {
            start = now;
            patience = mine ? (now - t0) / mine * 3 + REDO_AFTER : REDO_IDLE;
        } else if (TAKE_OVER && now - start > patience) {
            take_over(x, s, t, li, ph);
            patience += patience;
        }
        w_ahead_next(wa, W_AHEAD_WAIT);
        if (now - start > YIELD_AFTER)
            sched_yield();
        else
            _mm_pause();
    }
}

/* Layer li's phase ph on this thread: its chunks as take() hands them out, then the wait
 * for the others' (kv: the layer's K and V asked for along the way; wa: the next
 * weights) */
static void run_phase(const step_ctx *x, step_private *s, int t, int li, int ph,
                      kv_ahead *kv, w_ahead *wa) {
    if (!x->n[ph]) return;
    uint64_t *sp = x->spans + (size_t)li * PHASES + ph;
    worker *me = &x->workers[t];
    const uint64_t t0 = __rdtsc(), at = (uint64_t)li * PHASES + ph;
    int mine = 0;
    for (int c; (c = take(sp, x->stride, t, x->threads)) >= 0; mine++) {
        /* published first: a thread preempted from here on can be gone past (between
         * take() and this store, and between the swap below and its count, it cannot) */
        uint64_t v = RUNNING | at << 32 | (uint32_t)c;
        __atomic_store_n(&me->v, v, __ATOMIC_RELEASE);
        if (kv) kv_ahead_next(kv, x->m, &x->layers[li], x->tasks, x->tables, x->bt_s);
        if (wa) {
            const uint64_t own = __atomic_load_n(sp + (size_t)t * x->stride, __ATOMIC_RELAXED);
            if (ph == PH_ATT || ph == PH_COMB)
                w_ahead_next(wa, W_AHEAD_ITEM);
            else if ((uint32_t)(own >> 32) - (uint32_t)own < 2)  /* its last two own chunks,
                                                                   * and any it takes */
                w_ahead_next(wa, W_AHEAD_LAST);
        }
        stall_point(t, li, ph, 0, mine == 0, c);
        run_chunk(x, s, li, ph, c);
        stall_point(t, li, ph, 1, mine == 0, c);
        if (__atomic_compare_exchange_n(&me->v, &v, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            count_done(x, t, at);
        else
            __atomic_store_n(&me->v, 0, __ATOMIC_RELAXED);  /* taken over: counted there */
    }
    const uint64_t tw = prof_now();
    wait_phase(x, s, t, li, ph, t0, mine, wa);
    prof_add(t, ph, t0, tw);
    prof_add(t, PR_WAIT + ph, tw, prof_now());
}

/* Before a thread writes layer li's ring slot: every thread of the team (nt) is past the
 * layer that used it */
static void wait_ring(const step_ctx *x, int li, int nt) {
    if (li < x->ring) return;
    const uint64_t start = __rdtsc();
    for (int u = 0; u < nt; u++)
        while (__atomic_load_n(&x->workers[u].layer, __ATOMIC_ACQUIRE) <= li - x->ring) {
            if (__rdtsc() - start > YIELD_AFTER)
                sched_yield();
            else
                _mm_pause();
        }
}

/* Thread t's share of the weights of layer li's phase ph (PH_QKV, PH_O, PH_GU or
 * PH_DOWN; layer L: the LM head's, or none), from its span of the phase before it is taken
 * from */
static w_ahead w_ahead_plan(const step_ctx *x, int t, int li, int ph) {
    const pd_model *m = x->m;
    w_ahead w = {{0, 0}, {0, 0}};
    const uint64_t *sp = x->spans + (size_t)t * x->stride + (size_t)li * PHASES
                         + (li < m->L ? ph : 0);
    const uint64_t v = __atomic_load_n(sp, __ATOMIC_RELAXED);
    const int lo = (int)(uint32_t)v, hi = (int)(uint32_t)(v >> 32);
    if (lo >= hi) return w;
    size_t block;     /* bytes of a block of 16 outputs */
    int per, nb;      /* blocks a chunk, blocks in all */
    const char *base;
    if (li == m->L) {
        if (!x->head) return w;
        block = (size_t)(m->hidden / 32) * 544, per = HEAD_CHUNK, nb = x->vocab_blocks;
        base = (const char *)x->head;
    } else {
        const pd_layer *ly = &x->layers[li];
        switch (ph) {
        case PH_QKV:  /* a chunk is a head */
            block = (size_t)(m->hidden / 32) * 320, per = m->D / 16;
            nb = (m->H + 2 * m->KVH) * per, base = (const char *)ly->qkv;
            break;
        case PH_O:
            block = (size_t)(m->H * m->D / 32) * 320, per = x->oc, nb = m->hidden / 16;
            base = (const char *)ly->o;
            break;
        case PH_GU:
            block = (size_t)(m->hidden / 32) * 320, per = x->gc, nb = m->I / 16;
            base = (const char *)ly->gate_up;
            break;
        case PH_DOWN:
            block = (size_t)(m->I / 32) * 320, per = x->dc, nb = m->hidden / 16;
            base = (const char *)ly->down;
            break;
        default:  /* attention and combining read no weights */
            return w;
        }
    }
    const int b0 = min_int(lo * per, nb), b1 = min_int(hi * per, nb);
    w.p[0] = base + (size_t)b0 * block, w.end[0] = base + (size_t)b1 * block;
    if (li < m->L && ph == PH_GU) {  /* up's blocks, I / 16 after gate's */
        const size_t up = (size_t)nb * block;
        w.p[1] = w.p[0] + up, w.end[1] = w.end[0] + up;
    }
    return w;
}

/* Layer li on thread t of a team of nt */
static void run_layer(const step_ctx *x, step_private *s, int t, int nt, int li) {
    const pd_model *m = x->m;
    const pd_layer *ly = &x->layers[li];
    const int B = x->B;
    uint64_t p0 = prof_now();
    norm_rows(m, B, input_of(x, li), ly->ln1, li == 0, s);
    __atomic_store_n(&x->workers[t].layer, li, __ATOMIC_RELEASE);  /* done with li - 1's */
    uint64_t p1 = prof_now();
    wait_ring(x, li, nt);
    prof_add(t, PR_NORMS, p0, p1);
    prof_add(t, PR_RING, p1, prof_now());
    const uint64_t *sp = x->spans + (size_t)li * PHASES + (size_t)t * x->stride;
    kv_ahead kv = kv_ahead_plan(sp + PH_ATT, sp + PH_QKV, x->tasks, m->KVH);
    run_phase(x, s, t, li, PH_QKV, &kv, NULL);
    bf16 *att = att_of(x, li);
    for (int b = 0; b < B; b++)  /* batch padding: zeros, as the kernel's (every thread) */
        if (x->seq_lens[b] == 0) memset(att + (size_t)b * m->H * m->D, 0, (size_t)m->H * m->D * 2);
    w_ahead wa = w_ahead_plan(x, t, li, PH_O);
    run_phase(x, s, t, li, PH_ATT, NULL, &wa);
    run_phase(x, s, t, li, PH_COMB, NULL, &wa);
    p0 = prof_now();
    if (x->comb_each) {  /* fewer sequences with tasks than threads: each combines them all */
        da_args a = att_args(x, li);
        a.out = (char *)s->att;
        for (int b = 0; b < B; b++)
            if (x->seq_lens[b] == 0) memset(s->att + (size_t)b * m->H * m->D, 0, (size_t)m->H * m->D * 2);
        for (int g = 0; x->first[g] < x->count; g++)
            pd_da_combine(&a, x->tasks, x->first[g], x->first[g + 1], parts_of(x, li),
                          x->per_task, s->l, s->acc);
        att = s->att;
        prof_add(t, PH_COMB, p0, prof_now());
    }
    p0 = prof_now();
    pd_int4_quantize(att, 1, B, m->H * m->D, s->xq, s->sx, s->sumx);
    prof_add(t, PR_NORMS, p0, prof_now());
    wa = w_ahead_plan(x, t, li, PH_GU);
    run_phase(x, s, t, li, PH_O, NULL, &wa);
    p0 = prof_now();
    norm_rows(m, B, xo_of(x, li), ly->ln2, 0, s);
    prof_add(t, PR_NORMS, p0, prof_now());
    wa = w_ahead_plan(x, t, li, PH_DOWN);
    run_phase(x, s, t, li, PH_GU, NULL, &wa);
    p0 = prof_now();
    pd_int4_quantize(act_of(x, li), 1, B, m->I, s->xq, s->sx, s->sumx);
    prof_add(t, PR_NORMS, p0, prof_now());
    wa = w_ahead_plan(x, t, li + 1, PH_QKV);
    run_phase(x, s, t, li, PH_DOWN, NULL, &wa);
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

/* The layers' forward for B decode tokens: x [B, hidden] the embeddings, out [B, hidden]
 * the final norm's. cos, sin [B, D] the
 * rotary tables (sin with rotate_half's sign), tables int32 [B, bt_s], seq_lens int32 [B]
 * (cached + this token), slots int64 [B]. With head (q8_gemm.c's packing of a Q8_0 LM
 * head of vocab outputs), tokens [B] gets each row's greedy token: the index of its
 * largest logit, the first on ties, the logits q8_mm computes from out; -1 for a row
 * whose logits hold a NaN. With lk, the step looks its tokens up itself and x, cos and
 * sin are not read (x may be NULL). Returns 0, -1 when out of memory, -2 for shapes the
 * kernels cannot take (the caller checks them first), -3 for a token id or position out
 * of lk's range. */
int pd_decode_step(const pd_layer *layers, const pd_model *m, int B, const bf16 *x,
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
    const size_t ntasks = (size_t)B * split;
    step_ctx c = {.layers = layers, .m = m, .B = B, .threads = threads, .x0 = x, .cos = cos,
                  .sin = sin, .tables = tables, .seq_lens = seq_lens, .bt_s = bt_s,
                  .per_task = (int64_t)H * (D + 2), .slots = slots, .whole = split == 1,
                  .oc = chunk_blocks(H * D), .gc = (chunk_blocks(hidden) + 1) / 2,
                  .dc = chunk_blocks(I), .head = head, .vocab_blocks = (vocab + 15) / 16};
    /* a ring slot: one layer's outputs */
    size_t sb = 0;
    put(&sb, (size_t)B * nh * D * 2);
    c.at_att = put(&sb, (size_t)B * H * D * 2);
    c.at_parts = put(&sb, c.whole ? 0 : ntasks * c.per_task * 4);
    c.at_xo = put(&sb, (size_t)B * hidden * 2);
    c.at_act = put(&sb, (size_t)B * I * 2);
    c.at_xd = put(&sb, (size_t)B * hidden * 2);
    c.slot_bytes = sb;
    c.ring = RING_BYTES / sb < 2 ? 2 : (int)(RING_BYTES / sb);
    if (c.ring > m->L) c.ring = m->L;
    /* the scratch: every phase's spans and done counts, [thread][layer * PHASES + phase,
     * then the head's spans], a thread's own on cache lines of their own */
    c.stride = ALIGN(((size_t)m->L * PHASES + 1) * 8) / 8;
    c.done_stride = ALIGN((size_t)m->L * PHASES * 4) / 4;
    size_t shared = 0;
    const size_t o_ring = put(&shared, (size_t)c.ring * sb);
    const size_t o_tasks = put(&shared, ntasks * sizeof(da_task));
    const size_t o_first = put(&shared, ((size_t)B + 1) * sizeof(int));
    const size_t o_best = put(&shared, (size_t)threads * B * 4);  /* the head's pick */
    const size_t o_at = put(&shared, (size_t)threads * B * 8);
    const size_t o_spans = put(&shared, (size_t)threads * c.stride * 8);
    const size_t o_done = put(&shared, (size_t)threads * c.done_stride * 4);
    const size_t o_workers = put(&shared, (size_t)threads * sizeof(worker));
    const size_t o_lookup = put(&shared, lk ? (size_t)B * hidden * 2 : 0);
    const size_t o_cos = put(&shared, lk ? (size_t)B * D * 2 : 0);
    const size_t o_sin = put(&shared, lk ? (size_t)B * D * 2 : 0);
    /* a split context's chunks combined: by one thread a sequence (a phase of its own), or
     * where the sequences with tasks (pd_da_tasks gives batch padding none) are fewer than
     * the threads, by every thread for itself (the others would only wait for it) */
    int live = 0;
    for (int b = 0; b < B; b++) live += seq_lens[b] > 0;
    c.comb_each = !c.whole && live < threads;
    const size_t priv = private_layout(m, B, kmax, c.comb_each, NULL);
    char *mem = aligned_alloc(64, shared + (size_t)threads * priv);
    if (!mem) return -1;
    if (__atomic_load_n(&stall.us, __ATOMIC_ACQUIRE) > 0)  /* a test's: nothing left over */
        memset(mem, 0xFF, shared + (size_t)threads * priv);  /* from a step before counts */
    c.slot0 = mem + o_ring;
    da_task *tasks = (da_task *)(mem + o_tasks);
    int *first = (int *)(mem + o_first);
    float *best = (float *)(mem + o_best);
    int64_t *at = (int64_t *)(mem + o_at);
    c.spans = (uint64_t *)(mem + o_spans);
    c.done = (uint32_t *)(mem + o_done);
    c.workers = (worker *)(mem + o_workers);
    memset(c.done, 0, (size_t)threads * c.done_stride * 4);
    for (int t = 0; t < threads; t++)  /* not started: the ring waits for it */
        c.workers[t] = (worker){0, -1, {0}};
    int team = 1;
    const int count = pd_da_tasks(B, seq_lens, 0, split, tasks);
    int groups = 0;
    for (int i = 0; i < count; i++)
        if (i == 0 || tasks[i].b != tasks[i - 1].b) first[groups++] = i;
    first[groups] = count;
    c.tasks = tasks, c.first = first;
    if (lk) {  /* x, cos and sin from the step's own lookup, in its scratch */
        bf16 *own = (bf16 *)(mem + o_lookup), *cs = (bf16 *)(mem + o_cos);
        bf16 *sn = (bf16 *)(mem + o_sin);
        if (look_up(lk, m, B, own, cs, sn)) {
            free(mem);
            return -3;
        }
        c.x0 = own, c.cos = cs, c.sin = sn;
    }
    c.count = count;
    const int n[PHASES] = {nh, count * KVH, c.whole || c.comb_each ? 0 : groups,
                           chunks(hidden / 16, c.oc),
                           chunks(I / 16, c.gc), chunks(hidden / 16, c.dc)};
    memcpy(c.n, n, sizeof(n));
    for (int li = 0; li < m->L; li++)
        for (int ph = 0; ph < PHASES; ph++)
            split_spans(c.spans, c.stride, li * PHASES + ph, n[ph], threads);
    split_spans(c.spans, c.stride, m->L * PHASES, chunks((vocab + 15) / 16, HEAD_CHUNK),
                threads);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        step_private s = {.res = (bf16 *)(mem + shared + (size_t)t * priv)};
        private_layout(m, B, kmax, c.comb_each, &s);
        stall_point(t, -1, -1, 0, 1, -1);  /* a thread that comes to the step late */
        const uint64_t p0 = prof_now();
        for (int li = 0; li < m->L; li++) run_layer(&c, &s, t, nt, li);
        if (t == 0) team = nt;
        const uint64_t p1 = prof_now();
        final_rows(m, B, xd_of(&c, m->L - 1), norm_w, head, vocab, c.spans + m->L * PHASES,
                   c.stride, threads, t, nt, &s, out, best + (size_t)t * B,
                   at + (size_t)t * B);
        prof_add(t, PR_HEAD, p1, prof_now());
        prof_add(t, PR_TEAM, p0, prof_now());
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
