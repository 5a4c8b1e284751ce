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

# The searches' whole interface, importable from here as users have it
# (`transformer_jax.decoding.beam_search`).
from transformer_jax.inference.beam_search import (  # noqa: F401
    LENGTH_PENALTIES, beam_search, length_penalty)
from transformer_jax.inference.logits_processors import (  # noqa: F401
    NO_TOKEN, banned_ids_processor, chain_processors, forced_bos_processor,
    forced_eos_processor, make_logits_processor, min_length_processor, min_tokens_processor,
    no_repeat_ngram_processor, only_where, openai_penalties_processor,
    repetition_penalty_processor)
from transformer_jax.inference.search_basics import (  # noqa: F401
    NEG_INF, Array, LogitsProcessor, TokensToLogits, as_eos, check, expand_cache,
    first_argmax, first_inputs, flat_batch_beam_expand, forced_tokens, token_logprob)

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

  def cond(state):  # `step` and `until` are scalars, or per row (`start_rows`)
    step, finished = state[0], state[3]
    return jnp.any((step < until) & ~finished)

  return jax.lax.while_loop(cond, body, state)


def _decode_step(tokens_to_logits: TokensToLogits, choose: Callable[[Array, Array], Array], *,
                 eos_id: int, forced: Array | None, end_ids: Sequence[int],
                 logits_processor: LogitsProcessor | None,
                 row_limits: Array | None,
                 row_processor: LogitsProcessor | None = None) -> Callable[[tuple], tuple]:
  """The decode loop's body: one token per row, state -> state (see `_initial_state`).
  `row_processor` (first) takes the whole batch whatever the step's shape; `logits_processor`
  is given one row at a time where each row is at its own step."""

  def body(state):
    step, last, sequences, finished, logprobs, cache = state[:6]
    per_row = jnp.ndim(step) == 1  # each row at its own step (`start_rows`)
    logits, cache = tokens_to_logits(last, cache)  # [rows, vocab]
    logits = logits.astype(jnp.float32)
    if row_processor is not None:
      logits = row_processor(logits, step, sequences)
    if logits_processor is not None:
      logits = (jax.vmap(lambda x, at, seq: logits_processor(x[None], at, seq[None])[0])(
          logits, step, sequences) if per_row else logits_processor(logits, step, sequences))
    token = choose(logits, step)  # [rows]
    is_forced = jnp.zeros_like(finished)
    if forced is not None:
      forced_token = (jnp.take_along_axis(forced, step[:, None], axis=1, mode="clip")[:, 0]
                      if per_row else
                      jax.lax.dynamic_index_in_dim(forced, step, axis=1, keepdims=False))
      is_forced = forced_token != 0
      token = jnp.where(is_forced, forced_token, token)
    token = jnp.where(finished, 0, token)
    chosen_logprob = jnp.where(finished | is_forced, 0.0, token_logprob(logits, token))
    logprobs = logprobs + chosen_logprob
    token = jnp.where(is_forced, token, as_eos(token, eos_id, end_ids))
    sequences = _write_at(sequences, token, step)
    finished = finished | ((token == eos_id) & ~is_forced)
    if row_limits is not None:
      finished = finished | (step + 1 >= row_limits)
    if per_row:  # the loop runs on for other rows: a row ends where its record does
      finished = finished | (step + 1 >= sequences.shape[1])
    new_state = (step + 1, token[:, None], sequences, finished, logprobs, cache)
    if len(state) > 6:  # the per-token record is carried only where asked for
      new_state += (_write_at(state[6], chosen_logprob, step),)
    return new_state

  return body


def _write_at(record: Array, values: Array, step: Array) -> Array:
  """`record` [rows, length] with `values` [rows] written at column `step`: one for all rows,
  or each row's own ([rows])."""
  if jnp.ndim(step) == 0:
    return jax.lax.dynamic_update_slice(record, values[:, None], (0, step))
  return jnp.where(jnp.arange(record.shape[1])[None, :] == step[:, None], values[:, None],
                   record)


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


def greedy_search(cache: Any, tokens_to_logits: TokensToLogits, *, batch_size: int,
                  bos_id: int | Array, eos_id: int, max_decode_len: int,
                  return_logprobs: bool = False, end_ids: Sequence[int] = (),
                  decoder_prompt: Array | None = None,
                  logits_processor: LogitsProcessor | None = None):
  """Most likely token at every step. Returns [batch, max_decode_len] tokens (and their
  log-probabilities [batch] with `return_logprobs`). Options: see the module docstring."""
  check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  choose = lambda logits, step: first_argmax(logits)
  tokens, logprobs = _decode_loop(
      cache, tokens_to_logits, choose, rows=batch_size, bos_id=bos_id, eos_id=eos_id,
      end_ids=end_ids, max_decode_len=max_decode_len, logits_processor=logits_processor,
      forced=forced_tokens(decoder_prompt, 1, max_decode_len))
  return (tokens, logprobs) if return_logprobs else tokens


# Top-k and the nucleus are found among each row's CANDIDATES best tokens (lax.top_k, about
# 5 ms for 32 rows of a 49k vocabulary on a 2-core CPU), and by a full sort (250 ms there:
# three times a 135M-parameter model's step) only where some row's reach past them.
CANDIDATES = 256


def _check_filter(top_k: int, top_p: float | Array) -> None:
  check("top_k", top_k, lambda v: v >= 0, ">= 0")
  check("top_p", top_p, lambda v: (v > 0) & (v <= 1), "in (0, 1]")


def filter_logits(logits: Array, top_k: int | Array = 0, top_p: float | Array = 1.0) -> Array:
  """Keeps the `top_k` most likely tokens (0 = all), then the smallest set whose probability
  reaches `top_p` in (0, 1] (the nucleus); every other logit becomes NEG_INF.

  A Python int `top_k` fixes a shape (lax.top_k); `top_p` may be traced (a Python 1.0 skips
  the nucleus). Either may also be an array [n], one value per row of `logits` (a server's
  batch of requests with their own settings): each filter then runs only when some row
  needs it. Both look among the CANDIDATES best tokens first; the vocabulary is sorted only
  where some row's nucleus (or top_k) reaches past them.
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
  kth_best = lambda descending: jnp.take_along_axis(
      descending, jnp.clip(top_k - 1, 0, descending.shape[-1] - 1)[:, None], axis=-1)
  within = jnp.all(top_k <= min(CANDIDATES, logits.shape[-1]))
  kth = jax.lax.cond(within, lambda x: kth_best(_most_likely(x)),
                     lambda x: kth_best(_descending(x)), logits)
  return jnp.where((top_k[:, None] > 0) & (logits < kth), NEG_INF, logits)


def _nucleus(logits: Array, top_p: float | Array) -> Array:
  """Keeps the smallest set of tokens whose probability reaches `top_p` (scalar or [n, 1]; a
  row at 1 keeps every token)."""
  log_total = jax.nn.logsumexp(logits, axis=-1, keepdims=True)

  def threshold(descending):  # the lowest logit kept, from the best logits in order
    probs = jnp.exp(descending - log_total)
    # A token is in the nucleus if the tokens ranked above it hold less than top_p.
    in_nucleus = (jnp.cumsum(probs, axis=-1) - probs < top_p) & (top_p < 1.0)
    lowest = jnp.min(jnp.where(in_nucleus, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(top_p < 1.0, lowest, -jnp.inf), in_nucleus[..., -1:]

  # Each row's from the candidates where its nucleus ends among them, else from all tokens:
  # a row's result never depends on the other rows'.
  among_candidates, past_them = threshold(_most_likely(logits))
  everywhere = lambda x: jnp.where(past_them, threshold(_descending(x))[0], among_candidates)
  threshold_logit = jax.lax.cond(jnp.any(past_them), everywhere, lambda x: among_candidates,
                                 logits)
  return jnp.where(logits < threshold_logit, NEG_INF, logits)


def _most_likely(logits: Array) -> Array:
  """[n, m] the m = CANDIDATES best logits of each row, best first."""
  return jax.lax.top_k(logits, min(CANDIDATES, logits.shape[-1]))[0]


def _descending(logits: Array) -> Array:
  return jnp.sort(logits, axis=-1)[..., ::-1]


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
  check("temperature", temperature, lambda v: v >= 0, ">= 0")
  check("num_decodes", 1 if num_decodes is None else num_decodes, lambda v: v >= 1, ">= 1")
  check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  _check_filter(top_k, top_p)
  copies = num_decodes or 1
  if num_decodes is not None:
    cache = expand_cache(cache, num_decodes)
  choose = _sampling_chooser(rng, batch_size, copies, temperature, top_k, top_p)
  tokens, logprobs, *per_token = _decode_loop(
      cache, tokens_to_logits, choose, rows=batch_size * copies, bos_id=bos_id, eos_id=eos_id,
      end_ids=end_ids, max_decode_len=max_decode_len, logits_processor=logits_processor,
      forced=forced_tokens(decoder_prompt, copies, max_decode_len),
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
  return lambda scaled, step: jax.vmap(one, in_axes=(0, 0 if jnp.ndim(step) else None, 0))(
      flat, step, scaled)


# ---- Sampling in segments (a server streaming tokens while it decodes) ---------------------

def start_sampling(cache: Any, *, batch_size: int, bos_id: int | Array,
                   max_decode_len: int) -> tuple:
  """The state `sample_steps` advances: `sample`'s loop state at step 0 (one sample per row,
  per-token log-probabilities kept), a tuple of arrays a compiled function can take and
  return (donated, so that the cache is updated in place)."""
  check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  return _initial_state(cache, batch_size, bos_id, max_decode_len, token_logprobs=True)


def sample_steps(state: tuple, tokens_to_logits: TokensToLogits, rng: Array, *,
                 steps: int | Array, eos_id: int, temperature: float | Array = 1.0,
                 top_k: int | Array = 0,
                 top_p: float | Array = 1.0, end_ids: Sequence[int] = (),
                 logits_processor: LogitsProcessor | None = None,
                 row_limits: Array | None = None, forced: Array | None = None,
                 row_processor: LogitsProcessor | None = None) -> tuple:
  """`state` (from `start_sampling`, or `start_rows`: each row `steps` further) advanced by up
  to `steps` tokens, or fewer where every row finishes first. Runs `sample`'s own loop body,
  so that segments of any size compute what one
  `sample(..., return_logprobs=True, return_token_logprobs=True)` call computes for the same
  arguments (one sample per row, no decoder_prompt); `rng` as `sample`'s.
  (Compiled apart, XLA may sum in another order where the callback's inputs are arguments
  rather than values of the same program: last-bit differences, docs/serving.md.)
  `forced`: int [rows, max_decode_len], the token forced at each step of each row, 0 where
  none is (`forced_tokens`). `row_processor`: a processor of the whole batch, before
  `logits_processor` (per-row settings: `openai_penalties_processor`)."""
  check("temperature", temperature, lambda v: v >= 0, ">= 0")
  _check_filter(top_k, top_p)
  rows = state[1].shape[0]
  choose = _sampling_chooser(rng, rows, 1, temperature, top_k, top_p)
  body = _decode_step(tokens_to_logits, choose, eos_id=eos_id, forced=forced, end_ids=end_ids,
                      logits_processor=logits_processor, row_limits=row_limits,
                      row_processor=row_processor)
  until = jnp.minimum(state[0] + steps, state[2].shape[1])
  return _run_steps(state, body, until)


def start_rows(cache: Any, *, rows: int, max_decode_len: int) -> tuple:
  """A `sample_steps` state for a pool of `rows` slots that each decode from their own step
  (continuous batching): every slot empty (finished) until `refill_rows` gives it a prompt."""
  state = start_sampling(cache, batch_size=rows, bos_id=0, max_decode_len=max_decode_len)
  return (jnp.zeros((rows,), jnp.int32),) + state[1:3] + (jnp.ones((rows,), jnp.bool_),) + (
      state[4:])


def refill_rows(state: tuple, cache: Any, row_ids: Array, first_tokens: Array) -> tuple:
  """A `start_rows` state whose rows `row_ids` [k] start afresh from `first_tokens` [k] with
  `cache` (the runner's refill of those rows); the other rows go on as they were. Ids past
  the last row are dropped (padding of a bucketed k)."""
  def reset(x, value):
    return x.at[row_ids].set(value, mode="drop")
  step, last, sequences, finished, logprobs, _, token_logprobs = state
  return (reset(step, 0), reset(last, first_tokens[:, None]), reset(sequences, 0),
          reset(finished, False), reset(logprobs, 0.0), cache, reset(token_logprobs, 0.0))


def sampling_progress(state: tuple) -> tuple[Array, Array, Array, Array, Array]:
  """(step, finished [rows], tokens [rows, max_decode_len], summed log-probs [rows], per-token
  log-probs [rows, max_decode_len]) of a `start_sampling` / `sample_steps` state: the tokens
  so far (zeros from `step` on and after each row's end)."""
  return state[0], state[3], state[2], state[4], state[6]
