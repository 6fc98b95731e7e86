/* events_vllm.c: the KV events in vLLM's wire format (--events-format vllm), for cluster routers
 * built to read vLLM's.
 *
 * The format is vLLM 0.10.2's vllm/distributed/kv_events.py (docs/protocol.md writes it down):
 * msgspec structs with array_like=True, so every struct is a msgpack array of its fields in
 * declaration order, and the events are tagged (tag=True: the class name is the array's first
 * element):
 *
 *   EventBatch        [ts: float64 seconds, events: [event...], data_parallel_rank: int]
 *   BlockStored       ["BlockStored", block_hashes: [uint], parent_block_hash: uint | nil,
 *                      token_ids: [uint], block_size: uint, lora_id: nil, medium: str]
 *   BlockRemoved      ["BlockRemoved", block_hashes: [uint], medium: str]
 *   AllBlocksCleared  ["AllBlocksCleared"]
 *
 * Block hashes are 64-bit integers, as vLLM sends them by default
 * (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1). kvcd is one engine, not data-parallel: the rank is 0,
 * which vLLM's publisher also writes for its first rank (omit_defaults keeps a non-None rank).
 *
 * The encoding is msgpack-c's (packers write the shortest form of each integer, as msgspec's
 * encoder does, so a payload is byte for byte what msgspec makes of the same structs; the pytest
 * test checks this). Rejected: hand-rolled msgpack (one more encoder to get wrong).
 */
#include <errno.h>
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "events.h"

const char *events_vllm_medium(const char *backend_name) {
        return backend_name && strcmp(backend_name, "cuda") == 0 ? "GPU" : "CPU";
}

static int pack_str(msgpack_packer *pk, const char *s) {
        size_t n = strlen(s);
        return msgpack_pack_str(pk, n) | msgpack_pack_str_body(pk, s, n);
}

static int pack_hashes(msgpack_packer *pk, const uint64_t *h, uint32_t n) {
        int r = msgpack_pack_array(pk, n);
        for (uint32_t i = 0; i < n && r == 0; i++)
                r = msgpack_pack_uint64(pk, h[i]);
        return r;
}

static int pack_medium(msgpack_packer *pk, const char *medium) {
        return medium ? pack_str(pk, medium) : msgpack_pack_nil(pk);
}

static int pack_event(msgpack_packer *pk, const struct events_event *e) {
        int r;
        switch (e->kind) {
        case EVENTS_KIND_STORED:
                r = msgpack_pack_array(pk, 7) | pack_str(pk, "BlockStored") |
                    pack_hashes(pk, e->block_hashes, e->n_block_hashes);
                r |= e->parent_block_hash ? msgpack_pack_uint64(pk, e->parent_block_hash)
                                          : msgpack_pack_nil(pk);
                r |= msgpack_pack_array(pk, e->n_token_ids);
                for (size_t i = 0; i < e->n_token_ids && r == 0; i++)
                        r = msgpack_pack_uint32(pk, e->token_ids[i]);
                return r | msgpack_pack_uint32(pk, e->block_size) | msgpack_pack_nil(pk) /* lora_id */ |
                       pack_medium(pk, e->medium);
        case EVENTS_KIND_REMOVED:
                return msgpack_pack_array(pk, 3) | pack_str(pk, "BlockRemoved") |
                       pack_hashes(pk, e->block_hashes, e->n_block_hashes) | pack_medium(pk, e->medium);
        case EVENTS_KIND_CLEARED: return msgpack_pack_array(pk, 1) | pack_str(pk, "AllBlocksCleared");
        }
        return -1;
}

int events_vllm_encode(uint64_t ts_usec, const struct events_event *evs, size_t n, uint8_t **ret_buf,
                       size_t *ret_len) {
        msgpack_sbuffer sb;
        msgpack_packer pk;
        msgpack_sbuffer_init(&sb);
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        int r = msgpack_pack_array(&pk, 3) | msgpack_pack_double(&pk, (double)ts_usec / 1e6) |
                msgpack_pack_array(&pk, n);
        for (size_t i = 0; i < n && r == 0; i++)
                r = pack_event(&pk, &evs[i]);
        r |= msgpack_pack_int(&pk, 0); /* data_parallel_rank */
        if (r != 0) {
                msgpack_sbuffer_destroy(&sb);
                return -ENOMEM;
        }
        size_t len = sb.size;
        uint8_t *buf = (uint8_t *)msgpack_sbuffer_release(&sb);
        if (!buf) /* never: a batch is at least 4 bytes, so the buffer was allocated */
                return -ENOMEM;
        *ret_buf = buf;
        *ret_len = len;
        return 0;
}
