/* kvc_fuzz.h: libkvc without a daemon, for fuzzers and tests (not part of the public API).
 *
 * A fuzz client owns a private, fully mapped pool (8 chunks of 64 KiB) and one session; whatever
 * kvcd would send it (grants, plans, errors) can be fed as raw frames, and the session appended
 * to and attended over. A frame from a faulty or hostile daemon must never make libkvc touch
 * memory outside the pool and its own objects: the fuzzer runs under AddressSanitizer to prove
 * it. The plan buffer is chunk 0; blocks may be granted anywhere in chunks 1..7.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "kvc.h"

int kvc_fuzz_client_new(const struct kvc_geometry *g, uint32_t max_layer_tokens, uint64_t plan_bytes,
                        struct kvc_client **ret_c, struct kvc_session **ret_s);
/* The pool (to write a plan buffer into) and its size. */
uint8_t *kvc_fuzz_pool(struct kvc_client *c, uint64_t *ret_bytes);
/* Decodes one frame as if kvcd sent it and handles it; -errno when refused. */
int kvc_fuzz_feed(struct kvc_client *c, const void *data, size_t len);
/* One step of every layer: kv ([n_kv_heads * head_dim]) appended as key and value, q attended. */
int kvc_fuzz_step(struct kvc_session *s, uint64_t step, const float *kv, const float *q, float *out);
/* Tier t of a layer as libkvc holds it (t < kvc_session_tiers(s)): its tokens, its blocks and their
 * size. -EINVAL past the session's layers or tiers. */
struct kvc_fuzz_tier {
        uint32_t n_tokens;
        uint32_t n_blocks;
        uint32_t block_tokens;
        uint64_t block_bytes;
        uint8_t *const *blocks;
};
int kvc_fuzz_tier(const struct kvc_session *s, uint32_t layer, uint32_t tier, struct kvc_fuzz_tier *ret);
