/* lab.h: what the SmolLM2 tasks of the quality lab share (niah, longdoc, longgen, mechanism).
 *
 * Owns: the lab's state for one run (struct niah: the GGUF model and its tokenizer, the
 * TinyStories sample cut into stories, the kvcd client, the configurations of the current
 * sequence, progress counters), opening and closing it (lab_open, lab_close), the text every task
 * builds its sequences from (haystack: test-split stories joined into exactly N tokens), opening a
 * configuration's kvcd session, the bytes kvcd charges a session (held_add, held_close), the
 * cache callbacks that route the engine's keys, values and queries to kvcd, progress on stderr,
 * and results written as NAME.partial and renamed only when a run completes.
 *
 * The names are those the helpers had in niah.c, where they were born (struct niah is the lab's
 * state whatever the task): the needle task's code did not change when they moved here.
 */
#ifndef KVC_EVAL_LAB_H
#define KVC_EVAL_LAB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvc.h"
#include "model.h"
#include "niah.h"

#define NIAH_MAX_CONFIGS 32
#define NIAH_TEST_FIRST  200 /* the test split of the stories: kvc-eval's TUNE_STORIES on */

/* A policy with its fixed parameters; a configuration is a family at a budget. */
struct niah_family {
        const char *label, *policy;
        const char *keys[3], *values[3];
        size_t n_params;
        const char *tiers; /* the session's tiers below FP16 (the ladder), NULL: none */
        bool bytes;        /* the fraction is of the full cache's bytes (a byte budget), not of its tokens */
        const char *importance; /* the prompt's scores (importance.h: surprisal, recon), NULL: attention */
};

struct niah_config {
        char label[64];
        const struct niah_family *fam; /* NULL: the full cache */
        double fraction;
        uint32_t budget;
        uint64_t budget_bytes; /* the family's fraction of the full cache's bytes, with fam->bytes */
        struct kvc_param params[3];
        char value_buf[3][24]; /* parameter values computed per configuration (params[i].value may
                                  point here) */
};

struct niah {
        const struct niah_options *o;
        struct model *model;
        struct text *tok;
        const struct model_config *mc;
        struct kvc_client *client;
        char *data;
        size_t data_len;
        const char **stories;
        size_t *story_lens, n_stories;
        struct niah_config cfg[NIAH_MAX_CONFIGS];
        uint32_t n_cfg; /* per length: the budgets depend on it */
        uint64_t rng;
        const char *task; /* lab_open's */
        bool local;       /* the task keeps its caches in process: lab_open connects to no kvcd */
        uint32_t max_tokens; /* the positions of the current sequence (sessions' max_tokens), 0: the model's */
        double t0, rows_done, rows_total, last_progress;
};

#define LAB_PROGRESS_S 60.0 /* a progress line at least this often within a long sequence */

/* A growing NUL-terminated string. */
struct textbuf {
        char *s;
        size_t len, cap;
};

/* Monotonic seconds. */
double now_s(void);
/* xorshift64: the lab's one generator (needles, haystacks), deterministic given the seed. */
uint64_t next_rand(uint64_t *s);

/* Appends n bytes of s. 0 or -ENOMEM. */
int tb_add(struct textbuf *b, const char *s, size_t n);
/* Text of exactly `length` tokens (as the model's tokenizer cuts it) from stories of the test
 * split joined by blank lines, starting at a random story. 0, -ENODATA (the stories are too
 * short), -ENOMEM. */
int haystack(struct niah *n, uint32_t length, struct textbuf *out);

/* Appends a configuration: fam at `budget` tokens, labelled "LABEL-F%" for fraction F, with the
 * family's fixed parameters; fam NULL is the full cache ("full"). The caller sets n->n_cfg = 0
 * first. NULL when NIAH_MAX_CONFIGS are there. */
struct niah_config *lab_config_add(struct niah *n, const struct niah_family *fam, double fraction,
                                   uint32_t budget);

/* Opens the kvcd session of configuration cf (FP16 keys and values, the model's geometry) with
 * prompt_tokens declared; on failure says why on stderr under `task`. */
int lab_session_open(struct niah *n, const struct niah_config *cf, uint32_t prompt_tokens, const char *task,
                     struct kvc_session **ret);

/* k rows a configuration for the next pass, made smaller where a session's fullest layer has less room
 * than that beside what it holds (kvcd's plans make room between passes); at least 1. */
uint32_t lab_chunk(struct kvc_session *const *ss, uint32_t n_sessions, uint32_t n_layers, uint32_t k);

/* "kvc-eval TASK: length L, needle/document/prompt i/N, ..." on stderr. */
void progress(struct niah *n, const char *task, uint32_t length, uint32_t needle);
/* Counts a pass's rows; within a long sequence, a line of rows done, rate and time left on stderr
 * once every LAB_PROGRESS_S seconds. */
void lab_rows_done(struct niah *n, double rows);
/* Adds k steps of what kvcd holds for s to the running sums (every task weights a step by the
 * rows it scored). */
void held_add(struct kvc_session *s, uint32_t n_layers, uint32_t k, double *charged, double *tokens);
/* Closes s: its peak as kvcd charged it, and the sums made averages over weight. */
void held_close(struct kvc_session *s, double weight, double *charged, double *tokens,
                uint64_t *peak_charged);

/* out[v] = log softmax(lg)[v] for v < V (in double, stored as float); returns the argmax. */
uint32_t lab_log_softmax(const float *lg, uint32_t V, float *out);
/* KL(p || q) of two log-distributions of V entries. */
double lab_kl(const float *log_p, const float *log_q, uint32_t V);

/* out_dir/NAME.partial, for writing. */
FILE *open_partial(const struct niah_options *o, const char *name);
/* Renames out_dir/NAME.partial over NAME when keep, else removes it. */
void finish_partial(const struct niah_options *o, const char *name, bool keep);

/* What every task starts from: the GGUF model and its tokenizer, the stories, a kvcd client
 * (named kvc-eval-TASK). On failure it says why on stderr; when the model itself did not open,
 * n->model is NULL and nothing is held, otherwise lab_close releases what did open. */
int lab_open(struct niah *n, const char *task);
void lab_close(struct niah *n);

#endif
