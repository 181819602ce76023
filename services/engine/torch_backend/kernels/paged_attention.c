/* Paged attention over the engine's KV cache, one call per layer and step.
 *
 * Cache layout, per layer: values [kv_heads, num_blocks, block_size, head_dim];
 * keys transposed within each block, [kv_heads, num_blocks, head_dim,
 * block_size], so that 16 consecutive keys of one dim are one vector load
 * (block sizes that are a multiple of 16; others gather a tile).
 *
 * Input is the step's fused QKV projection output, fp32 or bf16
 * [rows, (heads + 2 kv_heads) * head_dim]. Rotary position embeddings (Su et
 * al., RoFormer, 2021; "rotate half" layout) are applied here to the queries
 * and to the new keys, which are stored (fp32) with the new values in their
 * slots. Output is fp32 or bf16 (rounded to nearest even, as PyTorch does)
 * [rows, heads * head_dim], ready for the output projection.
 *
 * What it computes, for every query row (a token of a sequence, one query
 * head): softmax(q . K^T * scale) V over the keys at positions 0..pos of its
 * own sequence, where pos is the token's position (causal attention, Vaswani
 * et al. 2017), with grouped-query heads (Ainslie et al. 2023: query head h
 * reads KV head h / group). Keys and values live in blocks (Kwon et al.,
 * "PagedAttention", SOSP 2023): token j of a sequence is slot
 * block_table[j / block_size] * block_size + j % block_size.
 *
 * Why a kernel of our own: batch invariance. A row's arithmetic here depends
 * only on its own query and its own pos + 1 keys, in a fixed order (scores in
 * key tiles of 16, four fixed partial sums over the head dim; the softmax sum
 * in ascending key tiles; the value sum key by key in ascending order; explicit
 * FMAs, so no compiler contraction choice can differ between code paths),
 * never on how many other rows,
 * sequences or padding keys the call holds, nor on the thread that runs it.
 * So a token gets the same bits in a decode batch of any size, in a prefill
 * chunk of any length, after a prefix-cache hit or after a recompute -- with
 * one call per layer instead of the ~12 padded tensor ops of the PyTorch path
 * (paged_kv.py), and without gathering each sequence's blocks into a copy.
 *
 * The vector code uses GCC vector extensions (16 floats); the compiler maps
 * them to AVX-512 where the build machine has it and to narrower registers
 * otherwise. exp() is Cephes' single-precision polynomial (S. L. Moshier,
 * Cephes Math Library, expf.c), vectorized; |error| <= 2 ulp for the
 * arguments <= 0 that the softmax gives it.
 *
 * Threads: work items are (sequence, KV head, tile of up to 16 tokens; when
 * those are few, a single query head); OpenMP hands them out. Each
 * row is computed whole by one thread, so results do not depend on the
 * schedule.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmesh_kernels.h"
#include "simd.h"

#define TOKEN_TILE 16
#define MAX_HEAD_DIM 256
/* Rows scored together against each key tile. */
#define SCORE_ROWS 4

typedef struct {
    int64_t seq, kv_head, first_token, num_tokens, first_head, num_heads;
} work_item;

/* Element `column` of row `row` of the qkv input, as fp32. */
static inline float qkv_at(const step_plan *plan, const void *qkv, int64_t row, int64_t column) {
    const int64_t width = (plan->num_heads + 2 * plan->num_kv_heads) * plan->head_dim;
    if (plan->qkv_bf16) return bf16_to_float(((const uint16_t *)qkv)[row * width + column]);
    return ((const float *)qkv)[row * width + column];
}

/* Rotates the head at `column` of `row` (position `pos`) into `dst` [head_dim]:
 * x * cos + swap_halves(x) * sin_signed, the "rotate half" form. */
static inline void rope_head(const step_plan *plan, const void *qkv, int64_t row, int64_t column,
                             int64_t pos, float *dst) {
    const int64_t dim = plan->head_dim, half = dim / 2;
    const float *cos = plan->rope_cos + pos * dim, *sin = plan->rope_sin + pos * dim;
    float x[MAX_HEAD_DIM];
    for (int64_t d = 0; d < dim; d++) x[d] = qkv_at(plan, qkv, row, column + d);
    for (int64_t d = 0; d < dim; d++) dst[d] = x[d] * cos[d] + x[(d + half) % dim] * sin[d];
}

/* Stores the step's new keys (rotated) and values in their slots. */
static void write_new_kv(const step_plan *plan, const void *qkv, float *k_cache, float *v_cache) {
    const int64_t dim = plan->head_dim, heads = plan->num_heads, kv_heads = plan->num_kv_heads;
    for (int64_t s = 0; s < plan->num_seqs; s++) {
        for (int64_t t = 0; t < plan->seq_num_tokens[s]; t++) {
            const int64_t row = plan->seq_first_row[s] + t, pos = plan->seq_start[s] + t;
            const int64_t slot = plan->slots[row];
            const int64_t bs = plan->block_size, block = slot / bs, offset = slot % bs;
            for (int64_t h = 0; h < kv_heads; h++) {
                float key[MAX_HEAD_DIM];
                rope_head(plan, qkv, row, (heads + h) * dim, pos, key);
                float *keys = k_cache + h * plan->cache_head_stride + block * bs * dim + offset;
                for (int64_t d = 0; d < dim; d++) keys[d * bs] = key[d];
                float *value = v_cache + h * plan->cache_head_stride + slot * dim;
                for (int64_t d = 0; d < dim; d++)
                    value[d] = qkv_at(plan, qkv, row, (heads + kv_heads + h) * dim + d);
            }
        }
    }
}

/* Keys k0 .. k0 + 15 as a [head_dim][16] tile (row stride *stride): in place
 * when a block holds the whole tile, else gathered into `buffer`. Lanes past
 * the sequence's keys hold whatever the slots hold (masked later). */
static inline const float *key_tile(const step_plan *plan, const float *cache_head,
                                    const int64_t *table, int64_t k0, int64_t num_keys,
                                    float *buffer, int64_t *stride) {
    const int64_t bs = plan->block_size, dim = plan->head_dim;
    if (bs % LANES == 0) {
        *stride = bs;
        return cache_head + table[k0 / bs] * bs * dim + k0 % bs;
    }
    for (int64_t j = 0; j < LANES; j++) {
        const int64_t key = k0 + j;
        if (key < num_keys) {
            const float *src = cache_head + table[key / bs] * bs * dim + key % bs;
            for (int64_t d = 0; d < dim; d++) buffer[d * LANES + j] = src[d * bs];
        } else {
            for (int64_t d = 0; d < dim; d++) buffer[d * LANES + j] = 0.0f;
        }
    }
    *stride = LANES;
    return buffer;
}

/* The value at `value` as `vecs` vectors (zero-padded past head_dim). */
static inline __attribute__((always_inline)) void load_value(const float *value, int64_t dim,
                                                             const int64_t vecs, v16f *vv) {
    for (int64_t c = 0; c < dim / LANES; c++) vv[c] = load16(value + c * LANES);
    if (vecs * LANES != dim) {
        float tail[LANES] = {0};
        memcpy(tail, value + dim / LANES * LANES, sizeof(float) * (size_t)(dim % LANES));
        vv[vecs - 1] = load16(tail);
    }
}

/* Scores of `nr` rows (a constant after inlining) against one key tile
 * [head_dim][16] (row stride `stride`): lane j of row r sums q_r[d] * k_j[d] in
 * four partial sums (d mod 4, each in ascending d; an odd tail goes to the
 * first), then (s0 + s1) + (s2 + s3). Each key vector is loaded once for the
 * group; a row's arithmetic does not depend on the group. */
static inline __attribute__((always_inline)) void score_rows(
    const float *tile, int64_t stride, const float *query, int64_t dim, const int nr,
    float *out, int64_t out_stride) {
    v16f s[SCORE_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < 4; i++) s[r][i] = splat(0.0f);
    int64_t d = 0;
    for (; d + 4 <= dim; d += 4)
        for (int i = 0; i < 4; i++) {
            const v16f k = load16(tile + (d + i) * stride);
            for (int r = 0; r < nr; r++) s[r][i] = fma16(splat(query[r * dim + d + i]), k, s[r][i]);
        }
    for (; d < dim; d++) {
        const v16f k = load16(tile + d * stride);
        for (int r = 0; r < nr; r++) s[r][0] = fma16(splat(query[r * dim + d]), k, s[r][0]);
    }
    for (int r = 0; r < nr; r++)
        store16(out + r * out_stride, (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]));
}

/* Value sums of rows r0 .. r0 + nr - 1 (nr and vecs constants after inlining,
 * so the sums stay in registers): acc[r][:] = sum_j p_r[j] v_j over the row's
 * keys in ascending order, one FMA chain per vector; the table is walked
 * block by block and each value is loaded once for the group. */
static inline __attribute__((always_inline)) void value_rows(
    const step_plan *plan, const float *v_head, const int64_t *table, const float *scores,
    int64_t padded_keys, const int64_t *row_keys, int64_t r0, const int nr, const int64_t vecs,
    float *acc) {
    const int64_t dim = plan->head_dim, bs = plan->block_size, padded_dim = vecs * LANES;
    v16f sums[4][MAX_HEAD_DIM / LANES], vv[MAX_HEAD_DIM / LANES];
    for (int r = 0; r < nr; r++)
        for (int64_t c = 0; c < vecs; c++) sums[r][c] = splat(0.0f);
    const int64_t keys = row_keys[r0 + nr - 1]; /* keys grow with the row */
    for (int64_t j0 = 0, b = 0; j0 < keys; j0 += bs, b++) {
        const float *block = v_head + table[b] * bs * dim;
        const int64_t n = keys - j0 < bs ? keys - j0 : bs;
        for (int64_t o = 0; o < n; o++) {
            const int64_t j = j0 + o;
            load_value(block + o * dim, dim, vecs, vv);
            for (int r = 0; r < nr; r++) {
                if (j >= row_keys[r0 + r]) continue;
                const v16f p = splat(scores[(r0 + r) * padded_keys + j]);
                for (int64_t c = 0; c < vecs; c++) sums[r][c] = fma16(p, vv[c], sums[r][c]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int64_t c = 0; c < vecs; c++) store16(acc + (r0 + r) * padded_dim + c * LANES, sums[r][c]);
}

/* One work item: rows = its tokens x its query heads. Returns 0, or -3 when
 * out of memory. */
static int attend_item(const step_plan *plan, const work_item *item, const void *qkv,
                       const float *k_cache, const float *v_cache, void *out) {
    /* Values and accumulators are handled in 16-float vectors: a head_dim that
     * is not a multiple of 16 is zero-padded to one. */
    const int64_t dim = plan->head_dim, vecs = (dim + LANES - 1) / LANES, padded_dim = vecs * LANES;
    const int64_t start = plan->seq_start[item->seq] + item->first_token;
    const int64_t first_row = plan->seq_first_row[item->seq] + item->first_token;
    const int64_t tokens = item->num_tokens, heads = item->num_heads;
    const int64_t rows = tokens * heads;
    const int64_t num_keys = start + tokens;              /* keys the last token sees */
    const int64_t padded_keys = (num_keys + LANES - 1) / LANES * LANES;
    const int64_t *table = plan->block_tables + plan->seq_table[item->seq];
    const float *k_head = k_cache + item->kv_head * plan->cache_head_stride;
    const float *v_head = v_cache + item->kv_head * plan->cache_head_stride;

    float *scores = malloc(sizeof(float) * (size_t)(rows * padded_keys));
    float *query = malloc(sizeof(float) * (size_t)(rows * dim));
    float *acc = malloc(sizeof(float) * (size_t)(rows * padded_dim));
    if (scores == NULL || query == NULL || acc == NULL) {
        free(scores);
        free(query);
        free(acc);
        return -3;
    }
    float tile_buffer[MAX_HEAD_DIM * LANES];
    float row_sum[TOKEN_TILE * 32];
    int64_t row_keys[TOKEN_TILE * 32];

    /* Row r = token r / heads, head r % heads; query rotated and scaled once. */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = r / heads, head = item->first_head + r % heads;
        float *qr = query + r * dim;
        rope_head(plan, qkv, first_row + token, head * dim, start + token, qr);
        for (int64_t d = 0; d < dim; d++) qr[d] *= plan->scale;
        row_keys[r] = start + token + 1;
    }

    /* Scores, 16 keys at a time, for up to 4 rows at once sharing each key
     * load (score_rows: the same per-row arithmetic for any group). */
    for (int64_t k0 = 0; k0 < num_keys; k0 += LANES) {
        int64_t stride;
        const float *tile = key_tile(plan, k_head, table, k0, num_keys, tile_buffer, &stride);
        for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {
            const int nr = rows - r0 < SCORE_ROWS ? (int)(rows - r0) : SCORE_ROWS;
            if (k0 >= row_keys[r0 + nr - 1]) continue; /* keys grow with the row */
            const float *q = query + r0 * dim;
            float *out_scores = scores + r0 * padded_keys + k0;
            switch (nr) {
            case 4: score_rows(tile, stride, q, dim, 4, out_scores, padded_keys); break;
            case 3: score_rows(tile, stride, q, dim, 3, out_scores, padded_keys); break;
            case 2: score_rows(tile, stride, q, dim, 2, out_scores, padded_keys); break;
            default: score_rows(tile, stride, q, dim, 1, out_scores, padded_keys); break;
            }
        }
    }

    /* Softmax per row over its own keys; the sum runs in ascending key tiles. */
    for (int64_t r = 0; r < rows; r++) {
        float *sr = scores + r * padded_keys;
        const int64_t keys = row_keys[r];
        for (int64_t j = keys; j < (keys + LANES - 1) / LANES * LANES; j++) sr[j] = -INFINITY;
        v16f m = load16(sr);
        for (int64_t j = LANES; j < keys; j += LANES) {
            m = max16(m, load16(sr + j));
        }
        const float max = hmax16(m);
        v16f total = splat(0.0f);
        for (int64_t j = 0; j < keys; j += LANES) {
            v16f p = exp16(load16(sr + j) - splat(max));
            store16(sr + j, p);
            total += p;
        }
        row_sum[r] = hsum16(total);
    }

    /* Values: each row sums p_j * v_j over its keys in ascending order, in
     * registers, for a few rows at once sharing each value load (value_rows). */
    for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0;
        int nr;
        switch (vecs) {
        case 4:
            nr = left < 4 ? (int)left : 4;
            switch (nr) {
            case 4: value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 4, 4, acc); break;
            case 3: value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 3, 4, acc); break;
            case 2: value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 2, 4, acc); break;
            default: value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 1, 4, acc); break;
            }
            break;
        case 8:
            nr = left < 2 ? (int)left : 2;
            if (nr == 2)
                value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 2, 8, acc);
            else
                value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 1, 8, acc);
            break;
        default:
            nr = 1;
            value_rows(plan, v_head, table, scores, padded_keys, row_keys, r0, 1, vecs, acc);
            break;
        }
        r0 += nr;
    }

    const int64_t out_width = plan->num_heads * dim;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = r / heads, head = item->first_head + r % heads;
        const int64_t offset = (first_row + token) * out_width + head * dim;
        float *ar = acc + r * padded_dim;
        const v16f denominator = splat(row_sum[r]);
        for (int64_t c = 0; c < vecs; c++)
            store16(ar + c * LANES, load16(ar + c * LANES) / denominator);
        if (plan->out_bf16) {
            uint16_t *dst = (uint16_t *)out + offset;
            for (int64_t d = 0; d < dim; d++) dst[d] = float_to_bf16(ar[d]);
        } else {
            memcpy((float *)out + offset, ar, sizeof(float) * (size_t)dim);
        }
    }
    free(scores);
    free(query);
    free(acc);
    return 0;
}

/* See llmesh_kernels.h. */
int llmesh_paged_attention(const step_plan *plan, const void *qkv, float *k_cache, float *v_cache,
                           void *out) {
    if (plan->head_dim < 2 || plan->head_dim > MAX_HEAD_DIM || plan->head_dim % 2) return -1;
    if (plan->num_kv_heads < 1 || plan->num_heads % plan->num_kv_heads) return -2;
    const int64_t group = plan->num_heads / plan->num_kv_heads;
    if (group < 1 || group > 32) return -2;
    if (plan->block_size < 1) return -4;
    const int num_threads = plan->num_threads < 1 ? 1 : plan->num_threads;
    write_new_kv(plan, qkv, k_cache, v_cache);

    /* Items are (sequence, KV head, tile of up to 16 tokens): the query heads
     * of a KV head then share each key and value load. When that leaves fewer
     * than 4 items per thread (a single decode, a speculative verify of a few
     * tokens), one item per query head instead, for balance. */
    int64_t by_kv_head = 0;
    for (int64_t s = 0; s < plan->num_seqs; s++)
        by_kv_head += plan->num_kv_heads * ((plan->seq_num_tokens[s] + TOKEN_TILE - 1) / TOKEN_TILE);
    const int split_heads = by_kv_head < 4 * (int64_t)num_threads;
    const int64_t count = split_heads ? by_kv_head * group : by_kv_head;
    work_item *items = malloc(sizeof(work_item) * (size_t)(count ? count : 1));
    if (items == NULL) return -3;
    int64_t i = 0;
    for (int64_t s = 0; s < plan->num_seqs; s++) {
        const int64_t n = plan->seq_num_tokens[s];
        for (int64_t kvh = 0; kvh < plan->num_kv_heads; kvh++)
            for (int64_t t = 0; t < n; t += TOKEN_TILE) {
                const int64_t tokens = n - t < TOKEN_TILE ? n - t : TOKEN_TILE;
                if (split_heads) {
                    for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
                        items[i++] = (work_item){s, kvh, t, tokens, h, 1};
                } else {
                    items[i++] = (work_item){s, kvh, t, tokens, kvh * group, group};
                }
            }
    }
    int failed = 0;
    if (split_heads) {
        /* Contiguous runs of items per thread: the query heads of one KV head
         * mostly run on one thread, which then reads that head's keys and
         * values from memory once and from its cache after. */
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(| : failed)
        for (int64_t w = 0; w < count; w++)
            failed |= attend_item(plan, &items[w], qkv, k_cache, v_cache, out) != 0;
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : failed)
        for (int64_t w = 0; w < count; w++)
            failed |= attend_item(plan, &items[w], qkv, k_cache, v_cache, out) != 0;
    }
    free(items);
    return failed ? -3 : 0;
}
