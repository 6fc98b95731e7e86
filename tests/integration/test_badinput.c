/* test_badinput.c: what a careless or hostile client can send kvcd, and what it gets back: an
 * Error with the right code, while a well-behaved client keeps getting exactly its output. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "harness.h"
#include "rawpeer.h"

struct fixture {
        struct daemon d;
        char *baseline; /* a window run's output before any bad input */
};

static char *window_run(const struct daemon *d) {
        const char *argv[] = { harness_bin("kvc-run"),
                               "--socket",
                               d->dir,
                               "--policy",
                               "window",
                               "--budget",
                               "40",
                               "-i",
                               "Lily and Ben went to the park",
                               "-n",
                               "300",
                               "--no-stop",
                               NULL };
        char *out = NULL;
        int st;
        if (harness_run(argv, &out, &st) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
                free(out);
                return NULL;
        }
        return out;
}

static int setup(void **state) {
        struct fixture *f = calloc(1, sizeof(*f));
        if (!f || harness_daemon_start(&f->d, NULL, NULL) < 0)
                return -1;
        f->baseline = window_run(&f->d);
        *state = f;
        return f->baseline ? 0 : -1;
}

static int teardown(void **state) {
        struct fixture *f = *state;
        /* after everything below, a well-behaved client gets exactly what it got before */
        char *again = window_run(&f->d);
        int ok = again && strcmp(again, f->baseline) == 0;
        char *status = harness_kvcctl(&f->d, "status");
        ok = ok && status && harness_json_int(status, "used_bytes") == 0;
        free(status);
        free(again);
        free(f->baseline);
        int st = harness_daemon_stop(&f->d);
        free(f);
        return ok && WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

/* Receives one message and asserts it is an Error with code, answering the request sent last
 * (a refusal under id 0 would leave a client waiting for its timeout), or id 0 where the frame
 * was not a request at all. */
static void expect_error(struct rawpeer *p, int code) {
        Kvc__Envelope *in;
        assert_int_equal(rawpeer_recv(p, 10000, &in), 0);
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_ERROR);
        if (in->request_id != 0)
                assert_int_equal(in->request_id, p->next_id);
        assert_int_equal(in->error->code, code);
        assert_true(strlen(in->error->message) > 0);
}

/* Sends a one-step StepBatch and asserts the PlanBatch answer reports code for that step. */
static void expect_step_error(struct rawpeer *p, Kvc__Step *st, int code) {
        Kvc__Step *sp[1] = { st };
        Kvc__StepBatch sb = KVC__STEP_BATCH__INIT;
        sb.n_steps = 1;
        sb.steps = sp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_STEP_BATCH;
        env.step_batch = &sb;
        assert_int_equal(rawpeer_call(p, &env, &in), 0);
        if (in->body_case == KVC__ENVELOPE__BODY_ERROR) {
                assert_int_equal(in->error->code, code);
                return;
        }
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_PLAN_BATCH);
        assert_int_equal(in->plan_batch->n_errors, 1);
        assert_int_equal(in->plan_batch->errors[0]->code, code);
        assert_int_equal(in->plan_batch->n_plans, 0);
}

static uint32_t zero_lengths[5];

static Kvc__Step step_for(uint64_t session, uint64_t step) {
        Kvc__Step st = KVC__STEP__INIT;
        st.session_id = session;
        st.step = step;
        st.n_layer_tokens = 5;
        st.layer_tokens = zero_lengths;
        st.entropy = 0.5f;
        st.top1_prob = 0.5f;
        st.margin = 1.0f;
        return st;
}

static void garbage_bytes_get_eproto(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        assert_int_equal(rawpeer_open(&p, f->d.dir, false), 0);
        const char junk[] = "\xff\xfe\x00garbage that is no protobuf\x01\x02";
        assert_int_equal(rawpeer_send_bytes(&p, junk, sizeof(junk)), 0);
        expect_error(&p, EPROTO);
        assert_int_equal(rawpeer_send_bytes(&p, "", 0), 0); /* an empty frame: no body */
        expect_error(&p, EPROTO);
        rawpeer_close(&p);
}

static void oversized_frame_gets_emsgsize(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        size_t n = WIRE_REQUEST_MAX_BYTES + 4096;
        char *big = malloc(n);
        assert_non_null(big);
        memset(big, 0x0a, n);
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        assert_int_equal(rawpeer_send_bytes(&p, big, n), 0);
        expect_error(&p, EMSGSIZE);
        free(big);
        rawpeer_close(&p);
}

static void wrong_version_gets_eproto(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        Kvc__StatusRequest sr = KVC__STATUS_REQUEST__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_STATUS_REQUEST;
        env.status_request = &sr;
        env.version = 7;
        size_t len = wire_packed_size(&env);
        uint8_t buf[64];
        wire_pack(&env, buf);
        assert_int_equal(rawpeer_send_bytes(&p, buf, len), 0);
        expect_error(&p, EPROTO);
        rawpeer_close(&p);
}

static void requests_before_hello_get_eperm(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        assert_int_equal(rawpeer_open(&p, f->d.dir, false), 0);
        Kvc__CloseSession cs = KVC__CLOSE_SESSION__INIT;
        cs.session_id = 1;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_CLOSE_SESSION;
        env.close_session = &cs;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, EPERM);
        /* a hello with a token nobody was given */
        Kvc__Hello h = KVC__HELLO__INIT;
        uint8_t fake[WIRE_TOKEN_BYTES] = { 1, 2, 3 };
        h.token.data = fake;
        h.token.len = sizeof(fake);
        env.body_case = KVC__ENVELOPE__BODY_HELLO;
        env.hello = &h;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, EPERM);
        rawpeer_close(&p);
}

static void unknown_session_gets_enoent(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        Kvc__Step st = step_for(987654321, 1);
        expect_step_error(&p, &st, ENOENT);

        Kvc__Reserve rs = KVC__RESERVE__INIT;
        rs.session_id = 987654321;
        rs.n_tokens = 16;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_RESERVE;
        env.reserve = &rs;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, ENOENT);
        rawpeer_close(&p);
}

/* The Error a request naming session sid gets, its message with the id cut out. */
static void error_for_close(struct rawpeer *p, uint64_t sid, int *ret_code, char *msg, size_t len) {
        Kvc__CloseSession cs = KVC__CLOSE_SESSION__INIT;
        cs.session_id = sid;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_CLOSE_SESSION;
        env.close_session = &cs;
        assert_int_equal(rawpeer_call(p, &env, &in), 0);
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_ERROR);
        *ret_code = (int)in->error->code;
        char id[32];
        snprintf(id, sizeof(id), "%llu", (unsigned long long)sid);
        const char *at = strstr(in->error->message, id);
        assert_non_null(at);
        snprintf(msg, len, "%.*s#%s", (int)(at - in->error->message), in->error->message, at + strlen(id));
}

/* Another client's session is answered exactly as a session that does not exist (code and
 * message), so no client learns which ids are open (issue 19, item 6: it was EPERM). */
static void another_clients_session_is_answered_as_a_missing_one(void **state) {
        struct fixture *f = *state;
        struct rawpeer owner, thief;
        uint64_t sid;
        assert_int_equal(rawpeer_open(&owner, f->d.dir, true), 0);
        assert_int_equal(rawpeer_open(&thief, f->d.dir, true), 0);
        assert_int_equal(rawpeer_open_session(&owner, "full", 0, &sid), 0);

        Kvc__Step st = step_for(sid, 1);
        expect_step_error(&thief, &st, ENOENT);
        Kvc__Step none = step_for(sid + 1000000, 1);
        expect_step_error(&thief, &none, ENOENT);

        int foreign_code, missing_code;
        char foreign[256], missing[256];
        error_for_close(&thief, sid, &foreign_code, foreign, sizeof(foreign));
        error_for_close(&thief, sid + 1000000, &missing_code, missing, sizeof(missing));
        assert_int_equal(foreign_code, ENOENT);
        assert_int_equal(missing_code, ENOENT);
        assert_string_equal(foreign, missing);

        /* the owner still has it, and closes it */
        Kvc__CloseSession cs = KVC__CLOSE_SESSION__INIT;
        cs.session_id = sid;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_CLOSE_SESSION;
        env.close_session = &cs;
        assert_int_equal(rawpeer_call(&owner, &env, &in), 0);
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_SESSION_CLOSED);
        rawpeer_close(&thief);
        rawpeer_close(&owner);
}

static void nan_and_infinities_in_a_summary_get_einval(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        uint64_t sid;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        assert_int_equal(rawpeer_open_session(&p, "window", 32, &sid), 0);
        float bad[] = { NAN, INFINITY, -0.5f, 1.5f };
        for (size_t i = 0; i < 4; i++) {
                Kvc__Step st = step_for(sid, 1);
                st.entropy = bad[i];
                expect_step_error(&p, &st, EINVAL); /* the whole batch is refused by validation */
                st = step_for(sid, 1);
                st.margin = i == 0 ? NAN : i == 1 ? INFINITY : -1.0f;
                expect_step_error(&p, &st, EINVAL);
        }
        /* the session is unharmed: a good step is taken */
        Kvc__Step st = step_for(sid, 1);
        Kvc__Step *sp[1] = { &st };
        Kvc__StepBatch sb = KVC__STEP_BATCH__INIT;
        sb.n_steps = 1;
        sb.steps = sp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_STEP_BATCH;
        env.step_batch = &sb;
        assert_int_equal(rawpeer_call(&p, &env, &in), 0);
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_PLAN_BATCH);
        assert_int_equal(in->plan_batch->n_errors, 0);
        rawpeer_close(&p);
}

static void steps_out_of_order_and_overclaimed_lengths_are_refused(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        uint64_t sid;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        assert_int_equal(rawpeer_open_session(&p, "full", 0, &sid), 0);
        Kvc__Step st = step_for(sid, 10);
        Kvc__Step *sp[1] = { &st };
        Kvc__StepBatch sb = KVC__STEP_BATCH__INIT;
        sb.n_steps = 1;
        sb.steps = sp;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        env.body_case = KVC__ENVELOPE__BODY_STEP_BATCH;
        env.step_batch = &sb;
        assert_int_equal(rawpeer_call(&p, &env, &in), 0);
        assert_int_equal(in->plan_batch->n_errors, 0);

        st = step_for(sid, 9);
        expect_step_error(&p, &st, EPROTO); /* back in time */
        st = step_for(sid, 10);
        expect_step_error(&p, &st, EPROTO); /* the same step twice */

        uint32_t lengths[5] = { 100, 0, 0, 0, 0 }; /* tokens in blocks it was never granted */
        st = step_for(sid, 11);
        st.layer_tokens = lengths;
        expect_step_error(&p, &st, EPROTO);

        st = step_for(sid, 12);
        st.n_layer_tokens = 3; /* wrong number of layers */
        expect_step_error(&p, &st, EINVAL);
        rawpeer_close(&p);
}

static void plans_acknowledged_twice_or_unknown_are_refused(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        uint64_t sid;
        Kvc__Envelope env = KVC__ENVELOPE__INIT, *in;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        assert_int_equal(rawpeer_open_session(&p, "window", 32, &sid), 0);

        Kvc__PlanApplied pa = KVC__PLAN_APPLIED__INIT;
        pa.session_id = sid;
        pa.plan_id = 5;
        env.body_case = KVC__ENVELOPE__BODY_PLAN_APPLIED;
        env.plan_applied = &pa;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, ENOENT); /* no such plan */

        /* earn a real plan: room for 48 tokens, then a step that claims them */
        Kvc__Reserve rs = KVC__RESERVE__INIT;
        rs.session_id = sid;
        rs.n_tokens = 48;
        env.body_case = KVC__ENVELOPE__BODY_RESERVE;
        env.reserve = &rs;
        assert_int_equal(rawpeer_call(&p, &env, &in), 0);
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_GRANT);
        uint32_t lengths[5] = { 48, 48, 48, 48, 48 };
        Kvc__Step st = step_for(sid, 1);
        st.layer_tokens = lengths;
        Kvc__Step *sp[1] = { &st };
        Kvc__StepBatch sb = KVC__STEP_BATCH__INIT;
        sb.n_steps = 1;
        sb.steps = sp;
        env.body_case = KVC__ENVELOPE__BODY_STEP_BATCH;
        env.step_batch = &sb;
        assert_int_equal(rawpeer_call(&p, &env, &in), 0);
        assert_int_equal(in->plan_batch->n_plans, 1);
        uint64_t plan_id = in->plan_batch->plans[0]->plan_id;

        /* acknowledge it claiming more tokens than the kept blocks hold: refused, still pending */
        uint32_t too_many[5] = { 49, 32, 32, 32, 32 };
        pa.plan_id = plan_id;
        pa.n_layer_tokens = 5;
        pa.layer_tokens = too_many;
        env.body_case = KVC__ENVELOPE__BODY_PLAN_APPLIED;
        env.plan_applied = &pa;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, EPROTO);

        /* properly, then once more */
        uint32_t kept[5] = { 32, 32, 32, 32, 32 };
        pa.layer_tokens = kept;
        assert_int_equal(rawpeer_send(&p, &env), 0); /* accepted: no answer */
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, EALREADY);
        rawpeer_close(&p);
}

static void admin_requests_on_the_client_socket_are_refused(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        Kvc__ListSessions ls = KVC__LIST_SESSIONS__INIT;
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_LIST_SESSIONS;
        env.list_sessions = &ls;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, EPROTO);
        rawpeer_close(&p);
}

static void bad_geometry_and_unknown_policy_are_refused(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        uint64_t sid;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        assert_int_equal(rawpeer_open_session(&p, "no-such-policy", 0, &sid), -EINVAL);
        Kvc__Geometry g = KVC__GEOMETRY__INIT;
        g.n_layers = 0;
        g.n_heads = 1u << 31;
        g.n_kv_heads = 1;
        g.head_dim = 8;
        g.dtype = KVC__DTYPE__DTYPE_F32;
        g.max_tokens = 512;
        Kvc__OpenSession os = KVC__OPEN_SESSION__INIT;
        os.geometry = &g;
        os.policy = "full";
        Kvc__Envelope env = KVC__ENVELOPE__INIT;
        env.body_case = KVC__ENVELOPE__BODY_OPEN_SESSION;
        env.open_session = &os;
        Kvc__Envelope *in;
        assert_int_equal(rawpeer_call(&p, &env, &in), 0); /* fails validation, answered under its id */
        assert_int_equal(in->body_case, KVC__ENVELOPE__BODY_ERROR);
        assert_int_equal(in->error->code, EINVAL);
        assert_int_equal(in->request_id, p.next_id);
        g.n_layers = 4;
        assert_int_equal(rawpeer_send(&p, &env), 0);
        expect_error(&p, EINVAL);
        rawpeer_close(&p);
}

static void sessions_opened_in_a_loop_are_refused_at_the_limit(void **state) {
        struct fixture *f = *state;
        struct rawpeer p;
        uint64_t sid;
        int r = 0, opened = 0;
        assert_int_equal(rawpeer_open(&p, f->d.dir, true), 0);
        while (opened < 5000 && (r = rawpeer_open_session(&p, "full", 0, &sid)) == 0)
                opened++;
        assert_int_equal(r, -ENOSPC);
        assert_true(opened >= 64);
        rawpeer_close(&p); /* hang-up: kvcd frees them all */
        char *s = harness_kvcctl(&f->d, "status");
        assert_non_null(s);
        assert_int_equal(harness_json_int(s, "sessions"), 0);
        free(s);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(garbage_bytes_get_eproto),
                cmocka_unit_test(oversized_frame_gets_emsgsize),
                cmocka_unit_test(wrong_version_gets_eproto),
                cmocka_unit_test(requests_before_hello_get_eperm),
                cmocka_unit_test(unknown_session_gets_enoent),
                cmocka_unit_test(another_clients_session_is_answered_as_a_missing_one),
                cmocka_unit_test(nan_and_infinities_in_a_summary_get_einval),
                cmocka_unit_test(steps_out_of_order_and_overclaimed_lengths_are_refused),
                cmocka_unit_test(plans_acknowledged_twice_or_unknown_are_refused),
                cmocka_unit_test(admin_requests_on_the_client_socket_are_refused),
                cmocka_unit_test(bad_geometry_and_unknown_policy_are_refused),
                cmocka_unit_test(sessions_opened_in_a_loop_are_refused_at_the_limit),
        };
        return cmocka_run_group_tests(tests, setup, teardown);
}
