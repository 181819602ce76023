/* Stress and determinism harness for the engine's native kernels
 * (services/engine/torch_backend/kernels: paged_attention.c, fused_ops.c,
 * int_matmul.c),
 * built and run by tests/engine/test_kernel_harness.py under ASan/UBSan and
 * with the production flags.
 *
 * Usage: kernel_harness MODE SEED NCASES [MAXCACHED] [MAXNEW] [BUDGET] [REFSAMPLES] [GROUP]
 *   MODE: attn | fused | intmm | edge | bad_group_nondiv | bad_group_zero
 *   attn: random shapes (head_dim, heads per KV head, block size, sequences,
 *     cached and new tokens, fp32/bf16 in and out, 1-2 threads), each run in
 *     five schedules (one prefill then the new tokens; the other output dtype;
 *     random chunks, batches, order, threads and padding; each sequence alone;
 *     batched decode rounds): outputs within ~1e-5 of a double-precision
 *     reference, bit-identical across schedules, the same cache contents,
 *     untouched slots and padding rows never written.
 *   fused: add_rms_norm / silu_mul against a reference, a batch against rows.
 *   intmm: llmesh_q4_1_matmul and llmesh_q8_matmul on random shapes (rows
 *     0..20, out 1..70, in 32..320, fp32/bf16 in and out, 1-4 threads; weights
 *     packed here from the layout in int_matmul.c's header, padding features
 *     random; rows with exact ties, block maxima around 1e-30 and NaN/inf):
 *     every output bit-identical to a scalar reference doing the kernel's fp32
 *     operations (int16 activations per row and 32 inputs, fmaf per block in
 *     input order; NaN where the reference is NaN), each row alone and a
 *     random slice of rows equal to the batch, nothing written past the
 *     output; and the shapes both refuse (-1).
 *   edge: empty plans and rejected shapes.
 * Exit status 0 = all checks passed; "FAIL" lines describe a failing case.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llmesh_kernels.h"

/* ------------------------------------------------------------------ utils */
static uint64_t rng_state;
static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static int64_t rint_(int64_t lo, int64_t hi) { return lo + (int64_t)(rnd() % (uint64_t)(hi - lo + 1)); }
static double runif(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
static float frand(float lo, float hi) { return (float)(lo + (hi - lo) * runif()); }

static uint32_t fbits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static float bitsf(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static uint16_t f2bf(float f) { /* same rule as the kernel */
    uint32_t bits = fbits(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}
static float bf2f(uint16_t h) { return bitsf((uint32_t)h << 16); }
static float bfround(float f) { return bf2f(f2bf(f)); }

static long failures = 0;
#define FAIL(...) do { failures++; if (failures <= 40) { printf("FAIL: "); printf(__VA_ARGS__); printf("\n"); fflush(stdout);} } while (0)

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "oom\n"); exit(2); }
    return p;
}

#define CANARY 0x7fa5a5a5u /* a quiet NaN: unwritten cache slots */
#define OUTCANARY8 0xAB

/* ------------------------------------------------------------------ attention case */
#define MAXSEQ 6
typedef struct {
    int dim, kv, group, heads, bs, nseq, bf16_data, threads;
    int64_t cached[MAXSEQ], newt[MAXSEQ], L[MAXSEQ], ntab[MAXSEQ];
    int64_t *table[MAXSEQ];
    int64_t num_blocks, maxL, width;
    float *cos, *sin; /* [maxL][dim] exact */
    float *src[MAXSEQ]; /* [L][width] */
    float scale, qscale;
} Case;

typedef struct { int s; int64_t start, n; } Entry;
typedef struct { Entry e[MAXSEQ]; int ne; int qkv_bf16; int threads; int pad; } Call;

typedef struct {
    float *kc, *vc;
    uint32_t *out[MAXSEQ]; /* [L][heads*dim], fp32 bits or bf16 in low half */
    int *count[MAXSEQ];
} Result;

static int64_t cache_floats(const Case *c) { return (int64_t)c->kv * c->num_blocks * c->bs * c->dim; }

static void describe(const Case *c, char *buf, size_t n) {
    int k = snprintf(buf, n, "dim=%d kv=%d group=%d heads=%d bs=%d nseq=%d bf16data=%d threads=%d seqs=[",
                     c->dim, c->kv, c->group, c->heads, c->bs, c->nseq, c->bf16_data, c->threads);
    for (int s = 0; s < c->nseq && k < (int)n; s++)
        k += snprintf(buf + k, n - k, "%s(%lld+%lld)", s ? "," : "", (long long)c->cached[s], (long long)c->newt[s]);
    if (k < (int)n) snprintf(buf + k, n - k, "]");
}

static void make_case(Case *c, int64_t maxc, int64_t maxn, double budget, int forced_group) {
    static const int DIMS[] = {8, 24, 64, 128, 256};
    static const int GROUPS[] = {1, 2, 3, 4, 5, 6, 7, 8, 32};
    static const int BSS[] = {1, 4, 5, 16, 32, 48};
    memset(c, 0, sizeof *c);
    c->dim = DIMS[rint_(0, 4)];
    c->group = forced_group ? forced_group : GROUPS[rint_(0, 8)];
    c->kv = c->group == 32 ? (int)rint_(1, 2) : (int)rint_(1, 4);
    c->bs = BSS[rint_(0, 5)];
    c->nseq = (int)rint_(1, MAXSEQ);
    c->bf16_data = (int)rint_(0, 1);
    c->threads = (int)rint_(1, 2);
    for (int s = 0; s < c->nseq; s++) {
        c->cached[s] = runif() < 0.2 ? 0 : rint_(0, maxc);
        c->newt[s] = rint_(1, maxn);
    }
    for (;;) { /* keep the work bounded */
        double cost = 0;
        for (int s = 0; s < c->nseq; s++) cost += (double)(c->cached[s] + c->newt[s]) * (c->cached[s] + c->newt[s]);
        cost *= (double)c->kv * c->group * c->dim;
        if (cost <= budget) break;
        if (c->kv > 1) { c->kv--; continue; }
        int changed = 0;
        for (int s = 0; s < c->nseq; s++) {
            if (c->cached[s] > 0) { c->cached[s] = c->cached[s] * 7 / 10; changed = 1; }
            else if (c->newt[s] > 1) { c->newt[s] = (c->newt[s] * 7 + 9) / 10; changed = 1; }
        }
        if (!changed) break;
    }
    c->heads = c->kv * c->group;
    c->width = (int64_t)(c->heads + 2 * c->kv) * c->dim;
    c->scale = 1.0f / sqrtf((float)c->dim);
    c->qscale = runif() < 0.5 ? 1.0f : 4.0f;
    int64_t total_blocks = 0;
    c->maxL = 1;
    for (int s = 0; s < c->nseq; s++) {
        c->L[s] = c->cached[s] + c->newt[s];
        if (c->L[s] > c->maxL) c->maxL = c->L[s];
        c->ntab[s] = (c->L[s] + c->bs - 1) / c->bs;
        total_blocks += c->ntab[s];
    }
    c->num_blocks = total_blocks + rint_(0, 3);
    int64_t *perm = xmalloc(sizeof(int64_t) * c->num_blocks);
    for (int64_t i = 0; i < c->num_blocks; i++) perm[i] = i;
    for (int64_t i = c->num_blocks - 1; i > 0; i--) {
        int64_t j = rint_(0, i), t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    int64_t off = 0;
    for (int s = 0; s < c->nseq; s++) {
        c->table[s] = xmalloc(sizeof(int64_t) * c->ntab[s]);
        memcpy(c->table[s], perm + off, sizeof(int64_t) * c->ntab[s]);
        off += c->ntab[s];
    }
    free(perm);
    /* RoPE tables, exactly maxL positions; sine with its first half negated */
    c->cos = xmalloc(sizeof(float) * c->maxL * c->dim);
    c->sin = xmalloc(sizeof(float) * c->maxL * c->dim);
    const int half = c->dim / 2;
    for (int64_t p = 0; p < c->maxL; p++)
        for (int d = 0; d < c->dim; d++) {
            double inv = pow(10000.0, -2.0 * (d % half) / c->dim);
            c->cos[p * c->dim + d] = (float)cos(p * inv);
            c->sin[p * c->dim + d] = (float)((d < half ? -1 : 1) * sin(p * inv));
        }
    for (int s = 0; s < c->nseq; s++) {
        c->src[s] = xmalloc(sizeof(float) * c->L[s] * c->width);
        for (int64_t p = 0; p < c->L[s]; p++)
            for (int64_t i = 0; i < c->width; i++) {
                float x = frand(-1, 1);
                if (i < (int64_t)c->heads * c->dim) x *= c->qscale;
                if (c->bf16_data) x = bfround(x);
                c->src[s][p * c->width + i] = x;
            }
    }
}

static void free_case(Case *c) {
    for (int s = 0; s < c->nseq; s++) { free(c->table[s]); free(c->src[s]); }
    free(c->cos); free(c->sin);
}

static void result_init(const Case *c, Result *r) {
    const int64_t n = cache_floats(c);
    r->kc = xmalloc(sizeof(float) * n);
    r->vc = xmalloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) { ((uint32_t *)r->kc)[i] = CANARY; ((uint32_t *)r->vc)[i] = CANARY; }
    for (int s = 0; s < c->nseq; s++) {
        r->out[s] = xmalloc(sizeof(uint32_t) * c->L[s] * c->heads * c->dim);
        memset(r->out[s], 0xEE, sizeof(uint32_t) * c->L[s] * c->heads * c->dim);
        r->count[s] = calloc((size_t)c->L[s] + 1, sizeof(int));
    }
}
static void result_free(const Case *c, Result *r) {
    free(r->kc); free(r->vc);
    for (int s = 0; s < c->nseq; s++) { free(r->out[s]); free(r->count[s]); }
}

/* One kernel call. Returns kernel rc. */
static int run_call(const Case *c, const Call *call, int out_bf16, Result *res, const char *tag) {
    int64_t tokens = 0;
    for (int i = 0; i < call->ne; i++) tokens += call->e[i].n;
    /* padding rows at random places */
    const int64_t rows = tokens + call->pad;
    int64_t *row_of_entry = xmalloc(sizeof(int64_t) * (call->ne ? call->ne : 1));
    int8_t *is_pad = calloc((size_t)rows + 1, 1);
    {
        int64_t pads_left = call->pad, row = 0;
        for (int i = 0; i < call->ne; i++) {
            while (pads_left > 0 && runif() < 0.5) { is_pad[row++] = 1; pads_left--; }
            row_of_entry[i] = row;
            row += call->e[i].n;
        }
        while (pads_left-- > 0) is_pad[row++] = 1;
    }
    const int64_t ne = call->ne;
    int64_t *first_row = xmalloc(sizeof(int64_t) * ne), *num = xmalloc(sizeof(int64_t) * ne);
    int64_t *start = xmalloc(sizeof(int64_t) * ne), *tabofs = xmalloc(sizeof(int64_t) * ne);
    int64_t ntables = 0;
    for (int i = 0; i < ne; i++) {
        const Entry *e = &call->e[i];
        ntables += (e->start + e->n + c->bs - 1) / c->bs; /* exactly the blocks it needs */
    }
    int64_t *tables = xmalloc(sizeof(int64_t) * ntables);
    int64_t *slots = xmalloc(sizeof(int64_t) * rows);
    for (int64_t r = 0; r < rows; r++) slots[r] = -1000000; /* padding rows: must not be used */
    void *qkv;
    const int64_t w = c->width;
    if (call->qkv_bf16) {
        uint16_t *q = xmalloc(sizeof(uint16_t) * rows * w);
        for (int64_t i = 0; i < rows * w; i++) q[i] = 0x7fc1; /* NaN in padding rows */
        qkv = q;
    } else {
        uint32_t *q = xmalloc(sizeof(float) * rows * w);
        for (int64_t i = 0; i < rows * w; i++) q[i] = 0x7fc00001u;
        qkv = q;
    }
    int64_t tofs = 0;
    for (int i = 0; i < ne; i++) {
        const Entry *e = &call->e[i];
        first_row[i] = row_of_entry[i];
        num[i] = e->n;
        start[i] = e->start;
        tabofs[i] = tofs;
        const int64_t nt = (e->start + e->n + c->bs - 1) / c->bs;
        memcpy(tables + tofs, c->table[e->s], sizeof(int64_t) * nt);
        tofs += nt;
        for (int64_t t = 0; t < e->n; t++) {
            const int64_t pos = e->start + t, row = first_row[i] + t;
            slots[row] = c->table[e->s][pos / c->bs] * c->bs + pos % c->bs;
            const float *x = c->src[e->s] + pos * w;
            if (call->qkv_bf16)
                for (int64_t k = 0; k < w; k++) ((uint16_t *)qkv)[row * w + k] = f2bf(x[k]);
            else
                memcpy((float *)qkv + row * w, x, sizeof(float) * w);
        }
    }
    const int64_t ow = (int64_t)c->heads * c->dim;
    const size_t esz = out_bf16 ? 2 : 4;
    unsigned char *out = xmalloc(esz * rows * ow);
    memset(out, OUTCANARY8, esz * rows * ow);

    step_plan plan = {0};
    plan.num_tokens = tokens;
    plan.num_seqs = ne;
    plan.seq_first_row = first_row;
    plan.seq_num_tokens = num;
    plan.seq_start = start;
    plan.seq_table = tabofs;
    plan.block_tables = tables;
    plan.slots = slots;
    plan.num_heads = c->heads;
    plan.num_kv_heads = c->kv;
    plan.head_dim = c->dim;
    plan.block_size = c->bs;
    plan.cache_head_stride = c->num_blocks * c->bs * c->dim;
    plan.rope_cos = c->cos;
    plan.rope_sin = c->sin;
    plan.qkv_bf16 = call->qkv_bf16;
    plan.out_bf16 = out_bf16;
    plan.scale = c->scale;
    plan.num_threads = call->threads;
    const int rc = llmesh_paged_attention(&plan, qkv, res->kc, res->vc, out);
    if (rc != 0) FAIL("%s: kernel rc=%d", tag, rc);
    /* padding rows untouched */
    for (int64_t r = 0; r < rows; r++) {
        if (!is_pad[r]) continue;
        for (size_t b = 0; b < esz * ow; b++)
            if (out[r * esz * ow + b] != OUTCANARY8) { FAIL("%s: padding row %lld written", tag, (long long)r); break; }
    }
    for (int i = 0; i < ne; i++) {
        const Entry *e = &call->e[i];
        for (int64_t t = 0; t < e->n; t++) {
            const int64_t pos = e->start + t, row = first_row[i] + t;
            uint32_t *dst = res->out[e->s] + pos * ow;
            for (int64_t k = 0; k < ow; k++) {
                if (out_bf16) dst[k] = ((uint16_t *)out)[row * ow + k];
                else dst[k] = ((uint32_t *)out)[row * ow + k];
            }
            res->count[e->s][pos]++;
        }
    }
    free(row_of_entry); free(is_pad); free(first_row); free(num); free(start); free(tabofs);
    free(tables); free(slots); free(qkv); free(out);
    return rc;
}

static void shuffle_entries(Call *call) {
    for (int i = call->ne - 1; i > 0; i--) {
        int j = (int)rint_(0, i);
        Entry t = call->e[i]; call->e[i] = call->e[j]; call->e[j] = t;
    }
}

/* Schedules -------------------------------------------------------------- */
typedef struct { Call *calls; int n, cap; } Sched;
static void push(Sched *s, Call c) {
    if (s->n == s->cap) { s->cap = s->cap ? 2 * s->cap : 16; s->calls = realloc(s->calls, sizeof(Call) * s->cap); }
    s->calls[s->n++] = c;
}

static int pick_qkv(const Case *c, int base) { return c->bf16_data ? (int)rint_(0, 1) : base; }

/* S0: prefill cached (all seqs, 0-token entries kept), then all new tokens. */
static Sched sched_baseline(const Case *c, int qkv_bf16) {
    Sched s = {0};
    Call a = {0}, b = {0};
    for (int i = 0; i < c->nseq; i++) {
        a.e[a.ne++] = (Entry){i, 0, c->cached[i]};
        b.e[b.ne++] = (Entry){i, c->cached[i], c->newt[i]};
    }
    a.threads = b.threads = c->threads;
    a.qkv_bf16 = b.qkv_bf16 = qkv_bf16;
    push(&s, a);
    push(&s, b);
    return s;
}

/* S1: random chunks, random batches, random order/threads/padding/qkv dtype. */
static Sched sched_random(const Case *c) {
    Sched s = {0};
    int64_t p[MAXSEQ] = {0};
    for (;;) {
        int left = 0;
        for (int i = 0; i < c->nseq; i++) left += p[i] < c->L[i];
        if (!left) break;
        Call call = {0};
        for (int i = 0; i < c->nseq; i++) {
            if (p[i] >= c->L[i]) {
                if (runif() < 0.05) call.e[call.ne++] = (Entry){i, p[i], 0};
                continue;
            }
            if (runif() < 0.4) continue;
            int64_t rem = c->L[i] - p[i], n;
            const double u = runif();
            if (u < 0.35) n = 1;
            else if (u < 0.45) n = rem;
            else if (u < 0.5) n = 0;
            else n = rint_(1, rem < 80 ? rem : 80);
            call.e[call.ne++] = (Entry){i, p[i], n};
            p[i] += n;
        }
        if (call.ne == 0) continue;
        shuffle_entries(&call);
        call.threads = (int)rint_(1, 2);
        call.qkv_bf16 = pick_qkv(c, 0);
        call.pad = runif() < 0.3 ? (int)rint_(1, 3) : 0;
        push(&s, call);
    }
    return s;
}

/* S2: every sequence alone, whole length in one call, other thread count. */
static Sched sched_alone(const Case *c) {
    Sched s = {0};
    for (int i = c->nseq - 1; i >= 0; i--) {
        Call call = {0};
        call.e[call.ne++] = (Entry){i, 0, c->L[i]};
        call.threads = 3 - c->threads;
        call.qkv_bf16 = pick_qkv(c, 0);
        push(&s, call);
    }
    return s;
}

/* S3: prefill all but d tokens per seq, then batched decode rounds. */
static Sched sched_decode(const Case *c) {
    Sched s = {0};
    int64_t d[MAXSEQ], p[MAXSEQ];
    Call pre = {0};
    for (int i = 0; i < c->nseq; i++) {
        d[i] = rint_(1, 12);
        if (d[i] > c->L[i]) d[i] = c->L[i];
        p[i] = c->L[i] - d[i];
        pre.e[pre.ne++] = (Entry){i, 0, p[i]};
    }
    pre.threads = 1;
    pre.qkv_bf16 = pick_qkv(c, 0);
    push(&s, pre);
    for (int round = 0;; round++) {
        Call call = {0};
        for (int i = 0; i < c->nseq; i++)
            if (p[i] < c->L[i]) { call.e[call.ne++] = (Entry){i, p[i], 1}; p[i]++; }
        if (!call.ne) break;
        shuffle_entries(&call);
        call.threads = 1 + (round & 1);
        call.qkv_bf16 = pick_qkv(c, 0);
        push(&s, call);
    }
    return s;
}

static void run_sched(const Case *c, const Sched *s, int out_bf16, Result *r, const char *tag) {
    result_init(c, r);
    for (int i = 0; i < s->n; i++) run_call(c, &s->calls[i], out_bf16, r, tag);
    for (int q = 0; q < c->nseq; q++)
        for (int64_t pos = 0; pos < c->L[q]; pos++)
            if (r->count[q][pos] != 1) { FAIL("%s: seq %d pos %lld computed %d times", tag, q, (long long)pos, r->count[q][pos]); return; }
}

/* Cache: written slots vs. canary, keys vs double rope, values exact. */
static void check_cache(const Case *c, const Result *r, const char *tag, double *max_key_err) {
    const int64_t n = cache_floats(c), dim = c->dim, bs = c->bs, stride = c->num_blocks * bs * dim;
    char *used = calloc((size_t)(c->num_blocks * bs), 1);
    const int half = c->dim / 2;
    for (int s = 0; s < c->nseq; s++)
        for (int64_t pos = 0; pos < c->L[s]; pos++) {
            const int64_t block = c->table[s][pos / bs], off = pos % bs, slot = block * bs + off;
            used[slot] = 1;
            const float *x = c->src[s] + pos * c->width;
            for (int h = 0; h < c->kv; h++) {
                const float *kx = x + (int64_t)(c->heads + h) * dim, *vx = x + (int64_t)(c->heads + c->kv + h) * dim;
                for (int64_t d = 0; d < dim; d++) {
                    const float kv = r->kc[h * stride + block * bs * dim + d * bs + off];
                    const double inv = pow(10000.0, -2.0 * (d % half) / c->dim), th = pos * inv;
                    const double ref = d < half ? (double)kx[d] * cos(th) - (double)kx[d + half] * sin(th)
                                                : (double)kx[d] * cos(th) + (double)kx[d - half] * sin(th);
                    const double err = fabs(kv - ref);
                    if (!(err <= 1e-5)) { FAIL("%s: key s=%d pos=%lld h=%d d=%lld got %g want %g", tag, s, (long long)pos, h, (long long)d, kv, ref); free(used); return; }
                    if (err > *max_key_err) *max_key_err = err;
                    const float vv = r->vc[h * stride + slot * dim + d];
                    if (fbits(vv) != fbits(vx[d])) { FAIL("%s: value s=%d pos=%lld h=%d d=%lld", tag, s, (long long)pos, h, (long long)d); free(used); return; }
                }
            }
        }
    for (int h = 0; h < c->kv; h++)
        for (int64_t slot = 0; slot < c->num_blocks * bs; slot++) {
            if (used[slot]) continue;
            const int64_t block = slot / bs, off = slot % bs;
            for (int64_t d = 0; d < dim; d++) {
                if (fbits(r->kc[h * stride + block * bs * dim + d * bs + off]) != CANARY ||
                    fbits(r->vc[h * stride + slot * dim + d]) != CANARY) {
                    FAIL("%s: unused slot %lld (h=%d) was written", tag, (long long)slot, h);
                    free(used); return;
                }
            }
        }
    (void)n;
    free(used);
}

static int64_t compare_results(const Case *c, const Result *a, const Result *b, const char *tag) {
    const int64_t ow = (int64_t)c->heads * c->dim;
    int64_t diffs = 0;
    for (int s = 0; s < c->nseq; s++)
        for (int64_t pos = 0; pos < c->L[s]; pos++)
            for (int64_t k = 0; k < ow; k++)
                if (a->out[s][pos * ow + k] != b->out[s][pos * ow + k]) {
                    if (!diffs) FAIL("%s: output differs at seq %d pos %lld col %lld: %08x vs %08x", tag, s, (long long)pos, (long long)k, a->out[s][pos * ow + k], b->out[s][pos * ow + k]);
                    diffs++;
                }
    const int64_t n = cache_floats(c);
    if (memcmp(a->kc, b->kc, sizeof(float) * n) || memcmp(a->vc, b->vc, sizeof(float) * n))
        FAIL("%s: caches differ", tag);
    return diffs;
}

/* Double-precision reference for one (seq, pos, head). */
static void reference(const Case *c, int s, int64_t pos, int head, double *out) {
    const int dim = c->dim, half = dim / 2, kvh = head / c->group;
    double q[256], k[256];
    const float *x = c->src[s] + pos * c->width + (int64_t)head * dim;
    for (int d = 0; d < dim; d++) {
        const double inv = pow(10000.0, -2.0 * (d % half) / dim), th = pos * inv;
        q[d] = (d < half ? (double)x[d] * cos(th) - (double)x[d + half] * sin(th)
                         : (double)x[d] * cos(th) + (double)x[d - half] * sin(th)) * (double)c->scale;
    }
    double *sc = xmalloc(sizeof(double) * (pos + 1));
    double mx = -INFINITY;
    for (int64_t j = 0; j <= pos; j++) {
        const float *kx = c->src[s] + j * c->width + (int64_t)(c->heads + kvh) * dim;
        for (int d = 0; d < dim; d++) {
            const double inv = pow(10000.0, -2.0 * (d % half) / dim), th = j * inv;
            k[d] = d < half ? (double)kx[d] * cos(th) - (double)kx[d + half] * sin(th)
                            : (double)kx[d] * cos(th) + (double)kx[d - half] * sin(th);
        }
        double dot = 0;
        for (int d = 0; d < dim; d++) dot += q[d] * k[d];
        sc[j] = dot;
        if (dot > mx) mx = dot;
    }
    double sum = 0;
    for (int d = 0; d < dim; d++) out[d] = 0;
    for (int64_t j = 0; j <= pos; j++) {
        const double p = exp(sc[j] - mx);
        sum += p;
        const float *vx = c->src[s] + j * c->width + (int64_t)(c->heads + c->kv + kvh) * dim;
        for (int d = 0; d < dim; d++) out[d] += p * vx[d];
    }
    for (int d = 0; d < dim; d++) out[d] /= sum;
    free(sc);
}

static double g_max_abs_err = 0, g_max_rel_err = 0, g_max_key_err = 0;
static void check_reference(const Case *c, const Result *r, int out_bf16, int samples, const char *tag) {
    const int64_t ow = (int64_t)c->heads * c->dim;
    double ref[256];
    for (int s = 0; s < c->nseq; s++) {
        for (int k = 0; k < samples; k++) {
            int64_t pos = k == 0 ? c->L[s] - 1 : k == 1 ? c->cached[s] : rint_(0, c->L[s] - 1);
            if (pos >= c->L[s]) pos = c->L[s] - 1;
            const int head = (int)rint_(0, c->heads - 1);
            reference(c, s, pos, head, ref);
            for (int d = 0; d < c->dim; d++) {
                const uint32_t bits = r->out[s][pos * ow + (int64_t)head * c->dim + d];
                const double got = out_bf16 ? bf2f((uint16_t)bits) : bitsf(bits);
                const double err = fabs(got - ref[d]);
                const double tol = out_bf16 ? fabs(ref[d]) * (1.0 / 256) + 1e-5 : 1e-5 * fabs(ref[d]) + 2e-6;
                if (!(err <= tol)) {
                    char buf[512]; describe(c, buf, sizeof buf);
                    FAIL("%s: ref mismatch seq %d pos %lld head %d d %d: got %.9g want %.9g (%s)", tag, s, (long long)pos, head, d, got, ref[d], buf);
                    return;
                }
                if (!out_bf16) {
                    if (err > g_max_abs_err) g_max_abs_err = err;
                    if (fabs(ref[d]) > 1e-2 && err / fabs(ref[d]) > g_max_rel_err) g_max_rel_err = err / fabs(ref[d]);
                }
            }
        }
    }
}

static void check_finite(const Case *c, const Result *r, int out_bf16, const char *tag) {
    const int64_t ow = (int64_t)c->heads * c->dim;
    for (int s = 0; s < c->nseq; s++)
        for (int64_t i = 0; i < c->L[s] * ow; i++) {
            const float f = out_bf16 ? bf2f((uint16_t)r->out[s][i]) : bitsf(r->out[s][i]);
            if (!isfinite(f)) { FAIL("%s: non-finite output seq %d pos %lld", tag, s, (long long)(i / ow)); return; }
        }
}

static void attn_case(int idx, int64_t maxc, int64_t maxn, double budget, int samples, int forced_group) {
    Case c;
    make_case(&c, maxc, maxn, budget, forced_group);
    char desc[600];
    describe(&c, desc, sizeof desc);
    printf("case %d: %s\n", idx, desc);
    fflush(stdout);
    const long before = failures;
    const int out_bf16 = (int)rint_(0, 1);
    Result r0, r0x, r1, r2, r3;
    Sched s0 = sched_baseline(&c, c.bf16_data ? (int)rint_(0, 1) : 0);
    run_sched(&c, &s0, out_bf16, &r0, "S0");
    check_finite(&c, &r0, out_bf16, "S0");
    check_cache(&c, &r0, "S0", &g_max_key_err);
    if (samples) check_reference(&c, &r0, out_bf16, samples, "S0");
    /* the same schedule with the other output dtype: bf16 must be round(fp32) */
    run_sched(&c, &s0, !out_bf16, &r0x, "S0x");
    {
        const Result *f = out_bf16 ? &r0x : &r0, *b = out_bf16 ? &r0 : &r0x;
        const int64_t ow = (int64_t)c.heads * c.dim;
        int bad = 0;
        for (int s = 0; s < c.nseq && !bad; s++)
            for (int64_t i = 0; i < c.L[s] * ow; i++)
                if (f2bf(bitsf(f->out[s][i])) != (uint16_t)b->out[s][i]) {
                    FAIL("S0x: bf16 out != round(fp32 out) seq %d idx %lld", s, (long long)i); bad = 1; break;
                }
        if (samples && !out_bf16) check_reference(&c, &r0x, 1, samples, "S0x");
        if (samples && out_bf16) check_reference(&c, &r0x, 0, samples, "S0x");
    }
    Sched s1 = sched_random(&c), s2 = sched_alone(&c), s3 = sched_decode(&c);
    run_sched(&c, &s1, out_bf16, &r1, "S1");
    run_sched(&c, &s2, out_bf16, &r2, "S2");
    run_sched(&c, &s3, out_bf16, &r3, "S3");
    compare_results(&c, &r0, &r1, "S1 vs S0 (random chunks/batches)");
    compare_results(&c, &r0, &r2, "S2 vs S0 (each seq alone)");
    compare_results(&c, &r0, &r3, "S3 vs S0 (decode rounds)");
    {
        uint64_t hsh = 1469598103934665603ULL;
        const int64_t ow = (int64_t)c.heads * c.dim;
        for (int s = 0; s < c.nseq; s++)
            for (int64_t i = 0; i < c.L[s] * ow; i++) { hsh ^= r0.out[s][i]; hsh *= 1099511628211ULL; }
        printf("  hash %016llx\n", (unsigned long long)hsh);
    }
    if (failures != before) printf("  ^ failing case %d: %s out_bf16=%d\n", idx, desc, out_bf16);
    result_free(&c, &r0); result_free(&c, &r0x); result_free(&c, &r1); result_free(&c, &r2); result_free(&c, &r3);
    free(s0.calls); free(s1.calls); free(s2.calls); free(s3.calls);
    free_case(&c);
}

/* ------------------------------------------------------------------ fused ops */
static long silu_inf_notes = 0;
static float special_value(void) {
    switch (rint_(0, 9)) {
    case 0: return INFINITY;
    case 1: return -INFINITY;
    case 2: return NAN;
    case 3: return 0.0f;
    case 4: return -0.0f;
    case 5: return frand(80, 100);
    case 6: return -frand(80, 100);
    case 7: return frand(-1e-30f, 1e-30f);
    case 8: return -87.3365f;
    default: return frand(86, 90) * (runif() < .5 ? -1 : 1);
    }
}

static int64_t pick_n(void) {
    static const int64_t NS[] = {1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 511, 512, 513, 4096, 5000};
    return runif() < 0.6 ? NS[rint_(0, 14)] : rint_(1, 3000);
}

static void fused_case(int idx) {
    /* ---- add_rms_norm ---- */
    {
        const int64_t rows = rint_(0, 24), n = pick_n();
        const int delta_mode = (int)rint_(0, 2), out_bf16 = (int)rint_(0, 1), threads = (int)rint_(1, 2);
        const float eps = runif() < 0.5 ? 1e-5f : 1e-6f;
        float *hidden = xmalloc(sizeof(float) * rows * n), *hidden2 = xmalloc(sizeof(float) * rows * n);
        float *hidden_orig = xmalloc(sizeof(float) * rows * n);
        float *weight = xmalloc(sizeof(float) * n);
        void *delta = NULL;
        float *deltaf = xmalloc(sizeof(float) * rows * n);
        for (int64_t r = 0; r < rows; r++) {
            const float sc = (float)pow(10, rint_(-3, 3));
            for (int64_t i = 0; i < n; i++) {
                hidden[r * n + i] = frand(-1, 1) * sc;
                deltaf[r * n + i] = frand(-1, 1) * sc;
                if (delta_mode == 2) deltaf[r * n + i] = bfround(deltaf[r * n + i]);
            }
        }
        if (runif() < 0.1 && rows > 0) for (int64_t i = 0; i < n; i++) hidden[i] = 0, deltaf[i] = 0; /* zero row */
        for (int64_t i = 0; i < n; i++) weight[i] = frand(0.5f, 1.5f);
        if (delta_mode == 1) delta = deltaf;
        if (delta_mode == 2) {
            uint16_t *d = xmalloc(sizeof(uint16_t) * rows * n);
            for (int64_t i = 0; i < rows * n; i++) d[i] = f2bf(deltaf[i]);
            delta = d;
        }
        memcpy(hidden_orig, hidden, sizeof(float) * rows * n);
        memcpy(hidden2, hidden, sizeof(float) * rows * n);
        const size_t esz = out_bf16 ? 2 : 4;
        unsigned char *out = xmalloc(esz * rows * n), *out2 = xmalloc(esz * rows * n);
        int rc = llmesh_add_rms_norm(hidden, delta, delta_mode == 2, weight, rows, n, eps, out, out_bf16, threads);
        if (rc) FAIL("rms rc=%d", rc);
        /* row by row, one thread: must be bit-identical */
        for (int64_t r = 0; r < rows; r++) {
            const void *dr = delta == NULL ? NULL : delta_mode == 1 ? (const void *)(deltaf + r * n) : (const void *)((uint16_t *)delta + r * n);
            rc = llmesh_add_rms_norm(hidden2 + r * n, dr, delta_mode == 2, weight, 1, n, eps, out2 + r * n * esz, out_bf16, 3 - threads);
        }
        if (rows && (memcmp(out, out2, esz * rows * n) || memcmp(hidden, hidden2, sizeof(float) * rows * n)))
            FAIL("rms: batch vs row-by-row differ (rows=%lld n=%lld delta=%d out_bf16=%d threads=%d)", (long long)rows, (long long)n, delta_mode, out_bf16, threads);
        for (int64_t r = 0; r < rows; r++) {
            double ss = 0;
            for (int64_t i = 0; i < n; i++) {
                const float h = delta ? hidden_orig[r * n + i] + deltaf[r * n + i] : hidden_orig[r * n + i];
                if (fbits(h) != fbits(hidden[r * n + i])) { FAIL("rms: hidden not h+delta r=%lld i=%lld", (long long)r, (long long)i); goto rms_done; }
                ss += (double)h * h;
            }
            const double inv = 1.0 / sqrt(ss / n + eps);
            for (int64_t i = 0; i < n; i++) {
                const double ref = (double)hidden[r * n + i] * inv * weight[i];
                const double got = out_bf16 ? bf2f(((uint16_t *)out)[r * n + i]) : ((float *)out)[r * n + i];
                const double tol = out_bf16 ? fabs(ref) / 256 + 1e-30 : 2e-6 * fabs(ref) + 1e-30;
                if (!(fabs(got - ref) <= tol)) {
                    FAIL("rms: r=%lld i=%lld got %.9g want %.9g (rows=%lld n=%lld delta=%d out_bf16=%d)", (long long)r, (long long)i, got, ref, (long long)rows, (long long)n, delta_mode, out_bf16);
                    goto rms_done;
                }
            }
        }
    rms_done:
        free(hidden); free(hidden2); free(hidden_orig); free(weight); free(deltaf); if (delta_mode == 2) free(delta); free(out); free(out2);
    }
    /* ---- silu_mul ---- */
    {
        const int64_t rows = rint_(0, 24), n = pick_n();
        const int in_bf16 = (int)rint_(0, 1), out_bf16 = (int)rint_(0, 1), threads = (int)rint_(1, 2);
        const int specials = runif() < 0.3;
        float *gu = xmalloc(sizeof(float) * rows * 2 * n);
        for (int64_t i = 0; i < rows * 2 * n; i++) {
            float x = specials && runif() < 0.1 ? special_value() : frand(-12, 12);
            if (in_bf16) x = bfround(x);
            gu[i] = x;
        }
        void *in = gu;
        uint16_t *gub = NULL;
        if (in_bf16) {
            gub = xmalloc(sizeof(uint16_t) * rows * 2 * n);
            for (int64_t i = 0; i < rows * 2 * n; i++) gub[i] = f2bf(gu[i]);
            in = gub;
        }
        const size_t esz = out_bf16 ? 2 : 4;
        unsigned char *out = xmalloc(esz * rows * n), *out2 = xmalloc(esz * rows * n);
        int rc = llmesh_silu_mul(in, in_bf16, rows, n, out, out_bf16, threads);
        if (rc) FAIL("silu rc=%d", rc);
        for (int64_t r = 0; r < rows; r++)
            llmesh_silu_mul(in_bf16 ? (void *)(gub + r * 2 * n) : (void *)(gu + r * 2 * n), in_bf16, 1, n, out2 + r * n * esz, out_bf16, 3 - threads);
        if (rows && memcmp(out, out2, esz * rows * n))
            FAIL("silu: batch vs row-by-row differ (rows=%lld n=%lld)", (long long)rows, (long long)n);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++) {
                const double g = gu[r * 2 * n + i], u = gu[r * 2 * n + n + i];
                double ref = g / (1.0 + exp(-g)) * u;
                const double got = out_bf16 ? bf2f(((uint16_t *)out)[r * n + i]) : ((float *)out)[r * n + i];
                if (!isfinite(g) || !isfinite(u)) { /* PyTorch's fp32 formula x / (1 + exp(-x)), then * up */
                    const float gf = (float)g;
                    ref = (double)((gf / (1.0f + expf(-gf))) * (float)u);
                }
                if (isnan(ref) || isinf(ref)) {
                    if (isinf(u) && g > -88.73 && g < -87.33 && isnan(got)) { /* known: exp16 flushes e^g to 0 here, PyTorch does not */
                        silu_inf_notes++;
                        continue;
                    }
                    if (!(isnan(ref) ? isnan(got) : got == ref)) {
                        FAIL("silu special: g=%g u=%g got %g want %g", g, u, got, ref);
                        goto silu_done;
                    }
                    continue;
                }
                const double tol = out_bf16 ? fabs(ref) / 256 + 1e-30 : 1e-5 * fabs(ref) + 1e-30; /* exp16 flushes below -87.34 to 0 */
                if (!(fabs(got - ref) <= tol)) {
                    FAIL("silu: g=%.9g u=%.9g got %.9g want %.9g (n=%lld in_bf16=%d out_bf16=%d)", g, u, got, ref, (long long)n, in_bf16, out_bf16);
                    goto silu_done;
                }
            }
    silu_done:
        free(gu); free(gub); free(out); free(out2);
    }
    (void)idx;
}

/* ------------------------------------------------------------------ integer matmuls */
/* llmesh_q4_1_matmul / llmesh_q8_matmul (int_matmul.c) against a scalar
 * reference that does the kernel's fp32 operations one by one (volatile
 * temporaries and explicit fmaf, so -ffp-contract cannot fuse them
 * differently): bit-identical results are required, not just close ones. */
#define QB 32
#define QTILE 16
#define Q4REC 320
#define Q8REC 512

static float h2f(uint16_t h) { /* fp16 -> fp32, exact (independent of the kernel's) */
    const int e = (h >> 10) & 0x1f, mant = h & 0x3ff;
    const float v = e ? ldexpf((float)(1024 + mant), e - 25) : ldexpf((float)mant, -24);
    return (h & 0x8000) ? -v : v;
}

static uint16_t random_half(int lo_exp, int hi_exp) { /* finite fp16, random sign */
    if (runif() < 0.03) return runif() < 0.5 ? 0x0000 : 0x8000;    /* +-0 */
    if (runif() < 0.03) return (uint16_t)rint_(1, 0x3ff) | (rnd() & 1 ? 0x8000 : 0); /* subnormal */
    return (uint16_t)((rint_(lo_exp, hi_exp) << 10) | rint_(0, 0x3ff) | (rnd() & 1 ? 0x8000 : 0));
}

/* The activation grid: int16 values in [-QMAX, QMAX]; blocks whose max is
 * below QMIN_AMAX (int_matmul.c's MIN_AMAX) count as zeros. */
#define QMAX 32767.0f
#define QMIN_AMAX 1e-30f
static long g_int_clamped = 0;

/* The int16 quantization of one row, the kernel's way: per block amax (x
 * widened to fp32), d = NaN if a value is NaN or +-inf, else 0 if amax <
 * 1e-30, else amax / 32767; qa = nearbyint(x * (1 / d)) clamped to +-32767
 * (0 where d is 0 or NaN: the kernel's qa there do not matter, its da is 0 or
 * NaN), sa = d * sum(qa). */
static void ref_quantize(const float *x, int64_t in, int16_t *qa, float *da, float *sa) {
    for (int64_t b = 0; b < in / QB; b++) {
        float amax = 0.0f;
        int finite = 1;
        for (int i = 0; i < QB; i++) {
            const float a = fabsf(x[b * QB + i]);
            if (!(a <= FLT_MAX)) finite = 0;
            if (a > amax) amax = a;
        }
        volatile float d = !finite ? NAN : amax < QMIN_AMAX ? 0.0f : amax / QMAX;
        volatile float id = finite && d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QB; i++) {
            float q = 0.0f;
            if (finite) {
                volatile float scaled = x[b * QB + i] * id;
                q = nearbyintf(scaled);
                if (q > QMAX || q < -QMAX) {
                    g_int_clamped++;
                    q = q > QMAX ? QMAX : -QMAX;
                }
            }
            qa[b * QB + i] = (int16_t)q;
            sum += (int32_t)q;
        }
        volatile float s = d * (float)sum;
        da[b] = d;
        sa[b] = s;
    }
}

typedef struct {
    int64_t rows, in, out, tiles, blocks;
    int x_bf16, out_bf16, threads;
    float *x;        /* [rows][in] the values (bf16-exact when x_bf16) */
    void *xin;       /* what the kernel reads: x or its bf16 bits */
    uint8_t *q;      /* q4: [out][in] 0..15 */
    uint16_t *d, *m; /* q4: [out][in / 32] fp16 bits */
    int8_t *qw;      /* q8: [out][in] */
    float *scales;   /* q8: [out] */
    uint8_t *packed;
} IntCase;

static void fill_row(float *x, int64_t in) {
    const int kind = (int)rint_(0, 11);
    const float scale = (float)pow(10, rint_(-4, 4));
    for (int64_t i = 0; i < in; i++) x[i] = frand(-1, 1) * scale;
    if (kind == 0) { /* all zero (or negative zero) */
        const float z = runif() < 0.5 ? 0.0f : -0.0f;
        for (int64_t i = 0; i < in; i++) x[i] = z;
    } else if (kind == 1) { /* a zero block, some negative zeros */
        const int64_t b = rint_(0, in / QB - 1);
        for (int i = 0; i < QB; i++) x[b * QB + i] = (i & 1) ? -0.0f : 0.0f;
    } else if (kind == 2) { /* exact ties: amax 32767 -> d = 1, values k / 2 (fp32 in) */
        for (int64_t i = 0; i < in; i++) x[i] = (float)rint_(-65534, 65534) / 2.0f;
        for (int64_t b = 0; b < in / QB; b++) x[b * QB + rint_(0, QB - 1)] = runif() < 0.5 ? QMAX : -QMAX;
    } else if (kind == 3) { /* one large value per block, the rest tiny */
        for (int64_t b = 0; b < in / QB; b++) x[b * QB + rint_(0, QB - 1)] = frand(-1e4f, 1e4f);
    } else if (kind == 4) { /* extreme but safe magnitudes */
        const float big = runif() < 0.5 ? 1e30f : 1e-30f;
        for (int64_t i = 0; i < in; i++) x[i] = frand(-1, 1) * big;
    } else if (kind == 5) { /* block maxima at and around MIN_AMAX (1e-30): zeros below it */
        const float maxima[] = {nextafterf(QMIN_AMAX, 0.0f), QMIN_AMAX, nextafterf(QMIN_AMAX, 1.0f),
                                0x1p-100f, 0x1p-90f, 2e-30f};
        for (int64_t b = 0; b < in / QB; b++) {
            const float m = maxima[rint_(0, 5)];
            for (int i = 0; i < QB; i++) x[b * QB + i] = frand(-1, 1) * m;
            x[b * QB + rint_(0, QB - 1)] = runif() < 0.5 ? m : -m;
        }
    } else if (kind == 6) { /* a NaN or an infinity: the whole row NaN */
        const float bad[] = {NAN, -NAN, INFINITY, -INFINITY};
        x[rint_(0, in - 1)] = bad[rint_(0, 3)];
    }
}

static void make_int_case(IntCase *c, int q4) {
    memset(c, 0, sizeof *c);
    /* Now and then past int_matmul.c's 32-row chunks (two whole, one partial). */
    c->rows = runif() < 0.15 ? rint_(21, 80) : rint_(0, 20);
    c->out = runif() < 0.3 ? (int64_t[]){1, 15, 16, 17, 32, 33, 64}[rint_(0, 6)] : rint_(1, 70);
    c->in = QB * rint_(1, 10);
    c->tiles = (c->out + QTILE - 1) / QTILE;
    c->blocks = c->in / QB;
    c->x_bf16 = (int)rint_(0, 1);
    c->out_bf16 = (int)rint_(0, 1);
    c->threads = (int)rint_(1, 4);
    c->x = xmalloc(sizeof(float) * c->rows * c->in);
    for (int64_t r = 0; r < c->rows; r++) fill_row(c->x + r * c->in, c->in);
    if (c->x_bf16) {
        uint16_t *h = xmalloc(sizeof(uint16_t) * c->rows * c->in);
        for (int64_t i = 0; i < c->rows * c->in; i++) { h[i] = f2bf(c->x[i]); c->x[i] = bf2f(h[i]); }
        c->xin = h;
    } else {
        c->xin = c->x;
    }
    const size_t record = q4 ? Q4REC : Q8REC, bytes = (size_t)(c->tiles * c->blocks) * record;
    c->packed = xmalloc(bytes);
    /* Padding features (past out) hold random bytes: they must never reach the output. */
    for (size_t i = 0; i < bytes; i++) c->packed[i] = (uint8_t)rnd();
    if (q4) {
        c->q = xmalloc((size_t)(c->out * c->in));
        c->d = xmalloc(sizeof(uint16_t) * c->out * c->blocks);
        c->m = xmalloc(sizeof(uint16_t) * c->out * c->blocks);
        for (int64_t i = 0; i < c->out * c->in; i++) c->q[i] = (uint8_t)rint_(0, 15);
        for (int64_t i = 0; i < c->out * c->blocks; i++) {
            c->d[i] = random_half(5, 17) & 0x7fff; /* ~2^-10 .. 2^2, d >= 0 */
            c->m[i] = random_half(5, 19);
        }
        /* Layout (int_matmul.c): per (tile, block) record, d[16] and m[16] as
         * fp16, then 4 chunks of 64 bytes. Pair group g = inputs 2g, 2g + 1,
         * value 2j + t = q[j][2g + t]; chunk c's byte k < 32 holds value k of
         * group 4c (low nibble) and 4c + 2 (high), byte 32 + k groups 4c + 1
         * and 4c + 3: byte 64 + 64 c + 32 h + 2 j + t = q[j][2 (4c + h) + t] |
         * q[j][2 (4c + h + 2) + t] << 4, h in {0, 1}. */
        for (int64_t j = 0; j < c->out; j++) {
            const int64_t t = j / QTILE, jj = j % QTILE;
            for (int64_t b = 0; b < c->blocks; b++) {
                uint8_t *rec = c->packed + (t * c->blocks + b) * Q4REC;
                memcpy(rec + 2 * jj, &c->d[j * c->blocks + b], 2);
                memcpy(rec + 32 + 2 * jj, &c->m[j * c->blocks + b], 2);
                const uint8_t *qj = c->q + j * c->in + b * QB;
                for (int ch = 0; ch < 4; ch++)
                    for (int h = 0; h < 2; h++)
                        for (int t = 0; t < 2; t++) {
                            const int lo = 2 * (4 * ch + h) + t, hi = 2 * (4 * ch + h + 2) + t;
                            rec[64 + 64 * ch + 32 * h + 2 * jj + t] = (uint8_t)(qj[lo] | qj[hi] << 4);
                        }
            }
        }
    } else {
        c->qw = xmalloc((size_t)(c->out * c->in));
        c->scales = xmalloc(sizeof(float) * c->out);
        for (int64_t i = 0; i < c->out * c->in; i++)
            c->qw[i] = (int8_t)(runif() < 0.05 ? (rnd() & 1 ? 127 : -128) : rint_(-128, 127));
        for (int64_t j = 0; j < c->out; j++)
            c->scales[j] = runif() < 0.05 ? 0.0f : frand(1e-4f, 1e-1f) * (rnd() & 1 ? 1 : -1);
        /* Layout: per (tile, block) record, byte 32 g + 2 j + t = qw[j][2g + t]
         * (two's complement, no offset). */
        for (int64_t j = 0; j < c->out; j++) {
            const int64_t t = j / QTILE, jj = j % QTILE;
            for (int64_t b = 0; b < c->blocks; b++) {
                uint8_t *rec = c->packed + (t * c->blocks + b) * Q8REC;
                for (int g = 0; g < QB / 2; g++)
                    for (int t = 0; t < 2; t++)
                        rec[32 * g + 2 * jj + t] = (uint8_t)c->qw[j * c->in + b * QB + 2 * g + t];
            }
        }
    }
}

static void free_int_case(IntCase *c) {
    free(c->x);
    if (c->x_bf16) free(c->xin);
    free(c->q); free(c->d); free(c->m); free(c->qw); free(c->scales); free(c->packed);
}

/* The expected output bits of row r ([out]: fp32 bits, or bf16 bits in the low half). */
static void ref_int_row(const IntCase *c, int q4, int64_t r, uint32_t *expect) {
    int16_t *qa = xmalloc(sizeof(int16_t) * c->in);
    float *da = xmalloc(sizeof(float) * c->blocks), *sa = xmalloc(sizeof(float) * c->blocks);
    ref_quantize(c->x + r * c->in, c->in, qa, da, sa);
    for (int64_t j = 0; j < c->out; j++) {
        volatile float acc = 0.0f;
        for (int64_t b = 0; b < c->blocks; b++) {
            int32_t isum = 0;
            for (int i = 0; i < QB; i++) {
                const int32_t w = q4 ? c->q[j * c->in + b * QB + i] : c->qw[j * c->in + b * QB + i];
                isum += w * qa[b * QB + i];
            }
            volatile float fsum = (float)isum; /* exact for q4 (|isum| < 2^24), rounded for q8 */
            if (q4) {
                volatile float scale = h2f(c->d[j * c->blocks + b]) * da[b];
                acc = fmaf(fsum, scale, acc);
                acc = fmaf(h2f(c->m[j * c->blocks + b]), sa[b], acc);
            } else {
                acc = fmaf(fsum, da[b], acc);
            }
        }
        float value = acc;
        if (!q4) {
            volatile float scaled = value * c->scales[j];
            value = scaled;
        }
        expect[j] = c->out_bf16 ? f2bf(value) : fbits(value);
    }
    free(qa); free(da); free(sa);
}

static int call_int(const IntCase *c, int q4, int64_t first, int64_t rows, void *out, int threads) {
    const size_t xsz = c->x_bf16 ? 2 : 4;
    const void *x = (const uint8_t *)c->xin + (size_t)(first * c->in) * xsz;
    return q4 ? llmesh_q4_1_matmul(x, c->x_bf16, rows, c->in, c->packed, c->out, out, c->out_bf16, threads)
              : llmesh_q8_matmul(x, c->x_bf16, rows, c->in, c->packed, c->scales, c->out, out, c->out_bf16, threads);
}

static uint32_t out_bits(const IntCase *c, const void *out, int64_t i) {
    return c->out_bf16 ? ((const uint16_t *)out)[i] : ((const uint32_t *)out)[i];
}

static int is_nan_bits(const IntCase *c, uint32_t bits) {
    return c->out_bf16 ? (bits & 0x7fffu) > 0x7f80u : (bits & 0x7fffffffu) > 0x7f800000u;
}
static long g_int_nans = 0;

#define OUT_GUARD 64
static long g_int_outputs = 0;

static void int_case(int idx, int q4) {
    IntCase c;
    make_int_case(&c, q4);
    const long before = failures;
    const char *name = q4 ? "q4_1" : "q8";
    const size_t esz = c.out_bf16 ? 2 : 4, nout = (size_t)(c.rows * c.out) * esz;
    unsigned char *out = xmalloc(nout + OUT_GUARD);
    memset(out, OUTCANARY8, nout + OUT_GUARD);
    int rc = call_int(&c, q4, 0, c.rows, out, c.threads);
    if (rc) FAIL("%s rc=%d", name, rc);
    for (size_t i = nout; i < nout + OUT_GUARD; i++)
        if (out[i] != OUTCANARY8) { FAIL("%s: wrote past the output (byte %zu)", name, i - nout); break; }
    /* (a) bit-exact against the scalar reference */
    uint32_t *expect = xmalloc(sizeof(uint32_t) * (c.out ? c.out : 1));
    for (int64_t r = 0; r < c.rows; r++) {
        ref_int_row(&c, q4, r, expect);
        for (int64_t j = 0; j < c.out; j++) {
            const uint32_t got = out_bits(&c, out, r * c.out + j);
            g_int_outputs++;
            if (is_nan_bits(&c, expect[j]) && is_nan_bits(&c, got)) { /* any NaN */
                g_int_nans++;
                continue;
            }
            if (got != expect[j]) {
                const float gv = c.out_bf16 ? bf2f((uint16_t)got) : bitsf(got);
                const float ev = c.out_bf16 ? bf2f((uint16_t)expect[j]) : bitsf(expect[j]);
                FAIL("%s: row %lld feature %lld got %.9g (0x%08x) want %.9g (0x%08x)", name,
                     (long long)r, (long long)j, gv, got, ev, expect[j]);
                goto reference_done;
            }
        }
    }
reference_done:
    /* (b) row invariance: each row alone, and a random slice, equal the batch's rows */
    {
        unsigned char *one = xmalloc(c.out * esz + OUT_GUARD);
        for (int64_t r = 0; r < c.rows; r++) {
            rc = call_int(&c, q4, r, 1, one, (int)rint_(1, 4));
            if (rc || memcmp(one, out + (size_t)(r * c.out) * esz, c.out * esz)) {
                FAIL("%s: row %lld alone differs from the batch of %lld (rc=%d)", name, (long long)r, (long long)c.rows, rc);
                break;
            }
        }
        free(one);
        if (c.rows > 1) {
            const int64_t first = rint_(0, c.rows - 1), n = rint_(1, c.rows - first);
            unsigned char *part = xmalloc((size_t)(n * c.out) * esz);
            rc = call_int(&c, q4, first, n, part, (int)rint_(1, 4));
            if (rc || memcmp(part, out + (size_t)(first * c.out) * esz, (size_t)(n * c.out) * esz))
                FAIL("%s: rows %lld..%lld as their own batch differ (rc=%d)", name, (long long)first, (long long)(first + n), rc);
            free(part);
        }
    }
    if (failures != before)
        printf("  ^ failing %s case %d: rows=%lld in=%lld out=%lld x_bf16=%d out_bf16=%d threads=%d\n", name, idx,
               (long long)c.rows, (long long)c.in, (long long)c.out, c.x_bf16, c.out_bf16, c.threads);
    free(expect); free(out);
    free_int_case(&c);
}

/* Shapes both kernels must refuse with -1, before reading anything. */
static void int_refusals(void) {
    static const struct { int64_t rows, in, out; const char *what; } refused[] = {
        {1, 0, 16, "in 0"}, {1, 48, 16, "in 48"}, {1, 16, 16, "in 16"}, {1, 31, 16, "in 31"},
        {1, 64, 0, "out 0"}, {1, 64, -3, "out -3"}, {-1, 64, 16, "rows -1"},
    };
    uint8_t packed[Q8REC * 2] = {0};
    float x[64] = {0}, scales[16] = {0}, out[64];
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        const int rc4 = llmesh_q4_1_matmul(x, 0, refused[i].rows, refused[i].in, packed, refused[i].out, out, 0, 1);
        const int rc8 = llmesh_q8_matmul(x, 0, refused[i].rows, refused[i].in, packed, scales, refused[i].out, out, 0, 1);
        if (rc4 != -1 || rc8 != -1) FAIL("intmm %s: rc q4_1=%d q8=%d, expected -1", refused[i].what, rc4, rc8);
    }
    /* zero rows: accepted, nothing read or written */
    if (llmesh_q4_1_matmul(NULL, 0, 0, 64, NULL, 16, NULL, 0, 2) != 0 ||
        llmesh_q8_matmul(NULL, 1, 0, 64, NULL, NULL, 16, NULL, 1, 2) != 0)
        FAIL("intmm: zero rows refused");
}

/* ------------------------------------------------------------------ edge cases */
static void edge_cases(void) {
    Case c;
    make_case(&c, 40, 10, 1e7, 0);
    step_plan plan = {0};
    int64_t z = 0;
    plan.seq_first_row = plan.seq_num_tokens = plan.seq_start = plan.seq_table = plan.block_tables = plan.slots = &z;
    plan.num_heads = c.heads; plan.num_kv_heads = c.kv; plan.head_dim = c.dim; plan.block_size = c.bs;
    plan.cache_head_stride = c.num_blocks * c.bs * c.dim; plan.rope_cos = c.cos; plan.rope_sin = c.sin;
    plan.scale = c.scale; plan.num_threads = 2;
    float dummy[4];
    /* zero sequences */
    plan.num_seqs = 0;
    int rc = llmesh_paged_attention(&plan, dummy, dummy, dummy, dummy);
    printf("zero seqs: rc=%d\n", rc);
    if (rc) FAIL("zero seqs rc=%d", rc);
    /* all sequences with 0 tokens */
    int64_t fr[3] = {0, 0, 0}, nt[3] = {0, 0, 0}, st[3] = {0, 5, 17}, tb[3] = {0, 0, 0};
    plan.num_seqs = 3; plan.seq_first_row = fr; plan.seq_num_tokens = nt; plan.seq_start = st; plan.seq_table = tb;
    rc = llmesh_paged_attention(&plan, dummy, dummy, dummy, dummy);
    printf("zero-token seqs: rc=%d\n", rc);
    if (rc) FAIL("zero-token seqs rc=%d", rc);
    plan.num_seqs = 0;
    /* Plans the kernel must refuse: (head_dim, heads, kv heads, block size) -> code. */
    static const struct { int64_t dim, heads, kv, bs; int rc; const char *what; } refused[] = {
        {0, 8, 2, 16, -1, "head_dim 0"},     {257, 8, 2, 16, -1, "head_dim 257"},
        {63, 8, 2, 16, -1, "head_dim 63"},   {64, 33, 1, 16, -2, "group 33"},
        {64, 65, 2, 16, -2, "heads 65 / kv 2"}, {64, 1, 2, 16, -2, "heads 1 / kv 2"},
        {64, 8, 0, 16, -2, "kv heads 0"},    {64, 8, 2, 0, -4, "block_size 0"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        plan.head_dim = refused[i].dim; plan.num_heads = refused[i].heads;
        plan.num_kv_heads = refused[i].kv; plan.block_size = refused[i].bs;
        rc = llmesh_paged_attention(&plan, dummy, dummy, dummy, dummy);
        printf("%s: rc=%d\n", refused[i].what, rc);
        if (rc != refused[i].rc) FAIL("%s rc=%d, expected %d", refused[i].what, rc, refused[i].rc);
    }
    free_case(&c);
}

/* A single one-token sequence with heads not a multiple of kv heads: refused. */
static void bad_group(int heads, int kv) {
    const int dim = 16, bs = 16, L = 1;
    const int64_t width = (int64_t)(heads + 2 * kv) * dim, nblocks = 1;
    float *cos_ = malloc(sizeof(float) * L * dim), *sin_ = malloc(sizeof(float) * L * dim);
    for (int i = 0; i < L * dim; i++) cos_[i] = 1, sin_[i] = 0;
    float *qkv = calloc(width, sizeof(float));
    float *kc = calloc((size_t)kv * nblocks * bs * dim, sizeof(float));
    float *vc = calloc((size_t)kv * nblocks * bs * dim, sizeof(float));
    float *out = calloc((size_t)heads * dim, sizeof(float));
    int64_t fr = 0, nt = 1, st = 0, tb = 0, table = 0, slot = 0;
    step_plan plan = {1, 1, &fr, &nt, &st, &tb, &table, &slot, heads, kv, dim, bs, nblocks * bs * dim,
                      cos_, sin_, 0, 0, 0.25f, 1};
    printf("heads=%d kv=%d: calling...\n", heads, kv);
    fflush(stdout);
    int rc = llmesh_paged_attention(&plan, qkv, kc, vc, out);
    printf("heads=%d kv=%d: rc=%d\n", heads, kv, rc);
    if (rc != -2) FAIL("heads=%d kv=%d accepted (rc=%d)", heads, kv, rc);
    free(cos_); free(sin_); free(qkv); free(kc); free(vc); free(out);
}

int main(int argc, char **argv) {
    if (argc < 4) { fprintf(stderr, "usage: %s MODE SEED NCASES [MAXCACHED MAXNEW BUDGET REFSAMPLES GROUP]\n", argv[0]); return 2; }
    const char *mode = argv[1];
    rng_state = strtoull(argv[2], NULL, 10) * 0x2545F4914F6CDD1DULL + 1;
    const int ncases = atoi(argv[3]);
    const int64_t maxc = argc > 4 ? atoll(argv[4]) : 600, maxn = argc > 5 ? atoll(argv[5]) : 70;
    const double budget = argc > 6 ? atof(argv[6]) : 3e8;
    const int samples = argc > 7 ? atoi(argv[7]) : 6;
    const int group = argc > 8 ? atoi(argv[8]) : 0;
    if (!strcmp(mode, "attn")) {
        for (int i = 0; i < ncases; i++) attn_case(i, maxc, maxn, budget, samples, group);
        printf("max |err| fp32 out vs double ref: %.3g (max rel err where |ref|>1e-2: %.3g); max key err %.3g\n",
               g_max_abs_err, g_max_rel_err, g_max_key_err);
    } else if (!strcmp(mode, "fused")) {
        for (int i = 0; i < ncases; i++) fused_case(i);
        printf("note: %ld silu outputs NaN where PyTorch gives +-inf (up=+-inf, gate in (-88.73,-87.33))\n", silu_inf_notes);
    } else if (!strcmp(mode, "intmm")) {
        for (int i = 0; i < ncases; i++) {
            int_case(i, 1);
            int_case(i, 0);
        }
        int_refusals();
        printf("intmm: %ld outputs bit-identical to the scalar reference (%ld of them NaN as "
               "the reference's, %ld activations clamped to +-32767)\n", g_int_outputs, g_int_nans,
               g_int_clamped);
    } else if (!strcmp(mode, "edge")) {
        edge_cases();
    } else if (!strcmp(mode, "bad_group_nondiv")) {
        bad_group(3, 2);
    } else if (!strcmp(mode, "bad_group_zero")) {
        bad_group(1, 2);
    } else {
        fprintf(stderr, "unknown mode\n");
        return 2;
    }
    printf("%s: %s (%ld failures)\n", mode, failures ? "FAILED" : "OK", failures);
    return failures ? 1 : 0;
}
