/* kvccache.h - libkvc as the forward pass's KV cache (model_cache_ops with a struct kvc_session *
 * as the context): what kvc-run, kvc-eval and the quality lab's tasks give model_forward_rows when
 * kvcd holds the cache; and as the store of importance scores (importance.h). Header-only, so the
 * engine's objects do not depend on libkvc. */
#ifndef KVC_ENGINE_KVCCACHE_H
#define KVC_ENGINE_KVCCACHE_H

#include <stdint.h>

#include "importance.h"
#include "kvc.h"
#include "model.h"

static inline int kvccache_store(void *ctx, int layer, int pos, const float *k, const float *v) {
        return kvc_append(ctx, (uint32_t)layer, pos, k, v);
}

static inline int kvccache_attend(void *ctx, int layer, int pos, const float *q, float *out) {
        (void)pos;
        return kvc_attend(ctx, (uint32_t)layer, q, out);
}

/* The layer's last n tokens were just stored (positions pos .. pos + n - 1). */
static inline int kvccache_attend_rows(void *ctx, int layer, int pos, uint32_t n, const float *q,
                                       float *out) {
        (void)pos;
        return kvc_attend_rows(ctx, (uint32_t)layer, n, q, out);
}

static const struct model_cache_ops kvccache_ops = { .store = kvccache_store,
                                                     .attend = kvccache_attend,
                                                     .attend_rows = kvccache_attend_rows };

static inline uint32_t kvccache_tokens(void *ctx, uint32_t layer) {
        return kvc_layer_tokens(ctx, layer);
}

static inline int kvccache_gather(void *ctx, uint32_t layer, uint32_t n, float *keys, float *values) {
        return kvc_layer_gather(ctx, layer, 0, n, 0, keys, values);
}

static inline int kvccache_get_scores(void *ctx, uint32_t layer, uint32_t n, float *score) {
        return kvc_layer_get_scores(ctx, layer, 0, n, score);
}

static inline int kvccache_set_scores(void *ctx, uint32_t layer, uint32_t n, const float *score) {
        return kvc_layer_set_scores(ctx, layer, 0, n, score);
}

static const struct importance_store_ops kvccache_store_ops = { .tokens = kvccache_tokens,
                                                                .gather = kvccache_gather,
                                                                .get_scores = kvccache_get_scores,
                                                                .set_scores = kvccache_set_scores };

#endif
