/* model.h - the engine's one model interface: a GGUF model (model_open recognises the magic and
 * hands it to llama.c) or a llama2.c "legacy" checkpoint (loaded and run here).
 *
 * Owns: loading and validating a llama2.c checkpoint (from a file or from memory), its weights and
 * activation buffers, one decode step (model_forward) and rows of one pass (model_forward_rows)
 * for either format, and the plain in-process KV cache that is the quality reference (no
 * eviction, attention computed exactly as llama2.c run.c).
 *
 * The KV cache is not part of the model: model_forward hands every layer's post-RoPE key and value
 * to the caller's cache through struct model_cache_ops and asks the cache for the attention output.
 * That is the seam where eviction policies and the daemon-backed cache plug in; the plain cache
 * below is the oracle they are compared with.
 *
 * Not thread-safe: a struct model holds its activations, so one thread drives it at a time. Several
 * models may run in parallel.
 */
#ifndef KVC_CLIENT_MODEL_H
#define KVC_CLIENT_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct model_config {
        int dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

/* The most positions a model may declare (seq_len), in either format: the context kvcd's wire
 * takes (proto/wire.h). A file that declares more is refused, so seq_len always fits an int and
 * any product of it with a few words (a prompt buffer, a plain cache) fits a size_t. */
#define MODEL_MAX_SEQ_LEN (1 << 20)

struct model;

/* Loads a checkpoint: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
 * vocab_size, seq_len; vocab_size > 0 means the classifier shares the token embedding, < 0 means a
 * separate classifier of |vocab_size| rows follows the RoPE tables), then the float32 tensors.
 * The header must be in range (all positive, n_heads % n_kv_heads == 0, dim % n_heads == 0, an even
 * head dimension, bounded sizes) and the file must be exactly as long as the header implies, with
 * or without the two (unused) RoPE frequency tables. The model gets its own copy of the weights and
 * all activation buffers here; model_forward never allocates.
 * Returns 0, -EINVAL (bad header or size), -ENOENT/-EACCES/... (open), -EIO (read), -ENOMEM. */
int model_load(const char *path, struct model **ret);
/* Options of a GGUF model (llama.h); a llama2.c checkpoint has none. */
struct model_options {
        unsigned threads; /* 0: every CPU this process may use */
        bool exact;       /* f32-accurate matrix products */
};
/* Opens a model in either format, recognised by its magic: a GGUF file (llama.c, weights left
 * quantized in its mapping) or a llama2.c checkpoint (model_load). why (may be NULL) gets the
 * reason a GGUF was refused. */
int model_open(const char *path, const struct model_options *o, struct model **ret, char *why,
               size_t why_len);
/* The same checks on a checkpoint held in memory; data is copied and not kept. */
int model_load_buffer(const void *data, size_t len, struct model **ret);
struct model *model_free(struct model *m);
/* Whether m came from a GGUF file. */
bool model_is_gguf(const struct model *m);
/* vocab_size here is always the positive number of tokens. */
const struct model_config *model_get_config(const struct model *m);

/* The KV cache the forward pass stores into and attends over, supplied by the caller.
 * Both return 0 or -errno; model_forward stops at the first failure and returns it. */
struct model_cache_ops {
        /* Store the post-RoPE key and the value of the token at position pos for one layer.
         * k and v are [n_kv_heads * head_dim] floats, valid only during the call. */
        int (*store)(void *ctx, int layer, int pos, const float *k, const float *v);
        /* Decode attention for one layer at position pos: q is [n_heads * head_dim] (post-RoPE),
         * out receives [n_heads * head_dim]. Grouped-query: query head h uses KV head
         * h / (n_heads / n_kv_heads). */
        int (*attend)(void *ctx, int layer, int pos, const float *q, float *out);
        /* Optional: attention of n rows at once, the layer's last n stored tokens (positions pos ..
         * pos + n - 1, stored in that order just before), row r over what was stored up to its own
         * token; q and out are [n][n_heads * head_dim]. It must compute what n attend() calls, each
         * right after its row's store(), would. With it, a pass stores every row of a layer first
         * and then attends the rows of each context together, the contexts in parallel on the
         * engine's threads (so attend_rows must be safe to call for different contexts at once). */
        int (*attend_rows)(void *ctx, int layer, int pos, uint32_t n, const float *q, float *out);
};

/* One forward step of token at position pos. For each layer it calls cache->store(layer, pos, ...)
 * and then cache->attend(layer, pos, ...). pos is only required to be >= 0: a cache that evicts may
 * run past the trained context (seq_len), and it is the cache that refuses positions it cannot hold.
 * On success *ret_logits points at vocab_size floats owned by the model, valid until the next call
 * or model_free. Returns -EINVAL for a token outside the vocabulary, a negative pos or a NULL
 * argument, or the cache's error. */
int model_forward(struct model *m, int token, int pos, const struct model_cache_ops *cache, void *ctx,
                  float **ret_logits);

/* Rows of one pass: B sequences' next tokens (each with its own cache context), or a chunk of one
 * prompt (consecutive positions, one context), or both. The weights are read once for all rows. */
#define MODEL_MAX_ROWS       256 /* rows of one pass (a prompt chunk) */
#define MODEL_MAX_LOGIT_ROWS 64  /* rows of one pass that want logits (a batch) */

struct model_row {
        int token, pos;
        void *ctx;   /* the cache context this row stores into and attends over */
        bool logits; /* whether the caller wants this row's logits */
};

/* Runs rows[0..n) through the model in one pass. Within a layer the rows store and attend in
 * order, so a row sees what the rows before it stored: a chunk of a prompt is causal, exactly as
 * feeding its tokens one by one (with cache->attend_rows, a context's rows must be consecutive
 * positions in consecutive rows, each context in one run, to be attended together; otherwise the
 * pass attends row by row); each row's result is the same as in any other pass (a row's
 * arithmetic depends on the row alone). *ret_logits points at one vocab_size vector per row that
 * asked for logits, in row order, owned by the model until the next call. -EINVAL for n outside
 * 1..MODEL_MAX_ROWS, more than MODEL_MAX_LOGIT_ROWS rows wanting logits (a llama2.c checkpoint:
 * any row but the last), a bad token or position; or the cache's error. */
int model_forward_rows(struct model *m, const struct model_row *rows, uint32_t n,
                       const struct model_cache_ops *cache, float **ret_logits);

/* The plain in-process cache: every position 0..max_tokens-1 of every layer kept in float32, no
 * eviction. Attention is exactly llama2.c's: scores q.k/sqrt(head_dim) over positions 0..pos,
 * max-subtracted softmax, weighted sum of values, in the same order of operations as run.c, so its
 * greedy output matches llama2.c bit for bit.
 * store(pos) requires pos <= (positions stored so far in that layer), i.e. no gaps; storing at an
 * earlier position rewinds the layer to pos + 1 positions. attend(pos) requires pos to be stored.
 * Both give -EINVAL otherwise, and -ERANGE for pos >= max_tokens. */
struct plain_cache;
/* max_tokens: 1..cfg->seq_len is the usual choice, at most 1 << 24. */
int plain_cache_new(const struct model_config *cfg, int max_tokens, struct plain_cache **ret);
struct plain_cache *plain_cache_free(struct plain_cache *c);
/* Forget every stored position (a new sequence) without freeing. */
void plain_cache_reset(struct plain_cache *c);
extern const struct model_cache_ops plain_cache_ops; /* ctx is a struct plain_cache * */

#endif
