/* suite.c: the story suite's configurations and its run (the contract is in suite.h): the
 * parent's side of the workers (fork, poll, add up, progress on stderr) and what it loads first.
 * A worker's side, one story at a time, is story.c's; the report, report.c's.
 */
#include "suite.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lab.h"
#include "report.h"
#include "story.h"

/* "label=policy:budget[:key=value,...]" or "policy:budget[:...]" */
static int parse_config(const char *spec, struct config *c) {
        char buf[256];
        snprintf(buf, sizeof(buf), "%s", spec);
        memset(c, 0, sizeof(*c));
        char *body = buf, *eq = strchr(buf, '=');
        char *colon = strchr(buf, ':');
        if (eq && (!colon || eq < colon)) {
                *eq = '\0';
                snprintf(c->label, sizeof(c->label), "%s", buf);
                body = eq + 1;
        }
        char *save = NULL, *policy = strtok_r(body, ":", &save), *budget = strtok_r(NULL, ":", &save);
        char *params = strtok_r(NULL, ":", &save);
        if (!policy)
                return -EINVAL;
        snprintf(c->policy, sizeof(c->policy), "%s", policy);
        c->budget = budget ? (uint32_t)strtoul(budget, NULL, 10) : 0;
        for (char *kv = params ? strtok_r(params, ",", &save) : NULL; kv; kv = strtok_r(NULL, ",", &save)) {
                char *e = strchr(kv, '=');
                if (!e || c->n_params >= MAX_CONFIG_PARAMS)
                        return -EINVAL;
                *e = '\0';
                snprintf(c->param_text[c->n_params][0], 48, "%s", kv);
                snprintf(c->param_text[c->n_params][1], 48, "%s", e + 1);
                c->n_params++;
        }
        for (size_t i = 0; i < c->n_params; i++)
                c->params[i] = (struct kvc_param){ .key = c->param_text[i][0], .value = c->param_text[i][1] };
        if (!c->label[0]) {
                int n = snprintf(c->label, sizeof(c->label), "%s-%u", c->policy, c->budget);
                snprintf(c->family, sizeof(c->family), "%s", c->policy);
                for (size_t i = 0; i < c->n_params && n > 0 && (size_t)n < sizeof(c->label); i++)
                        n += snprintf(c->label + n, sizeof(c->label) - (size_t)n, ",%s=%s",
                                      c->param_text[i][0], c->param_text[i][1]);
        }
        return 0;
}

int suite_add_config(struct eval *e, const char *spec) {
        struct config *c = &e->configs[e->n_configs];
        if (e->n_configs >= MAX_CONFIGS || parse_config(spec, c) < 0) {
                fprintf(stderr, "kvc-eval: bad configuration '%s'\n", spec);
                return -EINVAL;
        }
        if (!c->family[0]) { /* "name-64" -> "name" */
                size_t n = strlen(c->label);
                while (n && c->label[n - 1] >= '0' && c->label[n - 1] <= '9')
                        n--;
                if (n && n < strlen(c->label) && c->label[n - 1] == '-')
                        n--;
                size_t len = n ? n : strlen(c->label);
                len = len < sizeof(c->family) - 1 ? len : sizeof(c->family) - 1;
                memcpy(c->family, c->label, len);
                c->family[len] = '\0';
        }
        e->n_configs++;
        return 0;
}

/* The default suite: every policy at budgets 32..256, the gates and corrections to compare. */
static int default_suite(struct eval *e) {
        static const char *const per_budget[] = {
                "window:%u",
                "streaming:%u",
                "h2o:%u",
                "tova:%u",
                "pyramid:%u",
                "pyramid-taper:%u",
                "scope-slide=scope:%u",
                "scope-adaptive=scope:%u:strategy=adaptive",
                "h2o-unified=h2o:%u:per_head=0",
                "conf-fixed=conf:%u:gate=fixed",
                "conf-naive=conf:%u:gate=naive",
                "conf-defer=conf:%u:gate=defer",
                "conf-l=conf-l:%u",
                "conf-int8=conf:%u:gate=fixed,int8=1",
                "conf-defer-int8=conf:%u:gate=defer,int8=1",
                "snapkv:%u",
                "prob-none=prob:%u:correction=none",
                "prob-ht=prob:%u:correction=ht",
                "prob-moment=prob:%u:correction=moment",
                "prob-sink=prob:%u:correction=sink",
                "conf-moment=conf:%u:gate=fixed,correction=moment",
        };
        static const uint32_t budgets[] = { 32, 64, 128, 256 };
        char spec[160], label[64];
        int r = suite_add_config(e, "full=full:0");
        for (size_t i = 0; r == 0 && i < sizeof(per_budget) / sizeof(per_budget[0]); i++) {
                for (size_t b = 0; r == 0 && b < sizeof(budgets) / sizeof(budgets[0]); b++) {
                        snprintf(spec, sizeof(spec), per_budget[i], budgets[b]);
                        char *eq = strchr(spec, '='), *colon = strchr(spec, ':');
                        if (eq && eq < colon) { /* "name=policy:..." -> "name-B=policy:..." */
                                snprintf(label, sizeof(label), "%.*s-%u", (int)(eq - spec), spec, budgets[b]);
                                char tail[160];
                                snprintf(tail, sizeof(tail), "%s=%s", label, eq + 1);
                                snprintf(spec, sizeof(spec), "%s", tail);
                        }
                        r = suite_add_config(e, spec);
                }
        }
        /* the INT8 curve is measured finer where it crosses a 64-token FP16 window's bytes */
        if (r == 0)
                r = suite_add_config(e, "conf-int8-80=conf:80:gate=fixed,int8=1");
        if (r == 0)
                r = suite_add_config(e, "conf-int8-96=conf:96:gate=fixed,int8=1");
        return r;
}

static int quick_suite(struct eval *e) {
        int r = suite_add_config(e, "full=full:0");
        if (r == 0)
                r = suite_add_config(e, "window-big=window:512"); /* >= the sequence: must equal full */
        if (r == 0)
                r = suite_add_config(e, "window-32=window:32");
        if (r == 0)
                r = suite_add_config(e, "conf-32=conf:32");
        return r;
}

/* Reads every worker's lines as they come (poll), adds them up, and shows progress on stderr at
 * most once a second: sequences done, positions scored per second over all configurations, and
 * the time left at that rate. Returns the number of workers that failed. */
static int collect(struct eval *e, const int *fds, const pid_t *pids, struct metrics *m, struct metrics *own,
                   FILE *pairs, double t0) {
        struct pollfd pfd[64];
        char *bufs[64] = { 0 };
        size_t lens[64] = { 0 }, caps[64] = { 0 };
        uint32_t open_pipes = e->jobs, done = 0;
        uint64_t positions = 0;
        double last = 0;
        bool tty = isatty(2);
        for (uint32_t w = 0; w < e->jobs; w++)
                pfd[w] = (struct pollfd){ .fd = fds[w], .events = POLLIN };
        while (open_pipes > 0) {
                if (poll(pfd, e->jobs, 1000) < 0 && errno != EINTR)
                        break;
                for (uint32_t w = 0; w < e->jobs; w++) {
                        if (pfd[w].fd < 0 || !(pfd[w].revents & (POLLIN | POLLHUP | POLLERR)))
                                continue;
                        if (caps[w] - lens[w] < 4096) {
                                char *nb = realloc(bufs[w], caps[w] * 2 + 8192);
                                if (!nb)
                                        break;
                                bufs[w] = nb;
                                caps[w] = caps[w] * 2 + 8192;
                        }
                        ssize_t got = read(pfd[w].fd, bufs[w] + lens[w], caps[w] - lens[w] - 1);
                        if (got < 0 && errno == EINTR)
                                continue;
                        if (got <= 0) {
                                pfd[w].fd = -1;
                                open_pipes--;
                                continue;
                        }
                        lens[w] += (size_t)got;
                        bufs[w][lens[w]] = '\0';
                        char *line = bufs[w], *nl;
                        while ((nl = strchr(line, '\n'))) { /* whole lines only; the rest waits */
                                *nl = '\0';
                                uint64_t g = story_merge_line(e, line, m, own, pairs);
                                if (line[0] == 'G') {
                                        positions += g;
                                        done++;
                                }
                                line = nl + 1;
                        }
                        lens[w] -= (size_t)(line - bufs[w]);
                        memmove(bufs[w], line, lens[w]);
                }
                double now = now_s();
                if (now - last >= 1.0 || open_pipes == 0) {
                        last = now;
                        double rate = positions * e->n_configs / (now - t0 > 0 ? now - t0 : 1);
                        double left = done ? (now - t0) * (e->sequences - done) / done : 0;
                        fprintf(stderr,
                                "%skvc-eval: %u configurations, %u/%u sequences, %.0f tokens/s, %.0f s "
                                "left%s",
                                tty ? "\r" : "", e->n_configs, done, e->sequences, rate, left,
                                tty ? "   " : "\n");
                }
        }
        if (tty)
                fputc('\n', stderr);
        int failed = 0;
        for (uint32_t w = 0; w < e->jobs; w++) {
                free(bufs[w]);
                close(fds[w]);
                int st;
                waitpid(pids[w], &st, 0);
                failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        }
        return failed;
}

int suite_run(struct eval *e) {
        e->recs = calloc((size_t)e->sequences * MAX_CONFIGS, sizeof(struct seq_rec));
        if (!e->recs)
                return 1;
        if (e->n_configs == 0 && (e->quick ? quick_suite(e) : default_suite(e)) < 0)
                return 2;

        int r = model_load(e->model_path, &e->model);
        if (r < 0) {
                fprintf(stderr, "kvc-eval: cannot load %s: %s\n", e->model_path, strerror(-r));
                return 1;
        }
        const struct model_config *mc = model_get_config(e->model);
        if (!e->max_tokens || e->max_tokens > (uint32_t)mc->seq_len)
                e->max_tokens = (uint32_t)mc->seq_len;
        FILE *df = fopen(e->data_path, "rb");
        if ((r = tokenizer_load(e->tok_path, mc->vocab_size, &e->tok)) < 0 || !df) {
                fprintf(stderr, "kvc-eval: cannot load the tokenizer or the data\n");
                return 1;
        }
        fseek(df, 0, SEEK_END);
        e->text_len = (size_t)ftell(df);
        fseek(df, 0, SEEK_SET);
        e->text = malloc(e->text_len + 1);
        if (!e->text || fread(e->text, 1, e->text_len, df) != e->text_len)
                return 1;
        e->text[e->text_len] = '\0';
        fclose(df);
        { /* the split may hold fewer stories than asked for: every interval counts the ones run */
                static const char *starts[2048];
                static size_t lens[2048];
                size_t ns = story_split(e->text, e->text_len, starts, lens, 2048);
                size_t end = ns < e->split_end ? ns : e->split_end, from = (size_t)e->split_first + e->first;
                size_t avail = end > from ? end - from : 0;
                if (avail < 2) {
                        fprintf(stderr, "kvc-eval: the %s split holds %zu stories from --first on\n",
                                e->split, avail);
                        return 2;
                }
                if (e->sequences > avail)
                        e->sequences = (uint32_t)avail;
        }

        /* workers report through pipes; the parent adds up */
        struct metrics m[MAX_CONFIGS] = { 0 }, own = { 0 };
        FILE *pairs = NULL;
        char pairs_path[512];
        report_path(e, "confidence_kl.csv", true, pairs_path, sizeof(pairs_path));
        pairs = fopen(pairs_path, "w");
        if (pairs)
                fprintf(pairs, "confidence,kl\n");
        pid_t pids[64];
        int ins[64];
        double t0 = now_s();
        for (uint32_t w = 0; w < e->jobs; w++) {
                int fds[2];
                if (pipe(fds) < 0)
                        return 1;
                fflush(NULL);
                pids[w] = fork();
                if (pids[w] == 0) {
                        close(fds[0]);
                        FILE *out = fdopen(fds[1], "w");
                        int wr = story_worker(e, w, out);
                        fclose(out);
                        _exit(wr < 0 ? 1 : 0);
                }
                close(fds[1]);
                ins[w] = fds[0];
        }
        int failed = collect(e, ins, pids, m, &own, pairs, t0);
        if (pairs)
                fclose(pairs);
        if (failed) {
                fprintf(stderr, "kvc-eval: %d of %u workers failed: no results (%s untouched)\n", failed,
                        e->jobs, e->out_dir);
                unlink(pairs_path);
        } else {
                report_write(e, m, &own);
                fprintf(stderr,
                        "kvc-eval: %u configurations, %llu tokens scored each, %.1f s; results in %s\n",
                        e->n_configs, (unsigned long long)(e->n_configs ? m[0].n : 0), now_s() - t0,
                        e->out_dir);
        }
        free(e->recs);
        tokenizer_free(e->tok);
        model_free(e->model);
        free(e->text);
        return failed ? 1 : 0;
}
