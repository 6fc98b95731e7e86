/* kvc-hello.c: the smallest program a user of libkvc writes, built by test_libkvc against the build
 * tree and against an installed copy (pkg-config): it includes <kvc.h> alone, connects to the kvcd
 * of the runtime directory argv[1], opens a session, reserves 64 tokens, closes, and prints what
 * kvcd charged it ("held N bytes"). Exit 0 when every call succeeded. */
#include <inttypes.h>
#include <stdio.h>

#include <kvc.h>

int main(int argc, char **argv) {
        if (argc != 2) {
                fprintf(stderr, "usage: kvc-hello RUNTIME_DIR\n");
                return 2;
        }
        struct kvc_options o = { .socket = argv[1], .name = "kvc-hello" };
        struct kvc_client *c = NULL;
        struct kvc_session *s = NULL;
        struct kvc_session_stats st = { 0 };
        struct kvc_session_config cfg = {
                .geometry = { .n_layers = 2,
                              .n_heads = 2,
                              .n_kv_heads = 1,
                              .head_dim = 64,
                              .dtype = KVC_DTYPE_F32,
                              .max_tokens = 256 },
                .policy = "window",
                .budget_tokens = 64,
        };
        int r = kvc_connect(&o, &c);
        if (r == 0)
                r = kvc_session_open(c, &cfg, &s);
        if (r == 0)
                r = kvc_session_reserve(s, 64);
        if (r == 0) {
                r = kvc_session_close(s, &st);
                s = NULL;
        }
        if (r < 0) {
                fprintf(stderr, "kvc-hello: %d: %s\n", r, kvc_last_error(c));
                if (s)
                        kvc_session_close(s, NULL);
                kvc_disconnect(c);
                return 1;
        }
        printf("held %" PRIu64 " bytes\n", st.peak_bytes);
        kvc_disconnect(c);
        return 0;
}
