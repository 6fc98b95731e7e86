/* llama.h - the Llama forward pass over a GGUF file (general.architecture = llama): SmolLM2,
 * Llama 2/3 and the models shaped like them.
 *
 * Owns: struct llama, the model's configuration read from the GGUF metadata and checked against
 * the tensors' shapes, the weights (left quantized in the file's mapping: the norms alone are
 * copied out as floats), the activation buffers of one sequence, the RoPE table and the thread
 * pool its products run on.
 *
 * The KV cache is the caller's, through the same struct model_cache_ops as llama2.c checkpoints
 * (model.h): the forward pass hands each layer's post-RoPE keys and values to the cache and asks
 * it for the attention output. model.c recognises a GGUF by its magic and runs it through here.
 *
 * RoPE: llama.cpp's converter permutes Q and K so that rotation applies to adjacent pairs
 * (x[2i], x[2i+1]) with frequency base^(-2i / head_dim): the same rotation as llama2.c's, with the
 * GGUF's base. Attention scale 1 / sqrt(head_dim) is the cache's (kernels/attention.h).
 */
#ifndef KVC_ENGINE_LLAMA_H
#define KVC_ENGINE_LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

struct gguf;
struct llama;

struct llama_options {
        unsigned threads; /* 0: threads_default() */
        bool exact;       /* f32-accurate products (no quantized activations) */
};

/* Takes the gguf (*g set to NULL) whatever the outcome. -EINVAL with a reason in why for a model
 * this engine cannot run: another architecture, a tensor missing or of the wrong shape, a tensor
 * type without a row in qtype.c (named), partial rotary embeddings. */
int llama_new(struct gguf **g, const struct llama_options *o, struct llama **ret, char *why, size_t why_len);
struct llama *llama_free(struct llama *m);
const struct model_config *llama_config(const struct llama *m);
/* Rows of tokens in one pass, exactly as model_forward_rows (model.h). */
int llama_forward_rows(struct llama *m, const struct model_row *rows, uint32_t n,
                       const struct model_cache_ops *cache, float **ret_logits);
/* One token at pos, exactly as model_forward (model.h). */
int llama_forward(struct llama *m, int token, int pos, const struct model_cache_ops *cache, void *ctx,
                  float **ret_logits);

#endif
