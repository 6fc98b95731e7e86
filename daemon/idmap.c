/* idmap.c: open-addressing id map (see idmap.h). */
#include "idmap.h"

#include <errno.h>
#include <stdlib.h>

static uint32_t slot_of(const struct idmap *m, uint64_t key) {
        key ^= key >> 33;
        key *= 0xff51afd7ed558ccdull;
        key ^= key >> 33;
        return (uint32_t)key & (m->cap - 1);
}

int idmap_init(struct idmap *m, uint32_t min_cap) {
        uint32_t cap = 16;
        while (cap < min_cap * 2)
                cap *= 2;
        m->keys = calloc(cap, sizeof(*m->keys));
        m->values = calloc(cap, sizeof(*m->values));
        if (!m->keys || !m->values) {
                free(m->keys);
                free(m->values);
                return -ENOMEM;
        }
        m->cap = cap;
        m->n = 0;
        return 0;
}

void idmap_done(struct idmap *m) {
        free(m->keys);
        free(m->values);
        m->keys = NULL;
        m->values = NULL;
        m->cap = m->n = 0;
}

void *idmap_get(const struct idmap *m, uint64_t key) {
        if (key == 0)
                return NULL;
        for (uint32_t i = slot_of(m, key);; i = (i + 1) & (m->cap - 1)) {
                if (m->keys[i] == key)
                        return m->values[i];
                if (m->keys[i] == 0)
                        return NULL;
        }
}

static int grow(struct idmap *m) {
        struct idmap bigger;
        int r = idmap_init(&bigger, m->cap);
        if (r < 0)
                return r;
        for (uint32_t i = 0; i < m->cap; i++)
                if (m->keys[i])
                        idmap_put(&bigger, m->keys[i], m->values[i]);
        idmap_done(m);
        *m = bigger;
        return 0;
}

int idmap_put(struct idmap *m, uint64_t key, void *value) {
        if (key == 0)
                return -EINVAL;
        if ((m->n + 1) * 2 > m->cap) {
                int r = grow(m);
                if (r < 0)
                        return r;
        }
        uint32_t i = slot_of(m, key);
        for (; m->keys[i]; i = (i + 1) & (m->cap - 1))
                if (m->keys[i] == key)
                        return -EEXIST;
        m->keys[i] = key;
        m->values[i] = value;
        m->n++;
        return 0;
}

void *idmap_del(struct idmap *m, uint64_t key) {
        if (key == 0)
                return NULL;
        uint32_t mask = m->cap - 1, i = slot_of(m, key);
        while (m->keys[i] != key) {
                if (m->keys[i] == 0)
                        return NULL;
                i = (i + 1) & mask;
        }
        void *value = m->values[i];
        /* shift back the entries that probed past the hole */
        for (uint32_t j = (i + 1) & mask; m->keys[j]; j = (j + 1) & mask) {
                uint32_t home = slot_of(m, m->keys[j]);
                if (((j - home) & mask) >= ((j - i) & mask)) {
                        m->keys[i] = m->keys[j];
                        m->values[i] = m->values[j];
                        i = j;
                }
        }
        m->keys[i] = 0;
        m->values[i] = NULL;
        m->n--;
        return value;
}

void *idmap_next(const struct idmap *m, uint32_t *pos) {
        while (*pos < m->cap) {
                uint32_t i = (*pos)++;
                if (m->keys[i])
                        return m->values[i];
        }
        return NULL;
}
