"""Autoregressive decoding over a model-agnostic callback.

`tokens_to_logits(ids [n, 1], cache) -> (logits [n, vocab], new_cache)` is all decoding knows
of the model. Every loop runs inside `lax.while_loop`, so a decode function jit-compiles whole.
Beam search and `num_decodes` sampling work on flattened [batch * copies] rows: callers expand
their per-example inputs (e.g. encoder outputs) with `flat_batch_beam_expand`; the cache is
expanded here, and beam search reorders its rows with the caller's `reorder_cache` (every
leaf gathered by default).

Shared options:
  decoder_prompt: int [batch, P] tokens forced at the first output positions of each row (the
    row's prompt ends at its first 0). Forced tokens are part of the output and count in its
    length, but not in its log-probability, and a forced EOS does not end the output.
    Encoder-decoder callers force a target prefix; decoder-only callers can force any prompt
    the cache does not already hold.
  logits_processor: `(logits [n, vocab] float32, step, sequences [n, max_decode_len]) ->
    logits`, applied to the model's logits before anything else sees them; `step` (a traced
    int32 scalar) is the output position being chosen, `sequences` the output so far (zeros
    from `step` on). Log-probabilities and scores are those of the processed logits. See
    the processors below and `make_logits_processor`, which chains them in Hugging Face's
    order, so that the forced BOS / EOS win over everything else.

Beam search keeps live and finished hypotheses apart (as t5x does). Per example there are up
to `beam_size` live hypotheses (no EOS yet) and the `beam_size` best finished ones (ended by
EOS), scored log-probability / length_penalty(length, alpha, kind), the length counting EOS
(and the decoder prompt). Each step extends every live hypothesis by every token and keeps the
2 * beam_size best extensions by log-probability: those ending in EOS compete for the finished
slots, the best beam_size others stay live. (With only beam_size, hypotheses that end would
take the places of live ones, and a better hypothesis found late could be lost.) A hypothesis
has at most `max_decode_len` tokens, EOS included; one that reaches it without EOS has not
finished. The search stops at that length, or earlier once every example has beam_size
finished hypotheses and no live one can still beat the worst of them (log-probs only fall, so
the bound is its log-prob over the most favourable length penalty). An example with fewer than
beam_size finished hypotheses gets the best live ones (max_decode_len tokens, no EOS, scored
the same way) in the slots after its finished ones.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
TokensToLogits = Callable[[Array, Any], tuple[Array, Any]]
LogitsProcessor = Callable[[Array, Array, Array], Array]
NEG_INF = -1.0e7  # finite, so that sums and comparisons of dead beams stay well defined


def _check(name: str, value: Any, ok: Callable[[np.ndarray], Any], requirement: str) -> None:
  """ValueError unless `value` passes `ok`; traced values (known only inside jit) pass."""
  if isinstance(value, jax.core.Tracer):
    return
  if not np.all(ok(np.asarray(value))):
    raise ValueError(f"{name}={value} must be {requirement}")


def _forced_tokens(decoder_prompt: Array | None, copies: int,
                   max_decode_len: int) -> Array | None:
  """[batch, P] prompt -> int32 [batch * copies, max_decode_len]: the token forced at each
  output position, 0 where none is."""
  if decoder_prompt is None:
    return None
  prompt = jnp.asarray(decoder_prompt, jnp.int32)
  if prompt.ndim != 2 or prompt.shape[1] > max_decode_len:
    raise ValueError(f"decoder_prompt must be [batch, P] with P <= max_decode_len="
                     f"{max_decode_len}; it is {prompt.shape}.")
  prompt = prompt * jnp.cumprod(prompt != 0, axis=1)  # a row's prompt ends at its first 0
  prompt = jnp.pad(prompt, ((0, 0), (0, max_decode_len - prompt.shape[1])))
  return flat_batch_beam_expand(prompt, copies)


# ---- Logits processors ---------------------------------------------------------------------

def min_length_processor(min_length: int | Array, eos_id: int,
                         end_ids: Sequence[int] = ()) -> LogitsProcessor:
  """Bans EOS (and the further `end_ids`) at output positions below `min_length`: at least
  that many tokens come first."""
  _check("min_length", min_length, lambda v: v >= 0, ">= 0")

  def process(logits, step, sequences):
    del sequences
    is_eos = jnp.isin(jnp.arange(logits.shape[-1]), jnp.asarray((eos_id, *end_ids)))
    return jnp.where(is_eos & (step < min_length), NEG_INF, logits)
  return process


def banned_ids_processor(banned_ids: Sequence[int]) -> LogitsProcessor:
  """Never generates the tokens `banned_ids` (ids past the vocabulary are ignored)."""
  ids = np.asarray(banned_ids, np.int32).reshape(-1)
  _check("banned_ids", ids, lambda v: v >= 0, ">= 0")

  def process(logits, step, sequences):
    del step, sequences
    return logits.at[:, ids].set(NEG_INF)
  return process


def repetition_penalty_processor(penalty: float | Array) -> LogitsProcessor:
  """CTRL's repetition penalty (Keskar et al., 2019): each token already in the output has its
  logit divided by `penalty` when positive, multiplied by it when negative (1 = off; > 1
  discourages repeats). Id 0 (padding) is never penalised."""
  _check("repetition_penalty", penalty, lambda v: v > 0, "> 0")

  def process(logits, step, sequences):
    del step
    rows = jnp.arange(logits.shape[0])[:, None]  # [n, 1]
    seen = jnp.zeros(logits.shape, bool).at[rows, sequences].set(True)  # [n, vocab]
    seen = seen.at[:, 0].set(False)  # sequences hold 0 from `step` on
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalised, logits)
  return process


def no_repeat_ngram_processor(ngram_size: int) -> LogitsProcessor:
  """Bans every token that would complete an n-gram of `ngram_size` tokens already in the
  output (Hugging Face's NoRepeatNGramLogitsProcessor over the output tokens; its sequence
  also starts with the decoder start token, which `sequences` does not hold, so n-grams
  through the start token are not banned here). `ngram_size` fixes shapes: a Python int."""
  _check("no_repeat_ngram_size", ngram_size, lambda v: v >= 1, ">= 1")

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
    _check("forced_bos_id", token_id, lambda v: v >= 0, ">= 0")

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
                          forced_bos_id: int | Array = -1,
                          forced_eos: bool = False) -> LogitsProcessor | None:
  """The processor for the `decoding` config's settings (None when all are off), in Hugging
  Face's order: repetition penalty, no-repeat n-grams, banned ids, min length, forced BOS,
  forced EOS."""
  return chain_processors(
      repetition_penalty_processor(repetition_penalty) if repetition_penalty != 1.0 else None,
      no_repeat_ngram_processor(no_repeat_ngram_size) if no_repeat_ngram_size else None,
      banned_ids_processor(banned_ids) if len(banned_ids) else None,
      min_length_processor(min_length, eos_id, end_ids) if min_length else None,
      forced_bos_processor(forced_bos_id) if jnp.ndim(forced_bos_id) or forced_bos_id >= 0
      else None,
      forced_eos_processor(eos_id) if forced_eos else None)


# ---- Greedy and sampling -------------------------------------------------------------------

def _decode_loop(cache: Any, tokens_to_logits: TokensToLogits,
                 choose: Callable[[Array, Array], Array], *, rows: int, bos_id: int | Array,
                 eos_id: int, max_decode_len: int, forced: Array | None,
                 end_ids: Sequence[int] = (),
                 logits_processor: LogitsProcessor | None,
                 row_limits: Array | None = None,
                 token_logprobs: bool = False) -> tuple[Array, ...]:
  """Feeds each chosen token back until every row has produced EOS or max_decode_len tokens
  (or its own `row_limits` [rows] tokens, where given).

  Returns:
    int32 [rows, max_decode_len] tokens, EOS included, zeros after it, and float32 [rows]: each
    row's log-probability (the processed logits' softmax at temperature 1, unfiltered) of its
    chosen tokens, EOS included, forced ones not; with `token_logprobs` also those
    log-probabilities per token, float32 [rows, max_decode_len] (0 for forced and after the end).
  """
  state = _initial_state(cache, rows, bos_id, max_decode_len, token_logprobs)
  body = _decode_step(tokens_to_logits, choose, eos_id=eos_id, forced=forced, end_ids=end_ids,
                      logits_processor=logits_processor, row_limits=row_limits)
  final = _run_steps(state, body, max_decode_len)
  return (final[2], final[4]) + tuple(final[6:])


def _initial_state(cache: Any, rows: int, bos_id: int | Array, max_decode_len: int,
                   token_logprobs: bool) -> tuple:
  """The decode loop's state at step 0: (step, last tokens [rows, 1], sequences, finished,
  summed log-probs, cache[, per-token log-probs])."""
  state = (jnp.array(0), first_inputs(bos_id, rows),
           jnp.zeros((rows, max_decode_len), jnp.int32), jnp.zeros((rows,), jnp.bool_),
           jnp.zeros((rows,), jnp.float32), cache)
  if token_logprobs:
    state += (jnp.zeros((rows, max_decode_len), jnp.float32),)
  return state


def _run_steps(state: tuple, body: Callable[[tuple], tuple], until: int | Array) -> tuple:
  """Runs `body` while the step is below `until` (max_decode_len, or a segment's end) and some
  row is unfinished."""

  def cond(state):
    step, finished = state[0], state[3]
    return (step < until) & ~jnp.all(finished)

  return jax.lax.while_loop(cond, body, state)


def _decode_step(tokens_to_logits: TokensToLogits, choose: Callable[[Array, Array], Array], *,
                 eos_id: int, forced: Array | None, end_ids: Sequence[int],
                 logits_processor: LogitsProcessor | None,
                 row_limits: Array | None) -> Callable[[tuple], tuple]:
  """The decode loop's body: one token per row, state -> state (see `_initial_state`)."""

  def body(state):
    step, last, sequences, finished, logprobs, cache = state[:6]
    logits, cache = tokens_to_logits(last, cache)  # [rows, vocab]
    logits = logits.astype(jnp.float32)
    if logits_processor is not None:
      logits = logits_processor(logits, step, sequences)
    token = choose(logits, step)  # [rows]
    is_forced = jnp.zeros_like(finished)
    if forced is not None:
      forced_token = jax.lax.dynamic_index_in_dim(forced, step, axis=1, keepdims=False)
      is_forced = forced_token != 0
      token = jnp.where(is_forced, forced_token, token)
    token = jnp.where(finished, 0, token)
    chosen_logprob = jnp.where(finished | is_forced, 0.0, token_logprob(logits, token))
    logprobs = logprobs + chosen_logprob
    token = jnp.where(is_forced, token, as_eos(token, eos_id, end_ids))
    sequences = jax.lax.dynamic_update_slice(sequences, token[:, None], (0, step))
    finished = finished | ((token == eos_id) & ~is_forced)
    if row_limits is not None:
      finished = finished | (step + 1 >= row_limits)
    new_state = (step + 1, token[:, None], sequences, finished, logprobs, cache)
    if len(state) > 6:  # the per-token record is carried only where asked for
      new_state += (jax.lax.dynamic_update_slice(state[6], chosen_logprob[:, None], (0, step)),)
    return new_state

  return body


def first_argmax(logits: Array) -> Array:
  """int32 [n]: each row's first most likely id, as jnp.argmax gives it for finite logits.
  A max and a min, which XLA:CPU vectorises, where argmax's (value, index) reduction is not:
  a tenth of a t5-small decoding step at batch 32 (issue #42)."""
  vocab = logits.shape[-1]
  best = jnp.max(logits, axis=-1, keepdims=True)
  ids = jnp.where(logits == best, jnp.arange(vocab, dtype=jnp.int32), vocab)
  return jnp.minimum(jnp.min(ids, axis=-1), vocab - 1)  # NaN logits: the last id


# Tokens per block of `categorical`'s two-level search.
_CDF_BLOCK = 256


def categorical(key: Array, logits: Array) -> Array:
  """int32 ids [...] drawn from softmax(logits [..., vocab]): the distribution of
  jax.random.categorical (other draws), from one uniform number per row where it draws a
  Gumbel number per token (50k random numbers per row per step, most of a CPU sampling step at
  batch 32: benchmarks/RESULTS.md, issue #42). The number is looked up in the cumulative
  distribution, first among blocks of _CDF_BLOCK tokens, then within its block; tokens of zero
  probability (filtered to NEG_INF) are never drawn."""
  return _invert_cdf(logits, 1.0 - jax.random.uniform(key, logits.shape[:-1]))  # (0, 1]


def _invert_cdf(logits: Array, u: Array) -> Array:
  """The first token whose cumulative probability reaches `u` [...] in (0, 1]."""
  vocab = logits.shape[-1]
  block = min(_CDF_BLOCK, vocab)
  weights = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
  weights = jnp.pad(weights, [(0, 0)] * (weights.ndim - 1) + [(0, -vocab % block)])
  weights = weights.reshape(*weights.shape[:-1], -1, block)  # [..., blocks, block]
  sums = jnp.sum(weights, axis=-1)
  ends = jnp.cumsum(sums, axis=-1)  # [..., blocks]
  target = u * ends[..., -1]
  # The first block whose end reaches the target: one of non-zero mass.
  chosen = jnp.minimum(jnp.sum(ends < target[..., None], axis=-1), sums.shape[-1] - 1)
  at = lambda x: jnp.take_along_axis(x, chosen[..., None], axis=-1)[..., 0]
  # Where the target lies in that block, (0, 1] of its mass (rounding kept inside).
  fraction = jnp.clip((target - (at(ends) - at(sums))) / at(sums), jnp.finfo(jnp.float32).tiny,
                      1.0)
  inside = jnp.cumsum(jnp.take_along_axis(weights, chosen[..., None, None], axis=-2)[..., 0, :],
                      axis=-1)  # [..., block]
  within = jnp.sum(inside < (fraction * inside[..., -1])[..., None], axis=-1)
  return (chosen * block + within).astype(jnp.int32)


def token_logprob(logits: Array, token: Array) -> Array:
  """float32 [n]: log_softmax(logits)[row, token[row]], computed as jax.nn.log_softmax does
  (the same bits) without writing out the whole [n, vocab] log-softmax."""
  best = jnp.max(logits, axis=-1, keepdims=True)
  log_sum = jnp.log(jnp.sum(jnp.exp(logits - best), axis=-1, keepdims=True))
  return (jnp.take_along_axis(logits, token[:, None], axis=-1) - best - log_sum)[:, 0]


def as_eos(tokens: Array, eos_id: int, end_ids: Sequence[int]) -> Array:
  """`tokens` with each of the further `end_ids` (a checkpoint's other end tokens, e.g.
  Llama 3's <|eot_id|> beside <|end_of_text|>) replaced by `eos_id`: outputs end one way."""
  if not len(end_ids):
    return tokens
  return jnp.where(jnp.isin(tokens, jnp.asarray(end_ids, jnp.int32)), eos_id, tokens)


def first_inputs(bos_id: int | Array, rows: int) -> Array:
  """[rows, 1] first decoder inputs: one id for every row, or one per input ([batch] ids,
  e.g. each prompt's last token) repeated over its consecutive rows (beams, samples)."""
  ids = jnp.reshape(jnp.asarray(bos_id, jnp.int32), (-1,))
  return jnp.repeat(ids, rows // ids.shape[0])[:, None]


def greedy_search(cache: Any, tokens_to_logits: TokensToLogits, *, batch_size: int,
                  bos_id: int | Array, eos_id: int, max_decode_len: int,
                  return_logprobs: bool = False, end_ids: Sequence[int] = (),
                  decoder_prompt: Array | None = None,
                  logits_processor: LogitsProcessor | None = None):
  """Most likely token at every step. Returns [batch, max_decode_len] tokens (and their
  log-probabilities [batch] with `return_logprobs`). Options: see the module docstring."""
  _check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  choose = lambda logits, step: first_argmax(logits)
  tokens, logprobs = _decode_loop(
      cache, tokens_to_logits, choose, rows=batch_size, bos_id=bos_id, eos_id=eos_id,
      end_ids=end_ids, max_decode_len=max_decode_len, logits_processor=logits_processor,
      forced=_forced_tokens(decoder_prompt, 1, max_decode_len))
  return (tokens, logprobs) if return_logprobs else tokens


def _check_filter(top_k: int, top_p: float | Array) -> None:
  _check("top_k", top_k, lambda v: v >= 0, ">= 0")
  _check("top_p", top_p, lambda v: (v > 0) & (v <= 1), "in (0, 1]")


def filter_logits(logits: Array, top_k: int | Array = 0, top_p: float | Array = 1.0) -> Array:
  """Keeps the `top_k` most likely tokens (0 = all), then the smallest set whose probability
  reaches `top_p` in (0, 1] (the nucleus); every other logit becomes NEG_INF.

  A Python int `top_k` fixes a shape (lax.top_k); `top_p` may be traced (a Python 1.0 skips
  the nucleus sort). Either may also be an array [n], one value per row of `logits` (a
  server's batch of requests with their own settings): each sort then runs only when some
  row needs it.
  """
  _check_filter(top_k, top_p)
  if isinstance(top_k, (int, np.integer)):
    if top_k > 0:
      kth_best = jax.lax.top_k(logits, top_k)[0][..., -1:]  # [n, 1]
      logits = jnp.where(logits < kth_best, NEG_INF, logits)
  else:
    logits = jax.lax.cond(jnp.any(top_k > 0), _top_k_per_row, lambda x, k: x, logits, top_k)
  if jnp.ndim(top_p) == 1:
    top_p = jnp.asarray(top_p, jnp.float32)[:, None]  # [n, 1]
    return jax.lax.cond(jnp.all(top_p >= 1.0), lambda x, p: x, _nucleus, logits, top_p)
  if not (isinstance(top_p, (int, float)) and top_p >= 1.0):
    logits = _nucleus(logits, top_p)
  return logits


def _top_k_per_row(logits: Array, top_k: Array) -> Array:
  """Keeps each row's `top_k[row]` most likely tokens (0 = all)."""
  descending = jnp.sort(logits, axis=-1)[..., ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, logits.shape[-1]), logits.shape[-1])
  kth_best = jnp.take_along_axis(descending, (k - 1)[:, None].astype(jnp.int32), axis=-1)
  return jnp.where(logits < kth_best, NEG_INF, logits)


def _nucleus(logits: Array, top_p: float | Array) -> Array:
  """Keeps the smallest set of tokens whose probability reaches `top_p` (scalar or [n, 1])."""
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  # A token is in the nucleus if the tokens ranked above it hold less than top_p.
  mass_above = jnp.cumsum(probs, axis=-1) - probs
  in_nucleus = mass_above < top_p
  threshold = jnp.min(jnp.where(in_nucleus, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < threshold, NEG_INF, logits)


def sample(cache: Any, tokens_to_logits: TokensToLogits, rng: Array, *, batch_size: int,
           bos_id: int | Array, eos_id: int, max_decode_len: int,
           temperature: float | Array = 1.0, top_k: int | Array = 0,
           top_p: float | Array = 1.0, return_logprobs: bool = False,
           end_ids: Sequence[int] = (), num_decodes: int | None = None,
           decoder_prompt: Array | None = None,
           logits_processor: LogitsProcessor | None = None,
           row_limits: Array | None = None, return_token_logprobs: bool = False):
  """Samples from softmax(filter_logits(logits / temperature)), seeded by `rng`.

  `temperature` >= 0 (0 is greedy) and `top_p` in (0, 1] may be traced scalars: one
  compilation serves every value. top_k=1 is greedy too. `temperature`, `top_k` and `top_p`
  may also be arrays [batch_size], one setting per input row (a server batching requests with
  different settings into one program).

  Args:
    cache: decoder cache for `batch_size` rows (expanded to batch * num_decodes here).
    tokens_to_logits: ([rows, 1] ids, cache) -> ([rows, vocab] logits, cache).
    rng: PRNG key, or a key per input row ([batch_size] keys): then each row (and each of its
      `num_decodes` samples) draws from its own key, so a row's samples do not depend on the
      other rows of the batch.
    batch_size: rows of the cache (inputs).
    bos_id: first decoder input token, or one per input row ([batch_size] ids).
    eos_id: end-of-sequence id.
    end_ids: further ids that end an output as `eos_id` does (shown as `eos_id` in it).
    max_decode_len: output length in tokens, EOS included.
    temperature, top_k, top_p: see above.
    return_logprobs: also return each output's log-probability under the (processed) model
      at temperature 1, unfiltered, forced tokens excluded.
    num_decodes: None: one sample per row, [batch, max_decode_len]. An int: that many samples
      per row, [batch, num_decodes, max_decode_len], most likely first (callers expand their
      per-example inputs with `flat_batch_beam_expand(x, num_decodes)`).
    decoder_prompt, logits_processor: see the module docstring.
    row_limits: None, or int [batch_size]: each input row's longest output (<=
      max_decode_len); its output ends there.
    return_token_logprobs: also return each chosen token's log-probability (as
      `return_logprobs` scores them), float32 [..., max_decode_len].

  Returns:
    int32 tokens (zeros after EOS), with `return_logprobs` float32 log-probabilities of the
    leading shape, with `return_token_logprobs` the per-token ones, in that order.
  """
  _check("temperature", temperature, lambda v: v >= 0, ">= 0")
  _check("num_decodes", 1 if num_decodes is None else num_decodes, lambda v: v >= 1, ">= 1")
  _check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  _check_filter(top_k, top_p)
  copies = num_decodes or 1
  if num_decodes is not None:
    cache = expand_cache(cache, num_decodes)
  choose = _sampling_chooser(rng, batch_size, copies, temperature, top_k, top_p)
  tokens, logprobs, *per_token = _decode_loop(
      cache, tokens_to_logits, choose, rows=batch_size * copies, bos_id=bos_id, eos_id=eos_id,
      end_ids=end_ids, max_decode_len=max_decode_len, logits_processor=logits_processor,
      forced=_forced_tokens(decoder_prompt, copies, max_decode_len),
      row_limits=None if row_limits is None else jnp.repeat(row_limits, copies),
      token_logprobs=return_token_logprobs)
  if num_decodes is not None:
    tokens = tokens.reshape(batch_size, num_decodes, max_decode_len)
    logprobs = logprobs.reshape(batch_size, num_decodes)
    per_token = [x.reshape(batch_size, num_decodes, max_decode_len) for x in per_token]
    order = jnp.argsort(-logprobs, axis=1)  # [batch, num_decodes], most likely first
    tokens = jnp.take_along_axis(tokens, order[:, :, None], axis=1)
    logprobs = jnp.take_along_axis(logprobs, order, axis=1)
    per_token = [jnp.take_along_axis(x, order[:, :, None], axis=1) for x in per_token]
  return (tokens, *([logprobs] if return_logprobs else []), *per_token) if (
      return_logprobs or return_token_logprobs) else tokens


def _sampling_chooser(rng: Array, batch_size: int, copies: int, temperature, top_k, top_p):
  """choose(logits, step) -> ids for `sample`'s settings (scalars, or arrays [batch_size])."""
  draw = _row_sampler(rng, batch_size, copies)
  if jnp.ndim(temperature) == 1:
    return _per_row_chooser(draw, *(
        jnp.repeat(jnp.broadcast_to(jnp.asarray(x), (batch_size,)), copies)
        for x in (temperature, top_k, top_p)))
  temperature = jnp.asarray(temperature, jnp.float32)
  greedy = temperature == 0

  def choose(logits, step):
    scaled = filter_logits(logits / jnp.where(greedy, 1.0, temperature), top_k, top_p)
    sampled = draw(scaled, step)
    return jnp.where(greedy, first_argmax(logits), sampled).astype(jnp.int32)
  return choose


def _per_row_chooser(draw, temperature: Array, top_k: Array, top_p: Array):
  """choose(logits, step) for rows with their own temperature, top_k and top_p ([rows]):
  argmax where the temperature is 0, and no sampling at all when every row's is."""
  temperature = temperature.astype(jnp.float32)
  greedy = temperature == 0

  def sampled(logits, step):
    scale = jnp.where(greedy, 1.0, temperature)[:, None]
    token = draw(filter_logits(logits / scale, top_k.astype(jnp.int32), top_p), step)
    return jnp.where(greedy, first_argmax(logits), token).astype(jnp.int32)

  def choose(logits, step):
    return jax.lax.cond(jnp.all(greedy),
                        lambda x, s: first_argmax(x), sampled,
                        logits, step)
  return choose


def _row_sampler(rng: Array, batch_size: int, copies: int):
  """draw(scaled logits [batch * copies, vocab], step) -> sampled ids, from one key for the
  whole batch, or from `rng`'s key per input row (row b's copy c: fold_in(rng[b], c))."""
  typed = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key)
  if jnp.ndim(rng) == (0 if typed else 1):
    return lambda scaled, step: categorical(jax.random.fold_in(rng, step), scaled)
  copy_keys = jax.vmap(lambda key: jax.vmap(lambda c: jax.random.fold_in(key, c))(
      jnp.arange(copies)))(rng)  # [batch, copies] keys
  flat = copy_keys.reshape((batch_size * copies,) + copy_keys.shape[2:])
  one = lambda key, step, logits: categorical(jax.random.fold_in(key, step), logits)
  return lambda scaled, step: jax.vmap(one, in_axes=(0, None, 0))(flat, step, scaled)


# ---- Sampling in segments (a server streaming tokens while it decodes) ---------------------

def start_sampling(cache: Any, *, batch_size: int, bos_id: int | Array,
                   max_decode_len: int) -> tuple:
  """The state `sample_steps` advances: `sample`'s loop state at step 0 (one sample per row,
  per-token log-probabilities kept), a tuple of arrays a compiled function can take and
  return (donated, so that the cache is updated in place)."""
  _check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  return _initial_state(cache, batch_size, bos_id, max_decode_len, token_logprobs=True)


def sample_steps(state: tuple, tokens_to_logits: TokensToLogits, rng: Array, *,
                 steps: int | Array, eos_id: int, temperature: float | Array = 1.0,
                 top_k: int | Array = 0,
                 top_p: float | Array = 1.0, end_ids: Sequence[int] = (),
                 logits_processor: LogitsProcessor | None = None,
                 row_limits: Array | None = None) -> tuple:
  """`state` (from `start_sampling`) advanced by up to `steps` tokens, or fewer where every
  row finishes first. Runs `sample`'s own loop body, so that segments of any size compute
  what one `sample(..., return_logprobs=True, return_token_logprobs=True)` call computes for
  the same arguments (one sample per row, no decoder_prompt); `rng` as `sample`'s.
  (Compiled apart, XLA may sum in another order where the callback's inputs are arguments
  rather than values of the same program: last-bit differences, docs/serving.md.)"""
  _check("temperature", temperature, lambda v: v >= 0, ">= 0")
  _check_filter(top_k, top_p)
  rows = state[1].shape[0]
  choose = _sampling_chooser(rng, rows, 1, temperature, top_k, top_p)
  body = _decode_step(tokens_to_logits, choose, eos_id=eos_id, forced=None, end_ids=end_ids,
                      logits_processor=logits_processor, row_limits=row_limits)
  until = jnp.minimum(state[0] + steps, state[2].shape[1])
  return _run_steps(state, body, until)


def sampling_progress(state: tuple) -> tuple[Array, Array, Array, Array, Array]:
  """(step, finished [rows], tokens [rows, max_decode_len], summed log-probs [rows], per-token
  log-probs [rows, max_decode_len]) of a `start_sampling` / `sample_steps` state: the tokens
  so far (zeros from `step` on and after each row's end)."""
  return state[0], state[3], state[2], state[4], state[6]


# ---- Beam search ---------------------------------------------------------------------------

LENGTH_PENALTIES = ("gnmt", "hf")


def length_penalty(length: Array, alpha: float | Array, kind: str = "gnmt") -> Array:
  """What beam search divides a hypothesis's log-probability by; `length` counts its output
  tokens, EOS included.

  'gnmt': ((5 + length) / 6) ** alpha (Wu et al., 2016). 'hf': length ** alpha, Hugging
  Face's `length_penalty` (transformers v5 `_beam_search` divides by
  (cur_len + 1 - decoder_prompt_len) ** length_penalty: the tokens generated after the
  decoder start token, EOS included, which is `length` here; a decoder prompt counts in
  `length`, where Hugging Face leaves its decoder_input_ids out).
  """
  if kind not in LENGTH_PENALTIES:
    raise ValueError(f"length penalty kind={kind!r} must be one of {LENGTH_PENALTIES}")
  length = jnp.asarray(length, jnp.float32)
  return (length if kind == "hf" else (5.0 + length) / 6.0) ** alpha


def flat_batch_beam_expand(x: Array, beam_size: int) -> Array:
  """[batch, ...] -> [batch * beam, ...], each row repeated beam_size times."""
  return jnp.repeat(x, beam_size, axis=0)


def expand_cache(cache: Any, beam_size: int) -> Any:
  # Scalars (cache indices) are shared by all rows.
  return jax.tree.map(lambda x: x if x.ndim == 0 else flat_batch_beam_expand(x, beam_size),
                      cache)


def _gather_beams(tree: Any, beam_indices: Array) -> Any:
  """Picks beams [batch, new_beam] from trees whose leaves are [batch, old_beam, ...]."""
  return jax.tree.map(lambda x: jnp.take_along_axis(
      x, beam_indices.reshape(beam_indices.shape + (1,) * (x.ndim - 2)), axis=1), tree)


def _beam_rows(beam_indices: Array, old_beam: int) -> Array:
  """[batch, new_beam] beams of each example -> their rows [batch * new_beam] of a flat
  [batch * old_beam, ...] array."""
  batch_size = beam_indices.shape[0]
  return (jnp.arange(batch_size)[:, None] * old_beam + beam_indices).reshape(-1)


def _gather_rows(cache: Any, rows: Array) -> Any:
  """Like `_gather_beams` for a flat [batch * beam, ...] cache: one row gather per leaf.
  (Indices are always in range; 'clip' spares the out-of-range select over every element that
  take_along_axis's default adds, a copy of the whole cache per step.)"""
  return jax.tree.map(lambda x: x if x.ndim == 0 else jnp.take(x, rows, axis=0, mode="clip"),
                      cache)


def beam_search(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits, *,
                beam_size: int, alpha: float | Array, eos_id: int,
                max_decode_len: int | None = None, bos_id: int | Array = 2,
                end_ids: Sequence[int] = (), decoder_prompt: Array | None = None,
                logits_processor: LogitsProcessor | None = None,
                length_penalty_kind: str = "gnmt",
                reorder_cache: Callable[[Any, Array], Any] | None = None,
                expand_beams: Callable[[Any, int], Any] | None = None
                ) -> tuple[Array, Array]:
  """Beam search with a length penalty, live and finished hypotheses apart (the module
  docstring says how).

  Args:
    inputs: [batch, src_len] source tokens; give the batch size and the default length.
    cache: decoder cache for `batch` rows (expanded to batch * beam here).
    tokens_to_logits: ([batch*beam, 1] ids, flat cache) -> ([batch*beam, vocab] logits, cache).
    beam_size: hypotheses kept per example.
    alpha: length-penalty exponent (0 = plain log-probability; the paper uses 0.6); may be
      traced.
    length_penalty_kind: 'gnmt' or 'hf' (Hugging Face's); see `length_penalty`.
    eos_id: end-of-sequence id.
    max_decode_len: longest output in tokens, EOS included; default source length + 50.
    bos_id: first decoder input token, or one per input row ([batch_size] ids).
    end_ids: further ids that end an output as `eos_id` does (shown as `eos_id` in it).
    decoder_prompt, logits_processor: see the module docstring (`sequences` holds the live
      hypotheses, [batch*beam, max_decode_len]).
    reorder_cache: (cache, rows [batch*beam]) -> the cache whose row r goes on with the
      hypothesis of row rows[r]; None: every leaf's rows gathered. (A model that reads its
      keys and values through per-row slot offsets moves only those:
      kv_cache.reorder_beams.)
    expand_beams: (cache, beam) -> the cache for batch * beam rows; None: `expand_cache`,
      every leaf's rows repeated. (kv_cache.expand_beams skips the leaves that
      kv_cache.with_beam_slots made per beam already.)

  Returns:
    sequences int32 [batch, beam, max_decode_len] (zeros after EOS) and scores float32
    [batch, beam]: finished hypotheses best first, then live ones best first; slots never
    filled are zeros scoring NEG_INF. Log-probs <= NEG_INF / 2 count as impossible.
  """
  _check("beam_size", beam_size, lambda v: v >= 1, ">= 1")
  penalty = lambda num_tokens: length_penalty(num_tokens, alpha, length_penalty_kind)
  batch_size = inputs.shape[0]
  if max_decode_len is None:
    max_decode_len = inputs.shape[1] + 50
  _check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  k, length = beam_size, max_decode_len
  forced = _forced_tokens(decoder_prompt, 1, length)  # [batch, length] or None
  state = _initial_beams(batch_size, k, length, bos_id, (expand_beams or expand_cache)(cache, k))
  cond = lambda state: _still_searching(state, penalty, length)

  def body(state):
    step, live_seqs, live_logprobs, finished_seqs, finished_scores, cache = state
    last = jax.lax.dynamic_index_in_dim(live_seqs, step, axis=2, keepdims=False)  # [batch, k]
    logits, cache = tokens_to_logits(last.reshape(batch_size * k, 1), cache)  # [batch*k, V]
    logits = logits.astype(jnp.float32)
    if logits_processor is not None:
      logits = logits_processor(logits, step, live_seqs[:, :, 1:].reshape(batch_size * k, -1))
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits).reshape(batch_size, k, vocab)
    log_probs, is_forced = _force_prompt(log_probs, forced, step)

    candidates = (live_logprobs[:, :, None] + log_probs).reshape(batch_size, k * vocab)
    top_logprobs, top_indices = jax.lax.top_k(candidates, 2 * k)  # [batch, 2k], best first
    top_beams, top_tokens = top_indices // vocab, (top_indices % vocab).astype(jnp.int32)
    top_tokens = jnp.where(is_forced[:, None], top_tokens, as_eos(top_tokens, eos_id, end_ids))
    top_seqs = _gather_beams(live_seqs, top_beams)  # [batch, 2k, length + 1]
    top_seqs = jax.lax.dynamic_update_slice(top_seqs, top_tokens[:, :, None], (0, 0, step + 1))
    possible = top_logprobs > NEG_INF / 2
    ends = possible & (top_tokens == eos_id) & ~is_forced[:, None]  # [batch, 2k]

    # Live: the k best that did not end.
    live_logprobs, keep = jax.lax.top_k(jnp.where(possible & ~ends, top_logprobs, NEG_INF), k)
    live_seqs = _gather_beams(top_seqs, keep)
    cache = (reorder_cache or _gather_rows)(cache, _beam_rows(_gather_beams(top_beams, keep), k))
    # Finished: the k best of the old ones and those that ended now.
    new_scores = jnp.where(ends, top_logprobs / penalty(step + 1), NEG_INF)
    finished_scores, keep = jax.lax.top_k(
        jnp.concatenate([finished_scores, new_scores], axis=1), k)  # [batch, k] of 3k
    finished_seqs = _gather_beams(jnp.concatenate([finished_seqs, top_seqs], axis=1), keep)
    return step + 1, live_seqs, live_logprobs, finished_seqs, finished_scores, cache

  _, live_seqs, live_logprobs, finished_seqs, finished_scores, _ = jax.lax.while_loop(
      cond, body, state)
  sequences, scores = _fill_with_live(live_seqs, live_logprobs, penalty(length),
                                      finished_seqs, finished_scores)
  return sequences[:, :, 1:], scores


def _initial_beams(batch_size: int, k: int, length: int, bos_id: int | Array,
                   cache: Any) -> tuple:
  """Beam search's loop state at step 0: (step, live sequences [batch, k, length + 1] (the
  bos at position 0, which the output drops), their log-probs, finished sequences, their
  scores, the cache, expanded to k beams already)."""
  live_seqs = jnp.zeros((batch_size, k, length + 1), jnp.int32).at[:, :, 0].set(
      first_inputs(bos_id, batch_size * k).reshape(batch_size, k))
  # Only the first beam is alive at the start, so the first step does not pick k copies.
  live_logprobs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch_size, 1))
  return (jnp.array(0), live_seqs, live_logprobs, jnp.zeros_like(live_seqs),
          jnp.full((batch_size, k), NEG_INF, jnp.float32), cache)


def _still_searching(state: tuple, penalty: Callable[[Array], Array], length: int) -> Array:
  """Whether beam search goes on: below `length`, and some example may still improve."""
  step, _, live_logprobs, _, finished_scores, _ = state
  best_live = live_logprobs[:, 0]  # [batch]: live beams are sorted, best first
  # A live hypothesis ends with a length in (step, max_decode_len] and a lower log-prob.
  bound = jnp.maximum(best_live / penalty(step + 1), best_live / penalty(length))
  worst_finished = finished_scores[:, -1]  # NEG_INF while a slot is free
  done = ((worst_finished > NEG_INF / 2) & (worst_finished > bound)) | (
      best_live <= NEG_INF / 2)
  return (step < length) & ~jnp.all(done)


def _force_prompt(log_probs: Array, forced: Array | None, step: Array) -> tuple[Array, Array]:
  """[batch, k, vocab] log-probs where a row's decoder prompt forces the token at `step`: 0
  for it (a forced token costs nothing), impossible for every other; and which rows are
  forced [batch]."""
  if forced is None:
    return log_probs, jnp.zeros(log_probs.shape[:1], jnp.bool_)
  forced_token = jax.lax.dynamic_index_in_dim(forced, step, axis=1, keepdims=False)
  is_forced = forced_token != 0  # [batch]
  vocab = log_probs.shape[-1]
  only_forced = jnp.where(jnp.arange(vocab) == forced_token[:, None], 0.0, NEG_INF)
  return jnp.where(is_forced[:, None, None], only_forced[:, None, :], log_probs), is_forced


def _fill_with_live(live_seqs: Array, live_logprobs: Array, live_penalty: Array,
                    finished_seqs: Array, finished_scores: Array) -> tuple[Array, Array]:
  """The finished hypotheses, best first, then the live ones (scored log-prob /
  `live_penalty`) in the free slots; slots never filled are zeros scoring NEG_INF. (Live
  ones are left only when the loop ran to max_decode_len: an early stop needs every slot
  taken or nothing live.)"""
  k = finished_scores.shape[1]
  num_finished = jnp.sum(finished_scores > NEG_INF / 2, axis=1)  # [batch]
  live_index = jnp.arange(k)[None, :] - num_finished[:, None]  # [batch, k]; < 0: finished
  take = jnp.clip(live_index, 0, k - 1)
  live_scores = jnp.where(live_logprobs > NEG_INF / 2, live_logprobs / live_penalty, NEG_INF)
  use_live = live_index >= 0
  sequences = jnp.where(use_live[:, :, None], _gather_beams(live_seqs, take), finished_seqs)
  scores = jnp.where(use_live, jnp.take_along_axis(live_scores, take, axis=1), finished_scores)
  return jnp.where(scores[:, :, None] > NEG_INF / 2, sequences, 0), scores
