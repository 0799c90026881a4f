/* The bookkeeping between the model calls of a masked-diffusion decoder (Fast-dLLM, BlockBatch) on the CPU.
 *
 * Each function does in one pass what `hf_dscale/generation/dllm.py` does with a dozen small tensor operations: the
 * threshold commit of a step's windows (with the beliefs BlockBatch keeps), the stopping rule's scan of the rows,
 * and BlockBatch's confidence-gated merge. The torch functions there are the reference; dllm_host.py's tests hold
 * these to them.
 *
 * Layouts: x [rows, L] int64 row-major; a step's windows are R rows of Q slots, slot (r, q) at index r * Q + q of
 * logits [R * Q, V] (float32, row stride `ls`), valid and pos [R * Q]; row_of[r] is the row of x window r belongs
 * to. Probabilities are computed in double over the vocabulary without the mask token, as the torch reference does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The most likely token of one slot's logits (the mask token excluded; ties to the lowest id), its probability and
 * the EOS token's (0 when eos_id < 0). */
static void top_of(const float *logit, int64_t V, int64_t mask_id, int64_t eos_id, double *conf, int64_t *token,
                   double *eos_p) {
    double m = -INFINITY;
    int64_t arg = -1;
    for (int64_t j = 0; j < V; j++) {
        if (j == mask_id) continue;
        double s = logit[j];
        if (arg < 0 || s > m) {
            m = s;
            arg = j;
        }
    }
    /* summed in extended precision: a reordering of the same logits (two slots whose confidences tie) gives the
     * same sum, so ties go to the first slot as they do in exact arithmetic */
    long double total = 0.0L;
    for (int64_t j = 0; j < V; j++) {
        if (j != mask_id) total += exp((double)logit[j] - m);
    }
    double sum = (double)total;
    *conf = 1.0 / sum;
    *token = arg;
    *eos_p = (eos_id >= 0 && eos_id != mask_id) ? exp((double)logit[eos_id] - m) / sum : 0.0;
}

/* The stopping rule's read of R rows of x (rows[r]), over the generation region [p, L): out[r] = (first masked
 * offset in the region or -1, the answer's end (exclusive; -1 while undecided), tokens decoded in the region). The
 * end is after the first EOS with no mask before it, or L when the region holds neither a mask nor an EOS. */
void hf_dscale_dllm_scan(const int64_t *x, int64_t L, int64_t R, const int64_t *rows, int64_t p, int64_t mask_id,
                         int64_t eos_id, int64_t *out) {
    for (int64_t r = 0; r < R; r++) {
        const int64_t *row = x + rows[r] * L;
        int64_t first = -1, end = -1, masks = 0;
        for (int64_t l = p; l < L; l++) {
            if (row[l] == mask_id) {
                masks++;
                if (first < 0) first = l - p;
            } else if (row[l] == eos_id && first < 0 && end < 0) {
                end = l + 1;
            }
        }
        if (first < 0 && end < 0) end = L;
        out[3 * r] = first;
        out[3 * r + 1] = end;
        out[3 * r + 2] = (L - p) - masks;
    }
}

/* The threshold commit of R windows: in each, every valid slot whose position of x holds the mask and whose
 * probability is >= threshold takes its most likely token, and at least the most confident such slot does (ties to
 * the first slot). All slots read x as it was before the step. Where `prob` is given, every valid slot's
 * (probability, EOS probability, token) also goes to prob, eosp and best [rows, L] at its row and position.
 * counts[r]: the tokens window r committed; where `scan_out` is given, the rows are then scanned into it
 * (`hf_dscale_dllm_scan` from p). */
void hf_dscale_dllm_commit(const float *logits, int64_t ls, int64_t V, int64_t R, int64_t Q, const uint8_t *valid,
                           const int64_t *row_of, const int64_t *pos, int64_t *x, int64_t L, int64_t mask_id,
                           int64_t eos_id, double threshold, float *prob, float *eosp, int64_t *best,
                           int64_t *counts, int64_t p, int64_t *scan_out, int threads) {
    int64_t S = R * Q;
    double *conf = malloc(sizeof(double) * S), *eos_p = malloc(sizeof(double) * S);
    int64_t *token = malloc(sizeof(int64_t) * S);
    /* every slot's softmax first (the work: split between threads), reading nothing the commits write */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t s = 0; s < S; s++) {
        if (valid[s]) top_of(logits + s * ls, V, mask_id, eos_id, &conf[s], &token[s], &eos_p[s]);
    }
    for (int64_t r = 0; r < R; r++) {
        int64_t *row = x + row_of[r] * L;
        int64_t top = -1;
        for (int64_t s = r * Q; s < (r + 1) * Q; s++) {
            if (!valid[s]) continue;
            if (prob != NULL) {
                int64_t at = row_of[r] * L + pos[s];
                prob[at] = (float)conf[s];
                eosp[at] = (float)eos_p[s];
                best[at] = token[s];
            }
            if (row[pos[s]] == mask_id && (top < 0 || conf[s] > conf[top])) top = s;
        }
        int64_t n = 0;
        for (int64_t s = r * Q; s < (r + 1) * Q && top >= 0; s++) {  /* reads x as it was: a window's positions differ */
            if (valid[s] && row[pos[s]] == mask_id && (s == top || conf[s] >= threshold)) {
                row[pos[s]] = token[s];
                n++;
            }
        }
        counts[r] = n;
    }
    free(conf);
    free(eos_p);
    free(token);
    if (scan_out != NULL) hf_dscale_dllm_scan(x, L, R, row_of, p, mask_id, eos_id, scan_out);
}


/* The beliefs of a full forward: logits [R, L, V] (row stride `rs`, position stride `ls`) of R distinct rows; branch
 * rows[n] (n < N) takes those of distinct row of_row[n], every position: its probability, EOS probability and most
 * likely token go to prob, eosp and best [rows, L]. Each (distinct row, position) is computed once. */
void hf_dscale_dllm_beliefs(const float *logits, int64_t rs, int64_t ls, int64_t V, int64_t R, int64_t L,
                            int64_t N, const int64_t *rows, const int64_t *of_row, int64_t mask_id, int64_t eos_id,
                            float *prob, float *eosp, int64_t *best, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t s = 0; s < R * L; s++) {
        int64_t u = s / L, l = s % L, token;
        double conf, eos_p;
        top_of(logits + u * rs + l * ls, V, mask_id, eos_id, &conf, &token, &eos_p);
        for (int64_t n = 0; n < N; n++) {
            if (of_row[n] != u) continue;
            int64_t at = rows[n] * L + l;
            prob[at] = (float)conf;
            eosp[at] = (float)eos_p;
            best[at] = token;
        }
    }
}


/* BlockBatch's confidence-gated merge over R branches (rows[r] of x; all read the rows as they were): branch d adopts,
 * at each of its masked positions l where prob[d, l] > gate, its most likely token best[d, l] if a source s offers
 * it: after[d * R + s] (s's window ends earlier, or as early and s comes later), s agrees with d wherever both are
 * decoded, and x[s, l] == best[d, l] with l in s's window [start[s], start[s] + size[s]). adopted[d]: its count.
 * The rows are then scanned into scan_out (`hf_dscale_dllm_scan` from p, no EOS). */
void hf_dscale_dllm_merge(int64_t *x, int64_t L, int64_t R, const int64_t *rows, const uint8_t *after,
                          const int64_t *start, const int64_t *size, const float *prob, const int64_t *best, float gate,
                          int64_t mask_id, int64_t *adopted, int64_t p, int64_t *scan_out) {
    int64_t *before = malloc(sizeof(int64_t) * R * L);
    for (int64_t r = 0; r < R; r++) memcpy(before + r * L, x + rows[r] * L, sizeof(int64_t) * L);
    uint8_t *source = malloc(R * R);
    for (int64_t d = 0; d < R; d++) {
        for (int64_t s = 0; s < R; s++) {
            uint8_t ok = after[d * R + s];
            const int64_t *a = before + d * L, *b = before + s * L;
            for (int64_t l = 0; ok && l < L; l++) {
                if (a[l] != mask_id && b[l] != mask_id && a[l] != b[l]) ok = 0;
            }
            source[d * R + s] = ok;
        }
    }
    for (int64_t d = 0; d < R; d++) {
        int64_t n = 0, at = rows[d] * L;
        for (int64_t l = 0; l < L; l++) {
            if (before[d * L + l] != mask_id || !(prob[at + l] > gate)) continue;
            int64_t want = best[at + l];
            for (int64_t s = 0; s < R; s++) {
                if (source[d * R + s] && l >= start[s] && l < start[s] + size[s] && before[s * L + l] == want) {
                    x[at + l] = want;
                    n++;
                    break;
                }
            }
        }
        adopted[d] = n;
    }
    free(source);
    free(before);
    hf_dscale_dllm_scan(x, L, R, rows, p, mask_id, -1, scan_out);
}


/* A BlockBatch step's commit (`hf_dscale_dllm_commit`, scanned into scan_out [R, 3]), then, unless a window's row
 * has an ended answer (returns -1: the decoder stops), the merge that follows it: each window's branch still holding
 * a mask moves its window to the block of its own grid (size[r]) holding its first mask, into start[r]; the merge
 * orders them by window end, the latest first (ties in window order), and runs over them (`hf_dscale_dllm_merge`
 * with mprob and mbest [rows, L]), into adopted and merge_scan [R, 3] in window order. Returns how many branches
 * the merge ran over (0: fewer than two). */
int64_t hf_dscale_dllm_commit_merge(const float *logits, int64_t ls, int64_t V, int64_t R, int64_t Q,
                                    const uint8_t *valid, const int64_t *row_of, const int64_t *pos, int64_t *x,
                                    int64_t L, int64_t mask_id, int64_t eos_id, double threshold, float *prob,
                                    float *eosp, int64_t *best, int64_t *counts, int64_t p, int64_t *scan_out,
                                    int threads, const int64_t *size, int64_t *start, const float *mprob,
                                    const int64_t *mbest, float gate, int64_t *adopted, int64_t *merge_scan) {
    hf_dscale_dllm_commit(logits, ls, V, R, Q, valid, row_of, pos, x, L, mask_id, eos_id, threshold, prob, eosp,
                          best, counts, p, scan_out, threads);
    int64_t n = 0;
    for (int64_t r = 0; r < R; r++) {
        if (scan_out[3 * r + 1] >= 0) return -1;
    }
    int64_t *live = malloc(sizeof(int64_t) * R * 4);
    int64_t *rows = live + R, *starts = live + 2 * R, *sizes = live + 3 * R;
    for (int64_t r = 0; r < R; r++) {
        int64_t first = scan_out[3 * r];
        if (first < 0) continue;
        start[r] = p + (first / size[r]) * size[r];
        live[n++] = r;
    }
    if (n >= 2) {
        int64_t *order = malloc(sizeof(int64_t) * n);
        uint8_t *after = malloc(n * n);
        for (int64_t k = 0; k < n; k++) {  /* stable insertion sort, latest window end first */
            int64_t j = k;
            while (j > 0 && start[live[order[j - 1]]] + size[live[order[j - 1]]] < start[live[k]] + size[live[k]]) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = k;
        }
        int64_t *rank = rows;  /* borrowed: rank of each live branch in the order, before rows is filled */
        for (int64_t k = 0; k < n; k++) rank[order[k]] = k;
        for (int64_t d = 0; d < n; d++) {
            for (int64_t s = 0; s < n; s++) after[d * n + s] = rank[s] > rank[d];
        }
        for (int64_t k = 0; k < n; k++) {
            rows[k] = row_of[live[k]];
            starts[k] = start[live[k]];
            sizes[k] = size[live[k]];
        }
        hf_dscale_dllm_merge(x, L, n, rows, after, starts, sizes, mprob, mbest, gate, mask_id, adopted, p,
                             merge_scan);
        free(order);
        free(after);
    }
    free(live);
    return n >= 2 ? n : 0;
}
