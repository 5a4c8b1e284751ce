"""Logits processors: `(logits [n, vocab] float32, step, sequences [n, max_decode_len]) ->
logits`, applied to the model's logits before a search sees them (see decoding.py), and
`make_logits_processor`, which chains them in Hugging Face's order."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.inference.search_basics import (NEG_INF, Array, LogitsProcessor, check,
                                                     first_inputs)

def min_length_processor(min_length: int | Array, eos_id: int,
                         end_ids: Sequence[int] = ()) -> LogitsProcessor:
  """Bans EOS (and the further `end_ids`) at output positions below `min_length`: at least
  that many tokens come first. `min_length` and `step` may each be one per row ([rows])."""
  check("min_length", min_length, lambda v: v >= 0, ">= 0")

  def process(logits, step, sequences):
    del sequences
    is_eos = jnp.isin(jnp.arange(logits.shape[-1]), jnp.asarray((eos_id, *end_ids)))
    early = jnp.reshape(step, (-1, 1)) < jnp.reshape(min_length, (-1, 1))  # [rows or 1, 1]
    return jnp.where(is_eos & early, NEG_INF, logits)
  return process


def min_tokens_processor(min_tokens: Array, eos_id: int,
                         end_ids: Sequence[int] = ()) -> LogitsProcessor:
  """vLLM's per-row `min_tokens` ([rows]): `min_length_processor` with each row's own, on the
  whole batch (`step` one or per row); a step where no row needs it costs one test."""
  return only_where(lambda step: jnp.any(step < min_tokens),
                    min_length_processor(min_tokens, eos_id, end_ids))


def banned_ids_processor(banned_ids: Sequence[int]) -> LogitsProcessor:
  """Never generates the tokens `banned_ids` (ids past the vocabulary are ignored)."""
  ids = np.asarray(banned_ids, np.int32).reshape(-1)
  check("banned_ids", ids, lambda v: v >= 0, ">= 0")

  def process(logits, step, sequences):
    del step, sequences
    return logits.at[:, ids].set(NEG_INF)
  return process


def repetition_penalty_processor(penalty: float | Array,
                                 prompt: Array | None = None) -> LogitsProcessor:
  """CTRL's repetition penalty (Keskar et al., 2019): each token already in the output has its
  logit divided by `penalty` when positive, multiplied by it when negative (1 = off; > 1
  discourages repeats); one for all rows or one per row ([rows]). Id 0 (padding) is never
  penalised. `prompt` [b, len] (0: padding): the tokens of each input's prompt count as seen
  too, as Hugging Face's processor counts a decoder-only model's whole input ids; its rows
  repeat over each input's consecutive rows (beams, samples). Needs the whole batch (not one
  row at a time)."""
  check("repetition_penalty", penalty, lambda v: v > 0, "> 0")

  def process(logits, step, sequences):
    del step
    rows = jnp.arange(logits.shape[0])[:, None]  # [n, 1]
    seen = jnp.zeros(logits.shape, bool).at[rows, sequences].set(True)  # [n, vocab]
    if prompt is not None:
      seen = seen.at[rows, jnp.repeat(prompt, logits.shape[0] // prompt.shape[0], axis=0)].set(
          True)
    seen = seen.at[:, 0].set(False)  # sequences hold 0 from `step` on
    per_row = jnp.reshape(penalty, (-1, 1))
    penalised = jnp.where(logits > 0, logits / per_row, logits * per_row)
    return jnp.where(seen, penalised, logits)
  return process


# A pad entry of `openai_penalties_processor`'s bias ids: past every vocabulary, so dropped.
NO_TOKEN = np.iinfo(np.int32).max


def openai_penalties_processor(presence: Array, frequency: Array, bias_ids: Array,
                               bias_values: Array) -> LogitsProcessor:
  """OpenAI's per-row sampling penalties (each row its own request's): a token's logit less
  `frequency` [rows] times the count of that token in the row's output so far, less
  `presence` [rows] where it is there at all, plus the row's `logit_bias` (`bias_values`
  [rows, k] added to the tokens `bias_ids` [rows, k], NO_TOKEN: no entry). The prompt is not
  counted, as in OpenAI's and vLLM's presence and frequency penalties.

  Unlike the other processors it takes the whole batch even where each row is at its own
  step ([rows], continuous batching): its settings are per row. Rows that set none of them
  cost one test a step."""

  def penalise(logits, step, sequences):
    # A row's output is its first `step` tokens (the rest: zeros, which are an id too).
    written = jnp.arange(sequences.shape[1])[None, :] < jnp.reshape(step, (-1, 1))
    rows = jnp.arange(logits.shape[0])[:, None]
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, sequences].add(
        written.astype(jnp.float32))
    logits = logits - frequency[:, None] * counts - jnp.where(counts > 0, presence[:, None],
                                                             0.0)
    return logits.at[rows, bias_ids].add(bias_values, mode="drop")

  return only_where(lambda step: jnp.any(presence != 0) | jnp.any(frequency != 0) |
                    jnp.any(bias_ids != NO_TOKEN), penalise)


def only_where(needed: Callable[[Array], Array], processor: LogitsProcessor) -> LogitsProcessor:
  """`processor` at a step where `needed(step)` (a traced bool) holds, else the logits as they
  are: per-row settings that no row of a batch uses cost one test a step."""

  def process(logits, step, sequences):
    return jax.lax.cond(needed(step), processor, lambda x, *_: x, logits, step, sequences)
  return process


def no_repeat_ngram_processor(ngram_size: int) -> LogitsProcessor:
  """Bans every token that would complete an n-gram of `ngram_size` tokens already in the
  output (Hugging Face's NoRepeatNGramLogitsProcessor over the output tokens; its sequence
  also starts with the decoder start token, which `sequences` does not hold, so n-grams
  through the start token are not banned here). `ngram_size` fixes shapes: a Python int."""
  check("no_repeat_ngram_size", ngram_size, lambda v: v >= 1, ">= 1")

  def process(logits, step, sequences):
    n, length = ngram_size, sequences.shape[1]
    if n > length:  # no output holds a whole n-gram
      return logits
    # Window j is sequences[:, j : j + n]; it is whole (before `step`) when j <= step - n.
    # Where its first n - 1 tokens equal the last n - 1 generated ones, its last token
    # would repeat it.
    starts = jnp.arange(length - n + 1)  # [windows]
    windows = sequences[:, starts[:, None] + jnp.arange(n)]  # [rows, windows, n]
    suffix = jax.lax.dynamic_slice_in_dim(sequences, jnp.maximum(step - n + 1, 0), n - 1,
                                          axis=1)  # [rows, n - 1]
    matches = jnp.all(windows[:, :, :-1] == suffix[:, None, :], axis=-1) & (
        starts <= step - n)  # [rows, windows]
    rows = jnp.arange(logits.shape[0])[:, None]
    hits = jnp.zeros(logits.shape, jnp.int32).at[rows, windows[:, :, -1]].add(
        matches.astype(jnp.int32))
    return jnp.where(hits > 0, NEG_INF, logits)
  return process


def _force(logits: Array, token_id: int, at: Array) -> Array:
  """Where `at`, every logit but `token_id`'s becomes NEG_INF and that one 0 (as Hugging
  Face's forcing processors do: the forced token costs nothing)."""
  only = jnp.where(jnp.arange(logits.shape[-1]) == token_id, 0.0, NEG_INF)  # [vocab]
  return jnp.where(at, only, logits)


def forced_bos_processor(token_id: int | Array) -> LogitsProcessor:
  """Forces `token_id` at output position 0 (Hugging Face's forced_bos_token_id, e.g. the
  target-language token of multilingual BART), or one per input ([batch] ids, 0 = none: each
  row's own target language), repeated over its consecutive rows (beams, samples)."""
  if jnp.ndim(token_id) == 0:
    check("forced_bos_id", token_id, lambda v: v >= 0, ">= 0")

    def process(logits, step, sequences):
      del sequences
      return _force(logits, token_id, step == 0)
    return process

  def process_rows(logits, step, sequences):
    del sequences
    ids = first_inputs(token_id, logits.shape[0])  # [rows, 1]
    only = jnp.where(jnp.arange(logits.shape[-1])[None, :] == ids, 0.0, NEG_INF)
    return jnp.where((step == 0) & (ids != 0), only, logits)
  return process_rows


def forced_eos_processor(eos_id: int) -> LogitsProcessor:
  """Forces EOS at the last output position, max_decode_len - 1 (Hugging Face's
  forced_eos_token_id), so that no output is cut off without one."""

  def process(logits, step, sequences):
    return _force(logits, eos_id, step == sequences.shape[1] - 1)
  return process


def chain_processors(*processors: LogitsProcessor | None) -> LogitsProcessor | None:
  """One processor applying `processors` in order (None ones skipped; None if none is left)."""
  processors = [p for p in processors if p is not None]
  if not processors:
    return None

  def process(logits, step, sequences):
    for p in processors:
      logits = p(logits, step, sequences)
    return logits
  return process


def make_logits_processor(*, eos_id: int, end_ids: Sequence[int] = (), min_length: int = 0,
                          banned_ids: Sequence[int] = (),
                          repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0,
                          forced_bos_id: int | Array = -1, forced_eos: bool = False,
                          prompt: Array | None = None) -> LogitsProcessor | None:
  """The processor for the `decoding` config's settings (None when all are off), in Hugging
  Face's order: repetition penalty (counting `prompt`'s tokens too, where given), no-repeat
  n-grams, banned ids, min length, forced BOS, forced EOS."""
  return chain_processors(
      repetition_penalty_processor(repetition_penalty, prompt) if repetition_penalty != 1.0
      else None,
      no_repeat_ngram_processor(no_repeat_ngram_size) if no_repeat_ngram_size else None,
      banned_ids_processor(banned_ids) if len(banned_ids) else None,
      min_length_processor(min_length, eos_id, end_ids) if min_length else None,
      forced_bos_processor(forced_bos_id) if jnp.ndim(forced_bos_id) or forced_bos_id >= 0
      else None,
      forced_eos_processor(eos_id) if forced_eos else None)
