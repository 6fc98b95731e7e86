/* test_wire.c - unit tests of proto/wire.c: framing, the unpack arena and the validators.
 *
 * Owns: a round trip (wire_pack, then wire_decode) of every message kind of kvc.proto with
 * realistic fields, and every rejection path: the frame cap, bytes that are no envelope, the
 * version, a missing or unknown body, an exhausted arena, and each field check of each
 * validator. A rejection is checked twice, on the struct (wire_validate) and on the packed frame
 * (wire_decode), and must name the field in `why`, so a test cannot pass because some other
 * check fired first.
 *
 * Valid messages are built by one `*_fx_init` function per kind; a rejection test starts from a
 * valid message and changes one field (the REJECT_* macros), so each case reads as one line.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "wire.h"

/* Large enough for the biggest message any test builds (65537 block references). */
#define TEST_ARENA_BYTES (16u * 1024u * 1024u)

static struct wire_arena *arena;

static int group_setup(void **state) {
        (void)state;
        return wire_arena_new(TEST_ARENA_BYTES, &arena) < 0 ? -1 : 0;
}

static int group_teardown(void **state) {
        (void)state;
        arena = wire_arena_free(arena);
        return 0;
}

static uint8_t *pack_env(const Kvc__Envelope *env, size_t *ret_len) {
        size_t n = wire_packed_size(env);
        uint8_t *buf = malloc(n ? n : 1);

        assert_non_null(buf);
        assert_int_equal(wire_pack(env, buf), n);
        *ret_len = n;
        return buf;
}

/* Packs env and decodes it again; fails the test when decoding does. */
static Kvc__Envelope *round_trip(const Kvc__Envelope *env) {
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope *out = NULL;
        size_t len;
        uint8_t *buf = pack_env(env, &len);
        int r = wire_decode(arena, buf, len, WIRE_REPLY_MAX_BYTES, &out, why, sizeof(why));

        free(buf);
        if (r != 0)
                fail_msg("decoding a valid %s failed: %d (%s)", wire_body_name(env->body_case), r, why);
        assert_non_null(out);
        assert_int_equal(out->version, env->version);
        assert_int_equal(out->request_id, env->request_id);
        assert_int_equal(out->body_case, env->body_case);
        return out;
}

/* Both wire_validate(env) and wire_decode(pack(env)) must answer `code`, explain it in `why`
 * with a text containing `word`, and leave *ret alone. */
#define EXPECT_REJECT(env, code, word) expect_reject((env), (code), (word), __LINE__)

static void expect_reject(const Kvc__Envelope *env, int code, const char *word, int line) {
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope sentinel = KVC__ENVELOPE__INIT;
        Kvc__Envelope *out = &sentinel;
        size_t len;
        uint8_t *buf;
        int r;

        r = wire_validate(env, why, sizeof(why));
        if (r != code || why[0] == '\0' || !strstr(why, word))
                fail_msg("line %d: wire_validate gave %d (%s), want %d mentioning '%s'", line, r, why, code,
                         word);

        buf = pack_env(env, &len);
        why[0] = '\0';
        r = wire_decode(arena, buf, len, WIRE_REPLY_MAX_BYTES, &out, why, sizeof(why));
        free(buf);
        if (r != code || why[0] == '\0' || !strstr(why, word))
                fail_msg("line %d: wire_decode gave %d (%s), want %d mentioning '%s'", line, r, why, code,
                         word);
        if (out != &sentinel)
                fail_msg("line %d: wire_decode wrote *ret on failure", line);
}

#define EXPECT_VALID(env) expect_valid((env), __LINE__)

static void expect_valid(const Kvc__Envelope *env, int line) {
        char why[WIRE_MAX_MESSAGE] = "";
        int r = wire_validate(env, why, sizeof(why));

        if (r != 0)
                fail_msg("line %d: a valid message was refused: %d (%s)", line, r, why);
        round_trip(env);
}

static uint8_t token_bytes[WIRE_TOKEN_BYTES + 1] = { 0x5a, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07,
                                                     0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0xa5 };

/* A string of n copies of c, in a static buffer (one at a time). */
static char *repeat(char c, size_t n) {
        static char buf[4096];

        assert_true(n < sizeof(buf));
        memset(buf, c, n);
        buf[n] = '\0';
        return buf;
}

static void env_init(Kvc__Envelope *env, Kvc__Envelope__BodyCase body, void *msg) {
        *env = (Kvc__Envelope)KVC__ENVELOPE__INIT;
        env->version = WIRE_VERSION;
        env->request_id = 0x1234567890abcdefull;
        env->body_case = body;
        env->hello = msg; /* the union's members share storage */
}

/* ---- one valid message per kind ---- */

struct hello_fx {
        Kvc__Envelope env;
        Kvc__Hello m;
};

static void hello_fx_init(struct hello_fx *f) {
        f->m = (Kvc__Hello)KVC__HELLO__INIT;
        f->m.token.data = token_bytes;
        f->m.token.len = WIRE_TOKEN_BYTES;
        f->m.client_name = "kvc-run pid 4242 (stories260K)";
        env_init(&f->env, KVC__ENVELOPE__BODY_HELLO, &f->m);
}

struct welcome_fx {
        Kvc__Envelope env;
        Kvc__Welcome m;
};

static void welcome_fx_init(struct welcome_fx *f) {
        f->m = (Kvc__Welcome)KVC__WELCOME__INIT;
        f->m.client_id = 7;
        f->m.chunk_bytes = 2u << 20;
        f->m.pool_bytes = 1ull << 30;
        f->m.block_tokens = 16;
        f->m.backend = "host";
        f->m.daemon_version = "kvcd 0.2.0";
        env_init(&f->env, KVC__ENVELOPE__BODY_WELCOME, &f->m);
}

struct open_fx {
        Kvc__Envelope env;
        Kvc__OpenSession m;
        Kvc__Geometry g;
        Kvc__Param params[WIRE_MAX_PARAMS + 1];
        Kvc__Param *pp[WIRE_MAX_PARAMS + 1];
};

static void open_fx_init(struct open_fx *f) {
        f->g = (Kvc__Geometry)KVC__GEOMETRY__INIT;
        f->g.n_layers = 32;
        f->g.n_heads = 32;
        f->g.n_kv_heads = 8;
        f->g.head_dim = 128;
        f->g.dtype = KVC__DTYPE__DTYPE_BF16;
        f->g.max_tokens = 8192;
        for (size_t i = 0; i < WIRE_MAX_PARAMS + 1; i++) {
                f->params[i] = (Kvc__Param)KVC__PARAM__INIT;
                f->params[i].key = "p";
                f->params[i].value_case = KVC__PARAM__VALUE_NUMBER;
                f->params[i].number = (double)i;
                f->pp[i] = &f->params[i];
        }
        f->params[0].key = "ema_gamma";
        f->params[0].number = 0.95;
        f->params[1].key = "mode";
        f->params[1].value_case = KVC__PARAM__VALUE_TEXT;
        f->params[1].text = "per_head";
        f->m = (Kvc__OpenSession)KVC__OPEN_SESSION__INIT;
        f->m.geometry = &f->g;
        f->m.policy = "window";
        f->m.budget_tokens = 1024;
        f->m.n_params = 2;
        f->m.params = f->pp;
        f->m.tenant = "team-a";
        env_init(&f->env, KVC__ENVELOPE__BODY_OPEN_SESSION, &f->m);
}

struct opened_fx {
        Kvc__Envelope env;
        Kvc__SessionOpened m;
};

static void opened_fx_init(struct opened_fx *f) {
        f->m = (Kvc__SessionOpened)KVC__SESSION_OPENED__INIT;
        f->m.session_id = 99;
        f->m.token.data = token_bytes;
        f->m.token.len = WIRE_TOKEN_BYTES;
        f->m.block_bytes = 131072 + 5 * 512;
        f->m.block_tokens = 16;
        f->m.plan_offset = 3ull << 21;
        f->m.plan_bytes = 4096;
        f->m.ema_gamma = 0.9f;
        f->m.max_layer_tokens = 1040;
        f->m.policy = "window";
        f->m.budget_tokens = 1024;
        env_init(&f->env, KVC__ENVELOPE__BODY_SESSION_OPENED, &f->m);
}

struct reserve_fx {
        Kvc__Envelope env;
        Kvc__Reserve m;
};

static void reserve_fx_init(struct reserve_fx *f) {
        f->m = (Kvc__Reserve)KVC__RESERVE__INIT;
        f->m.session_id = 99;
        f->m.n_tokens = 517;
        env_init(&f->env, KVC__ENVELOPE__BODY_RESERVE, &f->m);
}

#define FX_LAYERS 3
#define FX_BLOCKS 4

/* Layers with FX_BLOCKS blocks each, for grants and releases. */
struct blocks_fx {
        Kvc__LayerBlocks lb[WIRE_MAX_LAYERS + 1];
        Kvc__LayerBlocks *plb[WIRE_MAX_LAYERS + 1];
        uint64_t offs[WIRE_MAX_LAYERS + 1][FX_BLOCKS];
};

static void blocks_fx_init(struct blocks_fx *b) {
        for (uint32_t l = 0; l < WIRE_MAX_LAYERS + 1; l++) {
                b->lb[l] = (Kvc__LayerBlocks)KVC__LAYER_BLOCKS__INIT;
                b->lb[l].layer = l % WIRE_MAX_LAYERS;
                for (uint32_t i = 0; i < FX_BLOCKS; i++)
                        b->offs[l][i] = (2ull << 20) * (l + 1) + (uint64_t)i * 133632;
                b->lb[l].n_blocks = FX_BLOCKS;
                b->lb[l].blocks = b->offs[l];
                b->plb[l] = &b->lb[l];
        }
}

struct grant_fx {
        Kvc__Envelope env;
        Kvc__Grant m;
        struct blocks_fx b;
};

static void grant_fx_init(struct grant_fx *f) {
        blocks_fx_init(&f->b);
        f->m = (Kvc__Grant)KVC__GRANT__INIT;
        f->m.session_id = 99;
        f->m.n_layers = FX_LAYERS;
        f->m.layers = f->b.plb;
        env_init(&f->env, KVC__ENVELOPE__BODY_GRANT, &f->m);
}

#define FX_STEPS 3

struct steps_fx {
        Kvc__Envelope env;
        Kvc__StepBatch m;
        Kvc__Step steps[WIRE_MAX_STEPS + 1];
        Kvc__Step *ps[WIRE_MAX_STEPS + 1];
        uint32_t layer_tokens[WIRE_MAX_LAYERS + 1];
        float topk[WIRE_MAX_TOPK + 1];
};

static void steps_fx_init(struct steps_fx *f) {
        for (uint32_t l = 0; l < WIRE_MAX_LAYERS + 1; l++)
                f->layer_tokens[l] = 300 + l;
        for (uint32_t k = 0; k < WIRE_MAX_TOPK + 1; k++)
                f->topk[k] = -0.05f - 0.5f * (float)k;
        for (uint32_t i = 0; i < WIRE_MAX_STEPS + 1; i++) {
                Kvc__Step *s = &f->steps[i];
                *s = (Kvc__Step)KVC__STEP__INIT;
                s->session_id = 10 + i % 3;
                s->step = 1000 + i;
                s->phase = i == 0 ? KVC__PHASE__PHASE_PREFILL : KVC__PHASE__PHASE_DECODE;
                s->n_layer_tokens = FX_LAYERS;
                s->layer_tokens = f->layer_tokens;
                s->entropy = 0.125f + 0.001f * (float)(i % 100);
                s->top1_prob = 0.75f;
                s->margin = 2.5f;
                s->n_topk_logprobs = 4;
                s->topk_logprobs = f->topk;
                f->ps[i] = s;
        }
        f->m = (Kvc__StepBatch)KVC__STEP_BATCH__INIT;
        f->m.n_steps = FX_STEPS;
        f->m.steps = f->ps;
        env_init(&f->env, KVC__ENVELOPE__BODY_STEP_BATCH, &f->m);
}

#define FX_PLANS 2

struct plans_fx {
        Kvc__Envelope env;
        Kvc__PlanBatch m;
        Kvc__Plan plans[WIRE_MAX_STEPS + 1];
        Kvc__Plan *pp[WIRE_MAX_STEPS + 1];
        Kvc__LayerPlan lp[WIRE_MAX_LAYERS + 1];
        Kvc__LayerPlan *plp[WIRE_MAX_LAYERS + 1];
        Kvc__Grant grants[WIRE_MAX_STEPS + 1];
        Kvc__Grant *pg[WIRE_MAX_STEPS + 1];
        Kvc__Error errors[WIRE_MAX_STEPS + 1];
        Kvc__Error *pe[WIRE_MAX_STEPS + 1];
        struct blocks_fx b;
};

static void plans_fx_init(struct plans_fx *f) {
        blocks_fx_init(&f->b);
        for (uint32_t l = 0; l < WIRE_MAX_LAYERS + 1; l++) {
                f->lp[l] = (Kvc__LayerPlan)KVC__LAYER_PLAN__INIT;
                f->lp[l].layer = l % WIRE_MAX_LAYERS;
                f->lp[l].base_tokens = 272;
                f->lp[l].keep_offset = 256 * l;
                f->lp[l].keep_count = 256;
                f->lp[l].per_head = l % 2;
                f->plp[l] = &f->lp[l];
        }
        for (uint32_t i = 0; i < WIRE_MAX_STEPS + 1; i++) {
                f->plans[i] = (Kvc__Plan)KVC__PLAN__INIT;
                f->plans[i].session_id = 10 + i;
                f->plans[i].plan_id = 500 + i;
                f->plans[i].base_step = 1001 + i;
                f->plans[i].n_layers = FX_LAYERS;
                f->plans[i].layers = f->plp;
                f->pp[i] = &f->plans[i];
                f->grants[i] = (Kvc__Grant)KVC__GRANT__INIT;
                f->grants[i].session_id = 20 + i;
                f->grants[i].n_layers = 2;
                f->grants[i].layers = f->b.plb;
                f->pg[i] = &f->grants[i];
                f->errors[i] = (Kvc__Error)KVC__ERROR__INIT;
                f->errors[i].code = ENOSPC;
                f->errors[i].message = "no room for session 12 in the pool";
                f->errors[i].session_id = 12;
                f->pe[i] = &f->errors[i];
        }
        f->m = (Kvc__PlanBatch)KVC__PLAN_BATCH__INIT;
        f->m.n_plans = FX_PLANS;
        f->m.plans = f->pp;
        f->m.n_grants = 1;
        f->m.grants = f->pg;
        f->m.n_errors = 1;
        f->m.errors = f->pe;
        env_init(&f->env, KVC__ENVELOPE__BODY_PLAN_BATCH, &f->m);
}

struct applied_fx {
        Kvc__Envelope env;
        Kvc__PlanApplied m;
        uint32_t layer_tokens[WIRE_MAX_LAYERS + 1];
        struct blocks_fx b;
};

static void applied_fx_init(struct applied_fx *f) {
        blocks_fx_init(&f->b);
        for (uint32_t l = 0; l < WIRE_MAX_LAYERS + 1; l++)
                f->layer_tokens[l] = 257;
        f->m = (Kvc__PlanApplied)KVC__PLAN_APPLIED__INIT;
        f->m.session_id = 99;
        f->m.plan_id = 500;
        f->m.status = 0;
        f->m.n_layer_tokens = FX_LAYERS;
        f->m.layer_tokens = f->layer_tokens;
        f->m.n_released = FX_LAYERS;
        f->m.released = f->b.plb;
        env_init(&f->env, KVC__ENVELOPE__BODY_PLAN_APPLIED, &f->m);
}

struct error_fx {
        Kvc__Envelope env;
        Kvc__Error m;
};

static void error_fx_init(struct error_fx *f) {
        f->m = (Kvc__Error)KVC__ERROR__INIT;
        f->m.code = ESTALE;
        f->m.message = "plan 500 of session 99 is stale: the layer grew since";
        f->m.session_id = 99;
        env_init(&f->env, KVC__ENVELOPE__BODY_ERROR, &f->m);
}

struct status_fx {
        Kvc__Envelope env;
        Kvc__Status m;
        Kvc__TenantBudget t[2];
        Kvc__TenantBudget *tp[2];
};

static void status_fx_init(struct status_fx *f) {
        f->m = (Kvc__Status)KVC__STATUS__INIT;
        f->m.version = "kvcd 0.2.0";
        f->m.backend = "host";
        f->m.uptime_usec = 123456789;
        f->m.capacity_bytes = 8ull << 30;
        f->m.used_bytes = 3ull << 29;
        f->m.chunk_bytes = 2u << 20;
        f->m.chunks_total = 4096;
        f->m.chunks_in_use = 800;
        f->m.clients = 3;
        f->m.sessions = 5;
        f->m.steps_total = 1000000;
        f->m.plans_total = 3900;
        f->m.client_deaths = 1;
        f->m.errors_total = 17;
        f->m.rss_bytes = 40u << 20;
        f->m.rss_anon_bytes = 3u << 20;
        f->m.step_batches_total = 250000;
        for (int i = 0; i < 2; i++) {
                f->t[i] = (Kvc__TenantBudget)KVC__TENANT_BUDGET__INIT;
                f->t[i].name = i ? "search" : "batch";
                f->t[i].used_bytes = (uint64_t)(i + 1) << 20;
                f->t[i].quota_bytes = 1ull << 30;
                f->t[i].sessions = (uint32_t)i + 2;
                f->tp[i] = &f->t[i];
        }
        f->m.tenants = f->tp;
        f->m.n_tenants = 2;
        env_init(&f->env, KVC__ENVELOPE__BODY_STATUS, &f->m);
}

#define FX_SESSIONS 2

struct list_fx {
        Kvc__Envelope env;
        Kvc__SessionList m;
        Kvc__SessionInfo info[FX_SESSIONS];
        Kvc__SessionInfo *pi[FX_SESSIONS];
};

static void list_fx_init(struct list_fx *f) {
        for (uint32_t i = 0; i < FX_SESSIONS; i++) {
                Kvc__SessionInfo *s = &f->info[i];
                *s = (Kvc__SessionInfo)KVC__SESSION_INFO__INIT;
                s->session_id = 40 + i;
                s->pid = 4242 + i;
                s->uid = 1000;
                s->tenant = i ? "team b" : "";
                s->policy = i ? "window" : "full";
                s->budget_tokens = 256;
                s->tokens = 270 + i;
                s->blocks = 17 * 32;
                s->bytes = 17ull * 32 * 133632;
                s->confidence = 0.85f;
                s->steps = 900 + i;
                s->plans = 50;
                s->age_usec = 5000000;
                s->peak_tokens = 272;
                s->n_layers = 32;
                f->pi[i] = s;
        }
        f->m = (Kvc__SessionList)KVC__SESSION_LIST__INIT;
        f->m.n_sessions = FX_SESSIONS;
        f->m.sessions = f->pi;
        env_init(&f->env, KVC__ENVELOPE__BODY_SESSION_LIST, &f->m);
}

/* ---- round trips ---- */

static void wire_round_trips_hello(void **state) {
        struct hello_fx f;
        (void)state;
        hello_fx_init(&f);
        Kvc__Envelope *e = round_trip(&f.env);
        assert_int_equal(e->hello->token.len, WIRE_TOKEN_BYTES);
        assert_memory_equal(e->hello->token.data, token_bytes, WIRE_TOKEN_BYTES);
        assert_string_equal(e->hello->client_name, f.m.client_name);
}

static void wire_round_trips_welcome(void **state) {
        struct welcome_fx f;
        (void)state;
        welcome_fx_init(&f);
        Kvc__Welcome *m = round_trip(&f.env)->welcome;
        assert_int_equal(m->client_id, 7);
        assert_int_equal(m->chunk_bytes, 2u << 20);
        assert_int_equal(m->pool_bytes, 1ull << 30);
        assert_int_equal(m->block_tokens, 16);
        assert_string_equal(m->backend, "host");
        assert_string_equal(m->daemon_version, "kvcd 0.2.0");
}

/* A kind kvcd only sends, sent to it as a request, is refused as one (EPROTO), not for its fields:
 * a Welcome with chunk_bytes 0 was answered EINVAL "chunk size 0 invalid" (issue 28, item 12). */
static void wire_refuses_a_reply_kind_as_a_request(void **state) {
        struct welcome_fx f;
        struct error_fx e;
        struct plans_fx p;
        (void)state;
        welcome_fx_init(&f);
        f.m.chunk_bytes = 0;
        error_fx_init(&e);
        plans_fx_init(&p);
        const Kvc__Envelope *replies[] = { &f.env, &e.env, &p.env };
        for (size_t i = 0; i < sizeof(replies) / sizeof(replies[0]); i++) {
                Kvc__Envelope env = *replies[i];
                size_t len;
                uint8_t *buf = pack_env(&env, &len);
                char why[WIRE_MAX_MESSAGE] = "";
                Kvc__Envelope *out = NULL;
                uint64_t rid = 0;
                int r = wire_decode_request(arena, buf, len, WIRE_REQUEST_MAX_BYTES, &out, &rid, why, sizeof(why));
                free(buf);
                if (r != -EPROTO || !strstr(why, "not a request"))
                        fail_msg("%s as a request: %d (%s)", wire_body_name(env.body_case), r, why);
                assert_null(out);
                assert_int_equal(rid, env.request_id); /* answered under its own id */
        }
        /* a request still passes, and a reply still decodes as a reply */
        struct hello_fx h;
        hello_fx_init(&h);
        size_t len;
        uint8_t *buf = pack_env(&h.env, &len);
        Kvc__Envelope *out = NULL;
        uint64_t rid = 0;
        assert_int_equal(wire_decode_request(arena, buf, len, WIRE_REQUEST_MAX_BYTES, &out, &rid, NULL, 0), 0);
        free(buf);
        welcome_fx_init(&f);
        round_trip(&f.env);
}

static void wire_round_trips_open_session(void **state) {
        struct open_fx f;
        (void)state;
        open_fx_init(&f);
        Kvc__OpenSession *m = round_trip(&f.env)->open_session;
        assert_non_null(m->geometry);
        assert_int_equal(m->geometry->n_layers, 32);
        assert_int_equal(m->geometry->n_heads, 32);
        assert_int_equal(m->geometry->n_kv_heads, 8);
        assert_int_equal(m->geometry->head_dim, 128);
        assert_int_equal(m->geometry->dtype, KVC__DTYPE__DTYPE_BF16);
        assert_int_equal(m->geometry->max_tokens, 8192);
        assert_string_equal(m->policy, "window");
        assert_int_equal(m->budget_tokens, 1024);
        assert_int_equal(m->n_params, 2);
        assert_string_equal(m->params[0]->key, "ema_gamma");
        assert_int_equal(m->params[0]->value_case, KVC__PARAM__VALUE_NUMBER);
        assert_true(m->params[0]->number == 0.95);
        assert_string_equal(m->params[1]->key, "mode");
        assert_int_equal(m->params[1]->value_case, KVC__PARAM__VALUE_TEXT);
        assert_string_equal(m->params[1]->text, "per_head");
        assert_string_equal(m->tenant, "team-a");
}

static void wire_round_trips_session_opened(void **state) {
        struct opened_fx f;
        (void)state;
        opened_fx_init(&f);
        Kvc__SessionOpened *m = round_trip(&f.env)->session_opened;
        assert_int_equal(m->session_id, 99);
        assert_int_equal(m->token.len, WIRE_TOKEN_BYTES);
        assert_memory_equal(m->token.data, token_bytes, WIRE_TOKEN_BYTES);
        assert_int_equal(m->block_bytes, f.m.block_bytes);
        assert_int_equal(m->block_tokens, 16);
        assert_int_equal(m->plan_offset, 3ull << 21);
        assert_int_equal(m->plan_bytes, 4096);
        assert_true(m->ema_gamma == 0.9f);
        assert_int_equal(m->max_layer_tokens, 1040);
        assert_string_equal(m->policy, "window");
        assert_int_equal(m->budget_tokens, 1024);
}

static void wire_round_trips_reserve(void **state) {
        struct reserve_fx f;
        (void)state;
        reserve_fx_init(&f);
        Kvc__Reserve *m = round_trip(&f.env)->reserve;
        assert_int_equal(m->session_id, 99);
        assert_int_equal(m->n_tokens, 517);
}

static void assert_layer_blocks_equal(Kvc__LayerBlocks *const *got, Kvc__LayerBlocks *const *want, size_t n) {
        for (size_t l = 0; l < n; l++) {
                assert_int_equal(got[l]->layer, want[l]->layer);
                assert_int_equal(got[l]->n_blocks, want[l]->n_blocks);
                assert_memory_equal(got[l]->blocks, want[l]->blocks, want[l]->n_blocks * sizeof(uint64_t));
        }
}

static void wire_round_trips_grant(void **state) {
        struct grant_fx f;
        (void)state;
        grant_fx_init(&f);
        Kvc__Grant *m = round_trip(&f.env)->grant;
        assert_int_equal(m->session_id, 99);
        assert_int_equal(m->n_layers, FX_LAYERS);
        assert_layer_blocks_equal(m->layers, f.m.layers, FX_LAYERS);
}

static void wire_round_trips_step_batch(void **state) {
        struct steps_fx f;
        (void)state;
        steps_fx_init(&f);
        Kvc__StepBatch *m = round_trip(&f.env)->step_batch;
        assert_int_equal(m->n_steps, FX_STEPS);
        for (size_t i = 0; i < FX_STEPS; i++) {
                const Kvc__Step *got = m->steps[i], *want = &f.steps[i];
                assert_int_equal(got->session_id, want->session_id);
                assert_int_equal(got->step, want->step);
                assert_int_equal(got->phase, want->phase);
                assert_int_equal(got->n_layer_tokens, FX_LAYERS);
                assert_memory_equal(got->layer_tokens, want->layer_tokens, FX_LAYERS * sizeof(uint32_t));
                assert_true(got->entropy == want->entropy);
                assert_true(got->top1_prob == want->top1_prob);
                assert_true(got->margin == want->margin);
                assert_int_equal(got->n_topk_logprobs, 4);
                assert_memory_equal(got->topk_logprobs, want->topk_logprobs, 4 * sizeof(float));
        }
}

static void wire_round_trips_plan_batch(void **state) {
        struct plans_fx f;
        (void)state;
        plans_fx_init(&f);
        Kvc__PlanBatch *m = round_trip(&f.env)->plan_batch;
        assert_int_equal(m->n_plans, FX_PLANS);
        for (size_t i = 0; i < FX_PLANS; i++) {
                const Kvc__Plan *got = m->plans[i], *want = &f.plans[i];
                assert_int_equal(got->session_id, want->session_id);
                assert_int_equal(got->plan_id, want->plan_id);
                assert_int_equal(got->base_step, want->base_step);
                assert_int_equal(got->n_layers, FX_LAYERS);
                for (size_t l = 0; l < FX_LAYERS; l++) {
                        assert_int_equal(got->layers[l]->layer, want->layers[l]->layer);
                        assert_int_equal(got->layers[l]->base_tokens, want->layers[l]->base_tokens);
                        assert_int_equal(got->layers[l]->keep_offset, want->layers[l]->keep_offset);
                        assert_int_equal(got->layers[l]->keep_count, want->layers[l]->keep_count);
                        assert_int_equal(!!got->layers[l]->per_head, !!want->layers[l]->per_head);
                }
        }
        assert_int_equal(m->n_grants, 1);
        assert_int_equal(m->grants[0]->session_id, 20);
        assert_int_equal(m->grants[0]->n_layers, 2);
        assert_layer_blocks_equal(m->grants[0]->layers, f.grants[0].layers, 2);
        assert_int_equal(m->n_errors, 1);
        assert_int_equal(m->errors[0]->code, ENOSPC);
        assert_string_equal(m->errors[0]->message, f.errors[0].message);
        assert_int_equal(m->errors[0]->session_id, 12);
}

static void wire_round_trips_plan_applied(void **state) {
        struct applied_fx f;
        (void)state;
        applied_fx_init(&f);
        f.m.status = ESTALE;
        Kvc__PlanApplied *m = round_trip(&f.env)->plan_applied;
        assert_int_equal(m->session_id, 99);
        assert_int_equal(m->plan_id, 500);
        assert_int_equal(m->status, ESTALE);
        assert_int_equal(m->n_layer_tokens, FX_LAYERS);
        assert_memory_equal(m->layer_tokens, f.layer_tokens, FX_LAYERS * sizeof(uint32_t));
        assert_int_equal(m->n_released, FX_LAYERS);
        assert_layer_blocks_equal(m->released, f.m.released, FX_LAYERS);
}

static void wire_round_trips_close_session(void **state) {
        Kvc__Envelope env;
        Kvc__CloseSession m = KVC__CLOSE_SESSION__INIT;
        (void)state;
        m.session_id = 0xfedcba9876543210ull;
        env_init(&env, KVC__ENVELOPE__BODY_CLOSE_SESSION, &m);
        assert_int_equal(round_trip(&env)->close_session->session_id, 0xfedcba9876543210ull);
}

static void wire_round_trips_session_closed(void **state) {
        Kvc__Envelope env;
        Kvc__SessionClosed m = KVC__SESSION_CLOSED__INIT;
        Kvc__SessionStats st = KVC__SESSION_STATS__INIT;
        (void)state;
        st.steps = 1000;
        st.plans = 60;
        st.peak_tokens = 272;
        st.peak_layer_blocks = 17;
        st.peak_bytes = 17ull * 32 * 133632;
        st.bytes = 5ull * 32 * 133632;
        m.session_id = 99;
        m.stats = &st;
        env_init(&env, KVC__ENVELOPE__BODY_SESSION_CLOSED, &m);
        Kvc__SessionClosed *got = round_trip(&env)->session_closed;
        assert_int_equal(got->session_id, 99);
        assert_non_null(got->stats);
        assert_int_equal(got->stats->steps, 1000);
        assert_int_equal(got->stats->plans, 60);
        assert_int_equal(got->stats->peak_tokens, 272);
        assert_int_equal(got->stats->peak_layer_blocks, 17);
        assert_int_equal(got->stats->peak_bytes, st.peak_bytes);
        assert_int_equal(got->stats->bytes, st.bytes);
}

static void wire_round_trips_error(void **state) {
        struct error_fx f;
        (void)state;
        error_fx_init(&f);
        Kvc__Error *m = round_trip(&f.env)->error;
        assert_int_equal(m->code, ESTALE);
        assert_string_equal(m->message, f.m.message);
        assert_int_equal(m->session_id, 99);
}

static void wire_round_trips_status_request(void **state) {
        Kvc__Envelope env;
        Kvc__StatusRequest m = KVC__STATUS_REQUEST__INIT;
        (void)state;
        env_init(&env, KVC__ENVELOPE__BODY_STATUS_REQUEST, &m);
        assert_non_null(round_trip(&env)->status_request);
}

static void wire_round_trips_status(void **state) {
        struct status_fx f;
        (void)state;
        status_fx_init(&f);
        Kvc__Status *m = round_trip(&f.env)->status;
        assert_string_equal(m->version, "kvcd 0.2.0");
        assert_string_equal(m->backend, "host");
        assert_int_equal(m->uptime_usec, 123456789);
        assert_int_equal(m->capacity_bytes, 8ull << 30);
        assert_int_equal(m->used_bytes, 3ull << 29);
        assert_int_equal(m->chunk_bytes, 2u << 20);
        assert_int_equal(m->chunks_total, 4096);
        assert_int_equal(m->chunks_in_use, 800);
        assert_int_equal(m->clients, 3);
        assert_int_equal(m->sessions, 5);
        assert_int_equal(m->steps_total, 1000000);
        assert_int_equal(m->plans_total, 3900);
        assert_int_equal(m->rss_bytes, 40u << 20);
        assert_int_equal(m->rss_anon_bytes, 3u << 20);
        assert_int_equal(m->step_batches_total, 250000);
        assert_int_equal(m->n_tenants, 2);
        assert_string_equal(m->tenants[1]->name, "search");
        assert_int_equal(m->tenants[1]->used_bytes, 2u << 20);
        assert_int_equal(m->tenants[1]->quota_bytes, 1ull << 30);
        assert_int_equal(m->tenants[1]->sessions, 3);
        assert_int_equal(m->client_deaths, 1);
        assert_int_equal(m->errors_total, 17);
}

static void wire_round_trips_list_sessions(void **state) {
        Kvc__Envelope env;
        Kvc__ListSessions m = KVC__LIST_SESSIONS__INIT;
        (void)state;
        env_init(&env, KVC__ENVELOPE__BODY_LIST_SESSIONS, &m);
        assert_non_null(round_trip(&env)->list_sessions);
}

static void wire_round_trips_session_list(void **state) {
        struct list_fx f;
        (void)state;
        list_fx_init(&f);
        Kvc__SessionList *m = round_trip(&f.env)->session_list;
        assert_int_equal(m->n_sessions, FX_SESSIONS);
        for (size_t i = 0; i < FX_SESSIONS; i++) {
                const Kvc__SessionInfo *got = m->sessions[i], *want = &f.info[i];
                assert_int_equal(got->session_id, want->session_id);
                assert_int_equal(got->pid, want->pid);
                assert_int_equal(got->uid, want->uid);
                assert_string_equal(got->tenant, want->tenant);
                assert_string_equal(got->policy, want->policy);
                assert_int_equal(got->budget_tokens, want->budget_tokens);
                assert_int_equal(got->tokens, want->tokens);
                assert_int_equal(got->blocks, want->blocks);
                assert_int_equal(got->bytes, want->bytes);
                assert_true(got->confidence == want->confidence);
                assert_int_equal(got->steps, want->steps);
                assert_int_equal(got->plans, want->plans);
                assert_int_equal(got->age_usec, want->age_usec);
                assert_int_equal(got->peak_tokens, want->peak_tokens);
                assert_int_equal(got->n_layers, want->n_layers);
        }
}

/* The arena is reset by each decode: decoding many messages in turn neither fails nor grows. */
static void wire_decodes_message_after_message_in_one_arena(void **state) {
        struct steps_fx *f = malloc(sizeof(*f));
        struct wire_arena *small;
        size_t len;
        (void)state;
        assert_non_null(f);
        steps_fx_init(f);
        uint8_t *buf = pack_env(&f->env, &len);
        assert_int_equal(wire_arena_new(16384, &small), 0);
        for (int i = 0; i < 1000; i++) {
                Kvc__Envelope *e = NULL;
                assert_int_equal(wire_decode(small, buf, len, WIRE_REQUEST_MAX_BYTES, &e, NULL, 0), 0);
                assert_int_equal(e->step_batch->n_steps, FX_STEPS);
        }
        small = wire_arena_free(small);
        assert_null(small);
        free(buf);
        free(f);
}

/* ---- framing and envelope ---- */

static void wire_rejects_frame_over_max_bytes(void **state) {
        struct hello_fx f;
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope *e = NULL;
        size_t len;
        (void)state;
        hello_fx_init(&f);
        uint8_t *buf = pack_env(&f.env, &len);

        assert_int_equal(wire_decode(arena, buf, len, len - 1, &e, why, sizeof(why)), -EMSGSIZE);
        assert_null(e);
        assert_non_null(strstr(why, "exceeds"));
        /* exactly at the cap is fine */
        assert_int_equal(wire_decode(arena, buf, len, len, &e, why, sizeof(why)), 0);
        assert_non_null(e);
        free(buf);

        /* a frame one byte over the request cap is refused before it is parsed */
        uint8_t *big = calloc(1, WIRE_REQUEST_MAX_BYTES + 1);
        assert_non_null(big);
        e = NULL;
        why[0] = '\0';
        assert_int_equal(wire_decode(arena, big, WIRE_REQUEST_MAX_BYTES + 1, WIRE_REQUEST_MAX_BYTES, &e, why,
                                     sizeof(why)),
                         -EMSGSIZE);
        assert_null(e);
        assert_true(why[0] != '\0');
        free(big);
}

static void expect_decode_fails(const void *data, size_t len, int code, const char *word) {
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope *e = NULL;
        int r = wire_decode(arena, data, len, WIRE_REQUEST_MAX_BYTES, &e, why, sizeof(why));

        if (r != code || e != NULL || !strstr(why, word))
                fail_msg("decoding %zu bytes gave %d (%s), want %d mentioning '%s'", len, r, why, code, word);
}

static void wire_rejects_bytes_that_are_not_an_envelope(void **state) {
        static const uint8_t bad_wire_type[] = { 0x0f, 0x01 }; /* field 1, wire type 7 */
        static const uint8_t cut_varint[] = { 0x08, 0x81 };    /* varint that never ends */
        static const uint8_t cut_body[] = {
                0x08, 0x01, 0x82, 0x01, 0x05, 0x0a
        }; /* hello of 5 bytes, 1 sent */
        static const uint8_t long_varint[] = { 0x08, 0xff, 0xff, 0xff, 0xff, 0xff,
                                               0xff, 0xff, 0xff, 0xff, 0xff, 0x01 };
        static const uint8_t text[] = "GET / HTTP/1.1\r\nHost: kvcd\r\n\r\n";
        struct hello_fx f;
        size_t len;
        (void)state;

        expect_decode_fails(bad_wire_type, sizeof(bad_wire_type), -EPROTO, "not a kvc envelope");
        expect_decode_fails(cut_varint, sizeof(cut_varint), -EPROTO, "not a kvc envelope");
        expect_decode_fails(cut_body, sizeof(cut_body), -EPROTO, "not a kvc envelope");
        expect_decode_fails(long_varint, sizeof(long_varint), -EPROTO, "not a kvc envelope");
        expect_decode_fails(text, sizeof(text) - 1, -EPROTO, "not a kvc envelope");

        /* a valid frame cut short */
        hello_fx_init(&f);
        uint8_t *buf = pack_env(&f.env, &len);
        expect_decode_fails(buf, len - 1, -EPROTO, "not a kvc envelope");
        free(buf);
}

static void wire_rejects_wrong_version(void **state) {
        struct hello_fx f;
        (void)state;
        hello_fx_init(&f);
        f.env.version = 2;
        EXPECT_REJECT(&f.env, -EPROTO, "version 2");
        f.env.version = 0;
        EXPECT_REJECT(&f.env, -EPROTO, "version 0");
        f.env.version = UINT32_MAX;
        EXPECT_REJECT(&f.env, -EPROTO, "version");
}

static void wire_rejects_envelope_without_body(void **state) {
        static const uint8_t only_version[] = { 0x08, 0x01, 0x10, 0x07 };
        static const uint8_t empty[1] = { 0 };
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        (void)state;

        env.version = WIRE_VERSION;
        EXPECT_REJECT(&env, -EPROTO, "unknown message kind 0");
        expect_decode_fails(only_version, sizeof(only_version), -EPROTO, "unknown message kind");
        /* an empty frame is an envelope of version 0 */
        expect_decode_fails(empty, 0, -EPROTO, "version 0");
}

static void wire_rejects_unknown_body(void **state) {
        /* version 1, then field 99 (length-delimited, 2 bytes): protobuf-c skips it */
        static const uint8_t unknown_field[] = { 0x08, 0x01, 0x9a, 0x06, 0x02, 0x08, 0x01 };
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        Kvc__Hello m = KVC__HELLO__INIT;
        char why[WIRE_MAX_MESSAGE] = "";
        (void)state;

        expect_decode_fails(unknown_field, sizeof(unknown_field), -EPROTO, "unknown message kind");
        /* a body case no row of the table knows */
        env_init(&env, (Kvc__Envelope__BodyCase)99, &m);
        assert_int_equal(wire_validate(&env, why, sizeof(why)), -EPROTO);
        assert_non_null(strstr(why, "unknown message kind 99"));
}

static void wire_rejects_body_case_without_message(void **state) {
        Kvc__Envelope env;
        char why[WIRE_MAX_MESSAGE] = "";
        (void)state;
        env_init(&env, KVC__ENVELOPE__BODY_STEP_BATCH, NULL);
        assert_int_equal(wire_validate(&env, why, sizeof(why)), -EPROTO);
        assert_non_null(strstr(why, "empty step_batch"));
}

/* A message whose many small elements outgrow a small arena. */
static void wire_rejects_message_that_exhausts_a_tiny_arena(void **state) {
        struct steps_fx *f = malloc(sizeof(*f));
        struct wire_arena *tiny;
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope *e = NULL;
        size_t len;
        (void)state;

        assert_non_null(f);
        steps_fx_init(f);
        f->m.n_steps = 200;
        uint8_t *buf = pack_env(&f->env, &len);
        assert_true(len <= WIRE_REQUEST_MAX_BYTES);
        assert_int_equal(wire_arena_new(2048, &tiny), 0);
        assert_int_equal(wire_decode(tiny, buf, len, WIRE_REQUEST_MAX_BYTES, &e, why, sizeof(why)),
                         -EMSGSIZE);
        assert_null(e);
        assert_non_null(strstr(why, "unpack"));
        wire_arena_free(tiny);
        free(buf);
        free(f);
}

/* One repeated field whose array alone is larger than the arena: the allocation that fails is a
 * big one made while the arena is still nearly empty. */
static void wire_rejects_message_whose_array_exceeds_the_arena(void **state) {
        enum { N_BLOCKS = 20000 };
        struct grant_fx f;
        struct wire_arena *small;
        uint64_t *offs = calloc(N_BLOCKS, sizeof(*offs));
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope *e = NULL;
        size_t len;
        (void)state;

        assert_non_null(offs);
        for (uint32_t i = 0; i < N_BLOCKS; i++)
                offs[i] = i % 100; /* one byte each on the wire, 8 in memory */
        grant_fx_init(&f);
        f.m.n_layers = 1;
        f.b.lb[0].n_blocks = N_BLOCKS;
        f.b.lb[0].blocks = offs;
        uint8_t *buf = pack_env(&f.env, &len);
        assert_true(len <= WIRE_REQUEST_MAX_BYTES);
        assert_int_equal(wire_arena_new(64 * 1024, &small), 0);
        assert_int_equal(wire_decode(small, buf, len, WIRE_REQUEST_MAX_BYTES, &e, why, sizeof(why)),
                         -EMSGSIZE);
        assert_null(e);
        assert_non_null(strstr(why, "unpack"));

        /* and the arena still serves a message that fits */
        struct reserve_fx r;
        reserve_fx_init(&r);
        free(buf);
        buf = pack_env(&r.env, &len);
        assert_int_equal(wire_decode(small, buf, len, WIRE_REQUEST_MAX_BYTES, &e, why, sizeof(why)), 0);
        assert_int_equal(e->reserve->n_tokens, 517);
        wire_arena_free(small);
        free(buf);
        free(offs);
}

/* Garbage is a protocol error whatever the arena's size, as long as the envelope itself fits. */
static void wire_reports_garbage_as_eproto_in_a_small_arena(void **state) {
        static const uint8_t bad_wire_type[] = { 0x08, 0x01, 0x0f, 0x01 };
        struct wire_arena *small;
        char why[WIRE_MAX_MESSAGE] = "";
        Kvc__Envelope *e = NULL;
        (void)state;
        assert_int_equal(wire_arena_new(1024, &small), 0);
        assert_int_equal(wire_decode(small, bad_wire_type, sizeof(bad_wire_type), WIRE_REQUEST_MAX_BYTES, &e,
                                     why, sizeof(why)),
                         -EPROTO);
        assert_null(e);
        wire_arena_free(small);
}

static void wire_truncates_why_to_its_buffer(void **state) {
        struct reserve_fx f;
        char why[8];
        (void)state;
        reserve_fx_init(&f);
        f.m.session_id = 0;
        memset(why, 'x', sizeof(why));
        assert_int_equal(wire_validate(&f.env, why, sizeof(why)), -EINVAL);
        assert_int_equal(strlen(why), sizeof(why) - 1);
        /* and no buffer at all is fine */
        assert_int_equal(wire_validate(&f.env, NULL, 0), -EINVAL);
}

/* ---- validators, one field at a time ---- */

#define REJECT(type, mutation, word)                                                                         \
        do {                                                                                                 \
                struct type##_fx *f_ = calloc(1, sizeof(*f_));                                               \
                assert_non_null(f_);                                                                         \
                type##_fx_init(f_);                                                                          \
                {                                                                                            \
                        struct type##_fx *f = f_;                                                            \
                        mutation;                                                                            \
                        EXPECT_REJECT(&f->env, -EINVAL, word);                                               \
                }                                                                                            \
                free(f_);                                                                                    \
        } while (0)

#define ACCEPT(type, mutation)                                                                               \
        do {                                                                                                 \
                struct type##_fx *f_ = calloc(1, sizeof(*f_));                                               \
                assert_non_null(f_);                                                                         \
                type##_fx_init(f_);                                                                          \
                {                                                                                            \
                        struct type##_fx *f = f_;                                                            \
                        mutation;                                                                            \
                        EXPECT_VALID(&f->env);                                                               \
                }                                                                                            \
                free(f_);                                                                                    \
        } while (0)

static void wire_rejects_bad_hello(void **state) {
        (void)state;
        REJECT(hello, f->m.token.len = WIRE_TOKEN_BYTES - 1, "token has 15 bytes");
        REJECT(hello, f->m.token.len = WIRE_TOKEN_BYTES + 1, "token has 17 bytes");
        REJECT(hello, (f->m.token.len = 0, f->m.token.data = NULL), "token has 0 bytes");
        REJECT(hello, f->m.client_name = repeat('n', WIRE_MAX_NAME + 1), "client name longer");
        REJECT(hello, f->m.client_name = "tab\there", "client name has a control character");
        REJECT(hello, f->m.client_name = "del\x7f", "client name has a control character");
        ACCEPT(hello, f->m.client_name = repeat('n', WIRE_MAX_NAME));
        ACCEPT(hello, f->m.client_name = "");
}

static void wire_rejects_bad_welcome(void **state) {
        (void)state;
        REJECT(welcome, f->m.chunk_bytes = 0, "chunk size");
        REJECT(welcome, f->m.chunk_bytes = 4096 * 3 + 1, "chunk size");
        REJECT(welcome, (f->m.chunk_bytes = (1ull << 32) + 4096, f->m.pool_bytes = f->m.chunk_bytes),
               "chunk size");
        REJECT(welcome, f->m.pool_bytes = 0, "pool size");
        REJECT(welcome, f->m.pool_bytes = (3u << 20), "pool size");
        REJECT(welcome, f->m.pool_bytes = (1ull << 46) + (2u << 20), "pool size");
        REJECT(welcome, f->m.block_tokens = 0, "block_tokens");
        REJECT(welcome, f->m.block_tokens = WIRE_MAX_BLOCK_TOKENS + 1, "block_tokens");
        REJECT(welcome, f->m.backend = repeat('b', WIRE_MAX_NAME + 1), "backend");
        REJECT(welcome, f->m.daemon_version = "0.1\n", "version");
        ACCEPT(welcome, (f->m.chunk_bytes = 1ull << 32, f->m.pool_bytes = 1ull << 46,
                         f->m.block_tokens = WIRE_MAX_BLOCK_TOKENS));
}

static void wire_rejects_bad_geometry(void **state) {
        (void)state;
        REJECT(open, f->m.geometry = NULL, "geometry missing");
        REJECT(open, f->g.n_layers = 0, "n_layers 0");
        REJECT(open, f->g.n_layers = WIRE_MAX_LAYERS + 1, "n_layers");
        REJECT(open, f->g.n_heads = 0, "n_heads 0");
        REJECT(open, (f->g.n_heads = 1u << 31, f->g.n_kv_heads = 1), "n_heads 2147483648");
        REJECT(open, (f->g.n_heads = WIRE_MAX_HEADS + 1, f->g.n_kv_heads = 1), "n_heads");
        REJECT(open, f->g.n_kv_heads = 0, "n_kv_heads 0");
        REJECT(open, (f->g.n_heads = 2 * (WIRE_MAX_KV_HEADS + 1), f->g.n_kv_heads = WIRE_MAX_KV_HEADS + 1),
               "n_kv_heads");
        REJECT(open, f->g.n_kv_heads = 3, "does not divide");
        REJECT(open, (f->g.n_heads = 4, f->g.n_kv_heads = 8), "does not divide");
        REJECT(open, f->g.head_dim = 0, "head_dim 0");
        REJECT(open, f->g.head_dim = WIRE_MAX_HEAD_DIM + 1, "head_dim");
        REJECT(open, f->g.dtype = KVC__DTYPE__DTYPE_UNSPECIFIED, "dtype 0");
        REJECT(open, f->g.dtype = (Kvc__Dtype)4, "dtype 4");
        REJECT(open, f->g.dtype = (Kvc__Dtype)-1, "dtype -1");
        REJECT(open, f->g.max_tokens = 0, "max_tokens 0");
        REJECT(open, f->g.max_tokens = WIRE_MAX_TOKENS + 1, "max_tokens");
        ACCEPT(open, (f->g.n_layers = WIRE_MAX_LAYERS, f->g.n_heads = WIRE_MAX_HEADS,
                      f->g.n_kv_heads = WIRE_MAX_KV_HEADS, f->g.head_dim = WIRE_MAX_HEAD_DIM,
                      f->g.dtype = KVC__DTYPE__DTYPE_F32, f->g.max_tokens = WIRE_MAX_TOKENS));
        ACCEPT(open, (f->g.n_layers = 1, f->g.n_heads = 1, f->g.n_kv_heads = 1, f->g.head_dim = 1,
                      f->g.dtype = KVC__DTYPE__DTYPE_F16, f->g.max_tokens = 1));
}

static void wire_rejects_bad_open_session(void **state) {
        (void)state;
        REJECT(open, f->m.policy = "", "policy is empty");
        REJECT(open, f->m.policy = "win dow", "policy has a byte 0x20");
        REJECT(open, f->m.policy = "win\"dow", "policy has a byte 0x22");
        REJECT(open, f->m.policy = "win\\dow", "policy has a byte 0x5c");
        REJECT(open, f->m.policy = "win\x7f", "policy has a byte 0x7f");
        REJECT(open, f->m.policy = "caf\xc3\xa9", "policy has a byte 0xc3");
        REJECT(open, f->m.policy = repeat('w', WIRE_MAX_NAME + 1), "policy longer");
        REJECT(open, f->m.budget_tokens = WIRE_MAX_TOKENS + 1, "budget");
        REJECT(open, f->m.n_params = WIRE_MAX_PARAMS + 1, "33 params");
        REJECT(open, f->params[1].key = "", "param key is empty");
        REJECT(open, f->params[1].key = "a key", "param key has a byte");
        REJECT(open, f->params[1].value_case = KVC__PARAM__VALUE__NOT_SET, "param mode has no value");
        REJECT(open, f->params[0].number = NAN, "param ema_gamma is not a finite number");
        REJECT(open, f->params[0].number = INFINITY, "param ema_gamma is not a finite number");
        REJECT(open, f->params[0].number = -INFINITY, "param ema_gamma is not a finite number");
        REJECT(open, f->params[1].text = "", "param text is empty");
        REJECT(open, f->params[1].text = "per head", "param text has a byte 0x20");
        REJECT(open, f->params[1].text = repeat('t', WIRE_MAX_NAME + 1), "param text longer");
        REJECT(open, f->m.tenant = "team a", "tenant has a byte 0x20");
        REJECT(open, f->m.tenant = repeat('t', WIRE_MAX_NAME + 1), "tenant longer");
        ACCEPT(open, f->m.tenant = "");
        ACCEPT(open, f->m.n_params = 0);
        ACCEPT(open, f->m.n_params = WIRE_MAX_PARAMS);
        ACCEPT(open, (f->m.budget_tokens = WIRE_MAX_TOKENS, f->m.policy = repeat('w', WIRE_MAX_NAME)));
        ACCEPT(open, f->params[0].number = -1e300);
}

static void wire_rejects_bad_session_opened(void **state) {
        (void)state;
        REJECT(opened, f->m.session_id = 0, "session id 0");
        REJECT(opened, f->m.token.len = 8, "session token has 8 bytes");
        REJECT(opened, f->m.block_bytes = 0, "block_bytes 0");
        REJECT(opened, f->m.block_bytes = (1ull << 32) + 64, "block_bytes");
        REJECT(opened, f->m.block_tokens = 0, "block_tokens 0");
        REJECT(opened, f->m.block_tokens = WIRE_MAX_BLOCK_TOKENS + 1, "block_tokens");
        REJECT(opened, f->m.plan_bytes = 4094, "plan buffer size 4094");
        REJECT(opened, f->m.plan_bytes = (1ull << 32) + 4, "plan buffer size");
        REJECT(opened, f->m.ema_gamma = NAN, "ema_gamma");
        REJECT(opened, f->m.ema_gamma = -0.01f, "ema_gamma");
        REJECT(opened, f->m.ema_gamma = 1.01f, "ema_gamma");
        REJECT(opened, f->m.ema_gamma = INFINITY, "ema_gamma");
        REJECT(opened, f->m.max_layer_tokens = 0, "max_layer_tokens 0");
        REJECT(opened, f->m.max_layer_tokens = WIRE_MAX_TOKENS + WIRE_MAX_BLOCK_TOKENS + 1,
               "max_layer_tokens");
        REJECT(opened, f->m.budget_tokens = WIRE_MAX_TOKENS + 1, "budget");
        REJECT(opened, f->m.policy = "", "policy is empty");
        REJECT(opened, f->m.policy = "a b", "policy has a byte");
        ACCEPT(opened, (f->m.plan_bytes = 0, f->m.ema_gamma = 0.0f));
        ACCEPT(opened,
               (f->m.ema_gamma = 1.0f, f->m.max_layer_tokens = WIRE_MAX_TOKENS + WIRE_MAX_BLOCK_TOKENS,
                f->m.block_bytes = 1ull << 32, f->m.plan_bytes = 1ull << 32));
}

static void wire_rejects_bad_reserve(void **state) {
        (void)state;
        REJECT(reserve, f->m.session_id = 0, "session id 0");
        REJECT(reserve, f->m.n_tokens = 0, "reserve of 0 tokens");
        REJECT(reserve, f->m.n_tokens = WIRE_MAX_TOKENS + 1, "reserve of");
        ACCEPT(reserve, f->m.n_tokens = WIRE_MAX_TOKENS);
}

static void wire_rejects_bad_grant(void **state) {
        (void)state;
        REJECT(grant, f->m.session_id = 0, "grant for session id 0");
        REJECT(grant, f->m.n_layers = WIRE_MAX_LAYERS + 1, "grant lists 257 layers");
        REJECT(grant, f->b.lb[1].layer = WIRE_MAX_LAYERS, "grant layer 256 out of range");
        ACCEPT(grant, f->m.n_layers = WIRE_MAX_LAYERS);
        ACCEPT(grant, f->m.n_layers = 0);
}

/* The block references of one message are capped as a whole. */
static void wire_rejects_more_block_refs_than_allowed(void **state) {
        uint64_t *offs = calloc(WIRE_MAX_BLOCK_REFS, sizeof(*offs));
        (void)state;
        assert_non_null(offs);
        /* two layers share the array: MAX - 3 + 4 references, one too many */
        REJECT(grant,
               (f->m.n_layers = 2, f->b.lb[0].blocks = offs, f->b.lb[0].n_blocks = WIRE_MAX_BLOCK_REFS - 3),
               "grant lists more than 65536 blocks");
        ACCEPT(grant,
               (f->m.n_layers = 2, f->b.lb[0].blocks = offs, f->b.lb[0].n_blocks = WIRE_MAX_BLOCK_REFS - 4));
        /* in a plan batch the count runs over all of its grants */
        REJECT(plans,
               (f->m.n_grants = 2, f->b.lb[0].blocks = offs, f->b.lb[0].n_blocks = WIRE_MAX_BLOCK_REFS / 2),
               "grant lists more than 65536 blocks");
        REJECT(applied, (f->b.lb[2].blocks = offs, f->b.lb[2].n_blocks = WIRE_MAX_BLOCK_REFS - 7),
               "release lists more than 65536 blocks");
        free(offs);
}

static void wire_rejects_bad_step(void **state) {
        (void)state;
        REJECT(steps, f->m.n_steps = 0, "0 steps");
        REJECT(steps, f->m.n_steps = WIRE_MAX_STEPS + 1, "1025 steps");
        REJECT(steps, f->steps[2].session_id = 0, "step 2: session id 0");
        REJECT(steps, f->steps[1].phase = (Kvc__Phase)2, "step 1: phase 2 unknown");
        REJECT(steps, f->steps[1].phase = (Kvc__Phase)-1, "phase -1 unknown");
        REJECT(steps, f->steps[0].n_layer_tokens = 0, "step 0: no layer lengths");
        REJECT(steps, f->steps[0].n_layer_tokens = WIRE_MAX_LAYERS + 1, "257 layer lengths");
        REJECT(steps, f->layer_tokens[2] = WIRE_MAX_TOKENS + 1, "layer 2 length");
        REJECT(steps, f->steps[0].entropy = NAN, "entropy");
        REJECT(steps, f->steps[0].entropy = INFINITY, "entropy");
        REJECT(steps, f->steps[0].entropy = -INFINITY, "entropy");
        REJECT(steps, f->steps[0].entropy = -0.001f, "entropy");
        REJECT(steps, f->steps[0].entropy = 1.001f, "entropy");
        REJECT(steps, f->steps[0].top1_prob = NAN, "top1_prob");
        REJECT(steps, f->steps[0].top1_prob = INFINITY, "top1_prob");
        REJECT(steps, f->steps[0].top1_prob = -0.5f, "top1_prob");
        REJECT(steps, f->steps[0].top1_prob = 1.5f, "top1_prob");
        REJECT(steps, f->steps[1].margin = -0.001f, "step 1: margin");
        REJECT(steps, f->steps[1].margin = NAN, "margin");
        REJECT(steps, f->steps[1].margin = INFINITY, "margin");
        REJECT(steps, f->steps[1].margin = -INFINITY, "margin");
        REJECT(steps, f->steps[0].n_topk_logprobs = WIRE_MAX_TOPK + 1, "65 top-k entries");
        REJECT(steps, f->topk[3] = 0.001f, "top-k log-probability");
        REJECT(steps, f->topk[3] = NAN, "top-k log-probability");
        REJECT(steps, f->topk[3] = INFINITY, "top-k log-probability");
        REJECT(steps, f->topk[3] = -INFINITY, "top-k log-probability");
        ACCEPT(steps, f->m.n_steps = WIRE_MAX_STEPS);
        ACCEPT(steps, (f->steps[0].entropy = 0.0f, f->steps[0].top1_prob = 1.0f, f->steps[0].margin = 0.0f,
                       f->steps[1].entropy = 1.0f, f->steps[1].top1_prob = 0.0f, f->steps[1].margin = -0.0f,
                       f->steps[2].margin = 3e38f, f->topk[0] = 0.0f, f->topk[1] = -0.0f));
        ACCEPT(steps,
               (f->steps[0].n_topk_logprobs = WIRE_MAX_TOPK, f->steps[0].n_layer_tokens = WIRE_MAX_LAYERS,
                f->layer_tokens[0] = WIRE_MAX_TOKENS, f->layer_tokens[1] = 0));
        ACCEPT(steps, f->steps[0].n_topk_logprobs = 0);
}

static void wire_rejects_bad_plan_batch(void **state) {
        (void)state;
        REJECT(plans, f->m.n_plans = WIRE_MAX_STEPS + 1, "plan batch too long");
        REJECT(plans, f->m.n_grants = WIRE_MAX_STEPS + 1, "plan batch too long");
        REJECT(plans, f->m.n_errors = WIRE_MAX_STEPS + 1, "plan batch too long");
        REJECT(plans, f->plans[1].session_id = 0, "plan 1: zero id");
        REJECT(plans, f->plans[1].plan_id = 0, "plan 1: zero id");
        ACCEPT(plans, (f->plans[0].n_layers = 0, f->plans[0].n_moves = 0)); /* ends a demotion's links */
        static uint32_t tiers[WIRE_MAX_TIERS + 1] = { 1, 1, 1, 1, 1 };
        REJECT(plans, (f->lp[0].n_tier_tokens = WIRE_MAX_TIERS + 1, f->lp[0].tier_tokens = tiers),
               "layer entry 0 out of range");
        REJECT(plans, f->plans[0].n_layers = WIRE_MAX_LAYERS + 1, "plan 0: 257 layers");
        REJECT(plans, f->lp[2].layer = WIRE_MAX_LAYERS, "layer entry 2 out of range");
        REJECT(plans, (f->lp[1].base_tokens = WIRE_MAX_TOKENS + 1, f->lp[1].keep_count = 1),
               "layer entry 1 out of range");
        REJECT(plans, f->lp[0].keep_count = f->lp[0].base_tokens + 1, "layer entry 0 out of range");
        REJECT(plans, f->grants[0].session_id = 0, "grant for session id 0");
        REJECT(plans, f->b.lb[1].layer = WIRE_MAX_LAYERS + 5, "grant layer 261");
        REJECT(plans, f->errors[0].code = 0, "error code 0");
        REJECT(plans, f->errors[0].code = -EINVAL, "error code -22");
        REJECT(plans, f->errors[0].code = WIRE_MAX_ERRNO + 1, "error code 4096");
        REJECT(plans, f->errors[0].message = "line\nbreak", "error message has a control character");
        REJECT(plans, f->errors[0].message = repeat('m', WIRE_MAX_MESSAGE + 1), "error message longer");
        ACCEPT(plans, (f->m.n_plans = 0, f->m.n_grants = 0, f->m.n_errors = 0));
        ACCEPT(plans, (f->m.n_plans = WIRE_MAX_STEPS, f->m.n_grants = WIRE_MAX_STEPS / 8,
                       f->m.n_errors = WIRE_MAX_STEPS));
        ACCEPT(plans,
               (f->lp[0].keep_count = 0, f->lp[1].keep_count = f->lp[1].base_tokens = WIRE_MAX_TOKENS,
                f->errors[0].code = WIRE_MAX_ERRNO, f->errors[0].message = repeat('m', WIRE_MAX_MESSAGE)));
}

static void wire_rejects_bad_plan_applied(void **state) {
        (void)state;
        REJECT(applied, f->m.session_id = 0, "zero id");
        REJECT(applied, f->m.plan_id = 0, "zero id");
        REJECT(applied, f->m.status = -1, "status -1");
        REJECT(applied, f->m.status = WIRE_MAX_ERRNO + 1, "status 4096");
        REJECT(applied, f->m.n_layer_tokens = WIRE_MAX_LAYERS + 1, "257 layer lengths");
        REJECT(applied, f->layer_tokens[0] = WIRE_MAX_TOKENS + 1, "layer 0 length");
        REJECT(applied, f->m.n_released = WIRE_MAX_LAYERS + 1, "release lists 257 layers");
        REJECT(applied, f->b.lb[0].layer = WIRE_MAX_LAYERS, "release layer 256");
        ACCEPT(applied, (f->m.status = WIRE_MAX_ERRNO, f->m.n_layer_tokens = 0, f->m.n_released = 0));
}

static void wire_rejects_zero_session_ids(void **state) {
        Kvc__Envelope env;
        Kvc__CloseSession close = KVC__CLOSE_SESSION__INIT;
        Kvc__SessionClosed closed = KVC__SESSION_CLOSED__INIT;
        (void)state;

        env_init(&env, KVC__ENVELOPE__BODY_CLOSE_SESSION, &close);
        EXPECT_REJECT(&env, -EINVAL, "session id 0");
        close.session_id = 1;
        EXPECT_VALID(&env);
        env_init(&env, KVC__ENVELOPE__BODY_SESSION_CLOSED, &closed);
        EXPECT_REJECT(&env, -EINVAL, "session id 0");
        closed.session_id = UINT64_MAX;
        EXPECT_VALID(&env);
}

static void wire_rejects_bad_error(void **state) {
        (void)state;
        REJECT(error, f->m.code = 0, "error code 0");
        REJECT(error, f->m.code = -ENOENT, "error code -2");
        REJECT(error, f->m.code = WIRE_MAX_ERRNO + 1, "error code 4096");
        REJECT(error, f->m.message = repeat('m', WIRE_MAX_MESSAGE + 1), "error message longer than 256");
        REJECT(error, f->m.message = "bell\a", "error message has a control character");
        ACCEPT(error, (f->m.code = 1, f->m.message = "", f->m.session_id = 0));
        ACCEPT(error, f->m.message = "non-ASCII is fine in text: caf\xc3\xa9");
}

static void wire_rejects_bad_status(void **state) {
        (void)state;
        REJECT(status, f->m.version = repeat('v', WIRE_MAX_NAME + 1), "version longer");
        REJECT(status, f->m.version = "esc\x1b[0m", "version has a control character");
        REJECT(status, f->m.backend = repeat('b', WIRE_MAX_NAME + 1), "backend longer");
        REJECT(status, f->m.backend = "ho\rst", "backend has a control character");
        REJECT(status, f->t[1].name = repeat('t', WIRE_MAX_NAME + 1), "tenant longer");
        REJECT(status, f->t[0].name = "te\x1bnant", "tenant has a control character");
        ACCEPT(status, (f->m.version = "", f->m.backend = ""));
        ACCEPT(status, f->m.n_tenants = 0);
}

static void wire_rejects_bad_session_list(void **state) {
        (void)state;
        REJECT(list, f->info[1].tenant = repeat('t', WIRE_MAX_NAME + 1), "tenant longer");
        REJECT(list, f->info[0].tenant = "t\x01", "tenant has a control character");
        REJECT(list, f->info[1].policy = repeat('p', WIRE_MAX_NAME + 1), "policy longer");
        REJECT(list, f->info[0].policy = "p\x7f", "policy has a control character");
        ACCEPT(list, f->m.n_sessions = 0);
}

/* ---- names and the arena ---- */

static void wire_names_every_body_case(void **state) {
        static const struct {
                Kvc__Envelope__BodyCase body;
                const char *name;
        } rows[] = {
                { KVC__ENVELOPE__BODY_HELLO, "hello" },
                { KVC__ENVELOPE__BODY_WELCOME, "welcome" },
                { KVC__ENVELOPE__BODY_OPEN_SESSION, "open_session" },
                { KVC__ENVELOPE__BODY_SESSION_OPENED, "session_opened" },
                { KVC__ENVELOPE__BODY_RESERVE, "reserve" },
                { KVC__ENVELOPE__BODY_GRANT, "grant" },
                { KVC__ENVELOPE__BODY_STEP_BATCH, "step_batch" },
                { KVC__ENVELOPE__BODY_PLAN_BATCH, "plan_batch" },
                { KVC__ENVELOPE__BODY_PLAN_APPLIED, "plan_applied" },
                { KVC__ENVELOPE__BODY_CLOSE_SESSION, "close_session" },
                { KVC__ENVELOPE__BODY_SESSION_CLOSED, "session_closed" },
                { KVC__ENVELOPE__BODY_ERROR, "error" },
                { KVC__ENVELOPE__BODY_STATUS_REQUEST, "status_request" },
                { KVC__ENVELOPE__BODY_STATUS, "status" },
                { KVC__ENVELOPE__BODY_LIST_SESSIONS, "list_sessions" },
                { KVC__ENVELOPE__BODY_SESSION_LIST, "session_list" },
                { KVC__ENVELOPE__BODY_EVICT, "evict" },
                { KVC__ENVELOPE__BODY_DRAIN, "drain" },
                { KVC__ENVELOPE__BODY_DRAINED, "drained" },
                { KVC__ENVELOPE__BODY_AUDIT_REQUEST, "audit_request" },
                { KVC__ENVELOPE__BODY_AUDIT, "audit" },
                { KVC__ENVELOPE__BODY_METRICS_REQUEST, "metrics_request" },
                { KVC__ENVELOPE__BODY_METRICS, "metrics" },
                { KVC__ENVELOPE__BODY_BUDGET_REQUEST, "budget_request" },
                { KVC__ENVELOPE__BODY_BUDGET_SET, "budget_set" },
                { KVC__ENVELOPE__BODY_BUDGETS, "budgets" },
                { KVC__ENVELOPE__BODY_RESUME, "resume" },
                { KVC__ENVELOPE__BODY_RESUMED, "resumed" },
                { KVC__ENVELOPE__BODY_HANDOFF_EXPORT, "handoff_export" },
                { KVC__ENVELOPE__BODY_HANDOFF_TICKET, "handoff_ticket" },
                { KVC__ENVELOPE__BODY_HANDOFF_IMPORT, "handoff_import" },
                { KVC__ENVELOPE__BODY_HANDOFF_IMPORTED, "handoff_imported" },
        };
        (void)state;
        /* every oneof member of the generated descriptor has a row */
        const ProtobufCMessageDescriptor *d = &kvc__envelope__descriptor;
        size_t n_bodies = 0;
        for (unsigned i = 0; i < d->n_fields; i++) {
                if (!(d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF))
                        continue;
                n_bodies++;
                assert_string_not_equal(wire_body_name((Kvc__Envelope__BodyCase)d->fields[i].id), "unknown");
        }
        assert_int_equal(n_bodies, sizeof(rows) / sizeof(rows[0]));
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
                assert_string_equal(wire_body_name(rows[i].body), rows[i].name);
        assert_string_equal(wire_body_name(KVC__ENVELOPE__BODY__NOT_SET), "unknown");
        assert_string_equal(wire_body_name((Kvc__Envelope__BodyCase)99), "unknown");
}

static void wire_names_the_protocol_errnos(void **state) {
        static const struct {
                int code;
                const char *name;
        } rows[] = {
                { EPERM, "EPERM" },         { ENOENT, "ENOENT" },       { EIO, "EIO" },
                { ENOMEM, "ENOMEM" },       { EBUSY, "EBUSY" },         { EEXIST, "EEXIST" },
                { EINVAL, "EINVAL" },       { ENOSPC, "ENOSPC" },       { EPROTO, "EPROTO" },
                { EMSGSIZE, "EMSGSIZE" },   { ESTALE, "ESTALE" },       { EALREADY, "EALREADY" },
                { ETIMEDOUT, "ETIMEDOUT" }, { ENOTCONN, "ENOTCONN" },   { ECONNREFUSED, "ECONNREFUSED" },
                { EAGAIN, "EAGAIN" },       { ENOTSUP, "ENOTSUP" },     { EMFILE, "EMFILE" },
                { ESHUTDOWN, "ESHUTDOWN" }, { EOVERFLOW, "EOVERFLOW" }, { ERANGE, "ERANGE" },
        };
        (void)state;
        for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
                assert_string_equal(wire_errno_name(rows[i].code), rows[i].name);
        assert_string_equal(wire_errno_name(0), "E?");
        assert_string_equal(wire_errno_name(-EINVAL), "E?");
        assert_string_equal(wire_errno_name(ENOEXEC), "E?");
        assert_string_equal(wire_errno_name(WIRE_MAX_ERRNO + 1), "E?");
}

static void wire_arena_hands_out_zeroed_memory_until_exhausted(void **state) {
        struct wire_arena *a;
        (void)state;
        assert_int_equal(wire_arena_new(256, &a), 0);
        uint8_t *p = wire_arena_alloc(a, 200);
        assert_non_null(p);
        for (size_t i = 0; i < 200; i++)
                assert_int_equal(p[i], 0);
        memset(p, 0xff, 200);
        assert_null(wire_arena_alloc(a, 100));
        assert_null(wire_arena_strdup(a, repeat('s', 100)));
        wire_arena_reset(a);
        p = wire_arena_alloc(a, 256);
        assert_non_null(p);
        for (size_t i = 0; i < 256; i++)
                assert_int_equal(p[i], 0);
        assert_null(wire_arena_alloc(a, 1));
        wire_arena_reset(a);
        char *s = wire_arena_strdup(a, "window");
        assert_non_null(s);
        assert_string_equal(s, "window");
        assert_non_null(wire_arena_alloc(a, 0));
        assert_null(wire_arena_alloc(a, SIZE_MAX));
        assert_null(wire_arena_alloc(a, SIZE_MAX - 8));
        assert_null(wire_arena_free(a));
        assert_null(wire_arena_free(NULL));
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(wire_round_trips_hello),
                cmocka_unit_test(wire_round_trips_welcome),
                cmocka_unit_test(wire_refuses_a_reply_kind_as_a_request),
                cmocka_unit_test(wire_round_trips_open_session),
                cmocka_unit_test(wire_round_trips_session_opened),
                cmocka_unit_test(wire_round_trips_reserve),
                cmocka_unit_test(wire_round_trips_grant),
                cmocka_unit_test(wire_round_trips_step_batch),
                cmocka_unit_test(wire_round_trips_plan_batch),
                cmocka_unit_test(wire_round_trips_plan_applied),
                cmocka_unit_test(wire_round_trips_close_session),
                cmocka_unit_test(wire_round_trips_session_closed),
                cmocka_unit_test(wire_round_trips_error),
                cmocka_unit_test(wire_round_trips_status_request),
                cmocka_unit_test(wire_round_trips_status),
                cmocka_unit_test(wire_round_trips_list_sessions),
                cmocka_unit_test(wire_round_trips_session_list),
                cmocka_unit_test(wire_decodes_message_after_message_in_one_arena),
                cmocka_unit_test(wire_rejects_frame_over_max_bytes),
                cmocka_unit_test(wire_rejects_bytes_that_are_not_an_envelope),
                cmocka_unit_test(wire_rejects_wrong_version),
                cmocka_unit_test(wire_rejects_envelope_without_body),
                cmocka_unit_test(wire_rejects_unknown_body),
                cmocka_unit_test(wire_rejects_body_case_without_message),
                cmocka_unit_test(wire_rejects_message_that_exhausts_a_tiny_arena),
                cmocka_unit_test(wire_rejects_message_whose_array_exceeds_the_arena),
                cmocka_unit_test(wire_reports_garbage_as_eproto_in_a_small_arena),
                cmocka_unit_test(wire_truncates_why_to_its_buffer),
                cmocka_unit_test(wire_rejects_bad_hello),
                cmocka_unit_test(wire_rejects_bad_welcome),
                cmocka_unit_test(wire_rejects_bad_geometry),
                cmocka_unit_test(wire_rejects_bad_open_session),
                cmocka_unit_test(wire_rejects_bad_session_opened),
                cmocka_unit_test(wire_rejects_bad_reserve),
                cmocka_unit_test(wire_rejects_bad_grant),
                cmocka_unit_test(wire_rejects_more_block_refs_than_allowed),
                cmocka_unit_test(wire_rejects_bad_step),
                cmocka_unit_test(wire_rejects_bad_plan_batch),
                cmocka_unit_test(wire_rejects_bad_plan_applied),
                cmocka_unit_test(wire_rejects_zero_session_ids),
                cmocka_unit_test(wire_rejects_bad_error),
                cmocka_unit_test(wire_rejects_bad_status),
                cmocka_unit_test(wire_rejects_bad_session_list),
                cmocka_unit_test(wire_names_every_body_case),
                cmocka_unit_test(wire_names_the_protocol_errnos),
                cmocka_unit_test(wire_arena_hands_out_zeroed_memory_until_exhausted),
        };
        return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
