/* idmap.h: a map from non-zero 64-bit ids to pointers (sessions by id). Open addressing with
 * linear probing and backward-shift deletion: no tombstones, so lookups stay short however many
 * sessions come and go. The map owns its table, not the values. */
#pragma once

#include <stdint.h>

struct idmap {
        uint64_t *keys; /* 0 = empty */
        void **values;
        uint32_t cap; /* a power of two */
        uint32_t n;
};

int idmap_init(struct idmap *m, uint32_t min_cap);
void idmap_done(struct idmap *m);
void *idmap_get(const struct idmap *m, uint64_t key);
/* -EEXIST when present, -ENOMEM when the table cannot grow. */
int idmap_put(struct idmap *m, uint64_t key, void *value);
/* Returns the value removed, or NULL. */
void *idmap_del(struct idmap *m, uint64_t key);
/* Every value, in no particular order: for (uint32_t i = 0; (v = idmap_next(m, &i));). The map
 * must not change during the walk. */
void *idmap_next(const struct idmap *m, uint32_t *pos);
