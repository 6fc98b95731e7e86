/* admin.h: the operator requests (evict, drain, audit, metrics, budgets), status's tenants and
 * RSS, and the drain's deferred answer. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvc.pb-c.h"

struct kvcd;

/* The accounting recomputed from the sessions' tables and the pool's bitmaps: 0 when it agrees
 * (report: a summary), -EUCLEAN otherwise (report: what differs). Never aborts anything. */
int kvcd_audit(struct kvcd *d, char *report, size_t cap, uint64_t *ret_used, uint64_t *ret_blocks);

int admin_audit(struct kvcd *d, Kvc__Envelope *reply);
int admin_metrics(struct kvcd *d, Kvc__Envelope *reply);
int admin_budgets(struct kvcd *d, Kvc__Envelope *reply);
/* Fills the parts of a Status about budgets and kvcd's memory: each tenant's use against its
 * quota (in d->out) and kvcd's RSS. -ENOMEM when the reply arena is full. */
int admin_status_extras(struct kvcd *d, Kvc__Status *s);
int admin_budget_set(struct kvcd *d, const Kvc__BudgetSet *m, Kvc__Envelope *reply, char *why,
                     size_t why_len);
int admin_evict(struct kvcd *d, uint64_t id, Kvc__Envelope *reply, char *why, size_t why_len);
/* A drain with a timeout and sessions open answers later (*deferred): admin_tick() sends it. */
int admin_drain(struct kvcd *d, const Kvc__Drain *m, const uint8_t *rid, size_t rid_len, uint64_t request_id,
                Kvc__Envelope *reply, bool *deferred);
void admin_tick(struct kvcd *d, uint64_t now);
uint64_t admin_next_deadline(const struct kvcd *d);
