/* story.h: one story of the story suite (suite.h) and its metrics, on a worker's side.
 *
 * Owns: cutting the text into stories (each begins "Once upon a time"), a story's tokens (at most
 * e->max_tokens) and its name recall targets (the first token of a character's name where it
 * recurs at least NAME_GAP tokens after its first appearance; a name is a capitalized word that
 * also stands mid-sentence), the reference pass (the model with its own cache, no kvcd) and every
 * configuration's teacher-forced pass in lockstep through kvcd with its sums (struct metrics per
 * configuration, struct seq_rec per story and configuration), and the text lines a worker writes
 * them as, which the parent reads back:
 *   P conf,kl       a step's full-cache confidence and the KL of the --corr configuration
 *   S k c ...       story k, configuration c: its seq_rec
 *   G n             a story done: its n scored positions
 *   M c ...         configuration c's totals over the worker's stories
 *   O nll n         the reference model alone
 * The sums go as %.17g (exact doubles), a P line as the CSV row it becomes (confidence_kl.csv).
 */
#ifndef KVC_EVAL_STORY_H
#define KVC_EVAL_STORY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "suite.h"

/* The stories of text (at most max): where each begins, and its length up to the next. */
size_t story_split(const char *text, size_t len, const char **starts, size_t *lens, size_t max);

/* Worker `index` of e->jobs: the split's stories first + index, first + index + jobs, ... (at
 * most e->sequences in all), each through its own kvcd client; writes P, S and G lines as it goes
 * and the M and O lines at the end to out. 0 or -errno. */
int story_worker(struct eval *e, uint32_t index, FILE *out);

/* Adds one line a worker wrote (without its newline) in: S lines into e->recs, M and O lines into
 * m[] and own, P lines copied to pairs (may be NULL); a malformed line is skipped. Returns the
 * positions a G line reports, else 0. */
uint64_t story_merge_line(struct eval *e, const char *line, struct metrics *m, struct metrics *own,
                          FILE *pairs);

#endif
