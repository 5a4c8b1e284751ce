"""Autoregressive decoding over a model-agnostic callback.

`tokens_to_logits(ids [n, 1], cache) -> (logits [n, vocab], new_cache)` is all decoding knows
of the model. Every loop runs inside `lax.while_loop`, so a decode function jit-compiles whole.
Beam search works on flattened [batch * beam] rows: callers expand their per-example inputs
(e.g. encoder outputs) with `flat_batch_beam_expand`; the cache is expanded here.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array
TokensToLogits = Callable[[Array, Any], tuple[Array, Any]]
NEG_INF = -1.0e7  # finite, so that sums and comparisons of dead beams stay well defined


# ---- Greedy and sampling -------------------------------------------------------------------

def _decode_loop(cache: Any, tokens_to_logits: TokensToLogits,
                 choose: Callable[[Array, Array], Array], *, batch_size: int, bos_id: int,
                 eos_id: int, max_decode_len: int, return_logprobs: bool = False):
  """Feeds each chosen token back until every row has produced EOS or max_decode_len tokens.

  Returns:
    int32 [batch, max_decode_len] tokens, EOS included, zeros after it; with
    `return_logprobs` also float32 [batch]: each row's log-probability under the model (the
    unfiltered softmax at temperature 1), EOS included.
  """

  def cond(state):
    step, _, _, finished, _, _ = state
    return (step < max_decode_len) & ~jnp.all(finished)

  def body(state):
    step, last, sequences, finished, logprobs, cache = state
    logits, cache = tokens_to_logits(last, cache)  # [batch, vocab]
    logits = logits.astype(jnp.float32)
    token = jnp.where(finished, 0, choose(logits, step))  # [batch]
    token_logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)
    logprobs = logprobs + jnp.where(finished, 0.0, token_logprob[:, 0])
    sequences = jax.lax.dynamic_update_slice(sequences, token[:, None], (0, step))
    return step + 1, token[:, None], sequences, finished | (token == eos_id), logprobs, cache

  state = (jnp.array(0), jnp.full((batch_size, 1), bos_id, jnp.int32),
           jnp.zeros((batch_size, max_decode_len), jnp.int32),
           jnp.zeros((batch_size,), jnp.bool_), jnp.zeros((batch_size,), jnp.float32), cache)
  _, _, sequences, _, logprobs, _ = jax.lax.while_loop(cond, body, state)
  return (sequences, logprobs) if return_logprobs else sequences


def greedy_search(cache: Any, tokens_to_logits: TokensToLogits, *, batch_size: int,
                  bos_id: int, eos_id: int, max_decode_len: int, return_logprobs: bool = False):
  """Most likely token at every step. Returns [batch, max_decode_len] tokens (and their
  log-probabilities [batch] with `return_logprobs`)."""
  choose = lambda logits, step: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return _decode_loop(cache, tokens_to_logits, choose, batch_size=batch_size, bos_id=bos_id,
                      eos_id=eos_id, max_decode_len=max_decode_len,
                      return_logprobs=return_logprobs)


def filter_logits(logits: Array, top_k: int = 0, top_p: float = 1.0) -> Array:
  """Keeps the `top_k` most likely tokens (0 = all), then the smallest set whose probability
  reaches `top_p` (the nucleus); every other logit becomes NEG_INF."""
  if top_k > 0:
    kth_best = jax.lax.top_k(logits, top_k)[0][..., -1:]  # [n, 1]
    logits = jnp.where(logits < kth_best, NEG_INF, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # A token is in the nucleus if the tokens ranked above it hold less than top_p.
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = mass_above < top_p
    threshold = jnp.min(jnp.where(in_nucleus, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, NEG_INF, logits)
  return logits


def sample(cache: Any, tokens_to_logits: TokensToLogits, rng: Array, *, batch_size: int,
           bos_id: int, eos_id: int, max_decode_len: int, temperature: float = 1.0,
           top_k: int = 0, top_p: float = 1.0, return_logprobs: bool = False):
  """Samples from softmax(filtered logits / temperature), seeded by `rng`.

  temperature 0 is greedy; top_k=1 is greedy. Returns [batch, max_decode_len] tokens (and
  their log-probabilities under the model [batch] with `return_logprobs`).
  """
  common = dict(batch_size=batch_size, bos_id=bos_id, eos_id=eos_id,
                max_decode_len=max_decode_len, return_logprobs=return_logprobs)
  if temperature == 0.0:
    return greedy_search(cache, tokens_to_logits, **common)

  def choose(logits, step):
    logits = filter_logits(logits / temperature, top_k, top_p)
    return jax.random.categorical(jax.random.fold_in(rng, step), logits).astype(jnp.int32)

  return _decode_loop(cache, tokens_to_logits, choose, **common)


# ---- Beam search ---------------------------------------------------------------------------

def length_penalty(length: Array, alpha: float) -> Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha; scores are log-probs divided by it."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


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


def _gather_cache(cache: Any, beam_indices: Array, old_beam: int) -> Any:
  """Like `_gather_beams` for a flat [batch * old_beam, ...] cache."""
  batch_size = beam_indices.shape[0]

  def gather(x):
    if x.ndim == 0:
      return x
    x = x.reshape((batch_size, old_beam) + x.shape[1:])
    x = _gather_beams(x, beam_indices)
    return x.reshape((-1,) + x.shape[2:])
  return jax.tree.map(gather, cache)


def beam_search(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits, *,
                beam_size: int, alpha: float, eos_id: int, max_decode_len: int | None = None,
                bos_id: int = 2) -> tuple[Array, Array]:
  """Beam search with the GNMT length penalty.

  Each example has `beam_size` slots. Every step, the best extensions of the live beams fill
  the slots not yet taken by finished hypotheses; one that emits EOS, or reaches
  `max_decode_len` tokens, is finished with score log-probability / length_penalty(length).
  So beam size 1 is exactly greedy search, and a beam as wide as the search space is exact.
  An example stops once no live beam can beat its best finished hypothesis (alpha >= 0).

  Args:
    inputs: [batch, src_len] source tokens; give the batch size and the default length.
    cache: decoder cache for `batch` rows (expanded to batch * beam here).
    tokens_to_logits: ([batch*beam, 1] ids, flat cache) -> ([batch*beam, vocab] logits, cache).
    beam_size: slots per example.
    alpha: length-penalty exponent (0 = plain log-probability; the paper uses 0.6).
    eos_id: end-of-sequence id.
    max_decode_len: longest output in tokens; default source length + 50.
    bos_id: first decoder input token.

  Returns:
    sequences [batch, beam, max_decode_len] (zeros after EOS) and scores [batch, beam], best
    first; slots never filled score NEG_INF.
  """
  batch_size = inputs.shape[0]
  if max_decode_len is None:
    max_decode_len = inputs.shape[1] + 50
  k = beam_size
  # Sequences keep the bos at position 0; the output drops it.
  live_seqs = jnp.zeros((batch_size, k, max_decode_len + 1), jnp.int32).at[:, :, 0].set(bos_id)
  # Only the first beam is alive at the start, so the first step does not pick k copies.
  live_logprobs = jnp.tile(jnp.array([0.0] + [NEG_INF] * (k - 1), jnp.float32), (batch_size, 1))
  state = (jnp.array(0), live_seqs, live_logprobs, jnp.zeros_like(live_seqs),
           jnp.full((batch_size, k), NEG_INF, jnp.float32), jnp.zeros((batch_size,), jnp.int32),
           expand_cache(cache, k))

  def cond(state):
    step, _, live_logprobs, _, finished_scores, _, _ = state
    # Log-probs only fall and longer outputs get larger penalties, so the best a live beam can
    # still reach is its log-prob over the penalty of the longest output.
    best_live = jnp.max(live_logprobs, axis=1)
    bound = best_live / length_penalty(max_decode_len, alpha)
    has_live = best_live > NEG_INF / 2
    can_improve = (bound > finished_scores[:, 0]) if alpha >= 0 else True
    return (step < max_decode_len) & jnp.any(has_live & can_improve)

  def body(state):
    step, live_seqs, live_logprobs, finished_seqs, finished_scores, num_finished, cache = state
    last = jax.lax.dynamic_slice_in_dim(live_seqs, step, 1, axis=2).reshape(batch_size * k, 1)
    logits, cache = tokens_to_logits(last, cache)  # [batch*k, vocab]
    vocab = logits.shape[-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(batch_size, k, vocab)
    candidates = (live_logprobs[:, :, None] + log_probs).reshape(batch_size, k * vocab)
    top_logprobs, top_indices = jax.lax.top_k(candidates, k)  # [batch, k], best first
    top_beams, top_tokens = top_indices // vocab, (top_indices % vocab).astype(jnp.int32)
    top_seqs = _gather_beams(live_seqs, top_beams)
    top_seqs = jax.lax.dynamic_update_slice(top_seqs, top_tokens[:, :, None], (0, 0, step + 1))
    # Only the best (k - finished so far) candidates get a slot; extensions of dead beams none.
    has_slot = jnp.arange(k)[None, :] < (k - num_finished)[:, None]
    accepted = has_slot & (top_logprobs > NEG_INF / 2)
    ends = accepted & ((top_tokens == eos_id) | (step + 1 == max_decode_len))

    new_scores = jnp.where(ends, top_logprobs / length_penalty(step + 1, alpha), NEG_INF)
    all_scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    finished_scores, pick = jax.lax.top_k(all_scores, k)  # at most k ever finish: none lost
    finished_seqs = _gather_beams(jnp.concatenate([finished_seqs, top_seqs], axis=1), pick)
    num_finished = num_finished + jnp.sum(ends, axis=1)

    live_logprobs = jnp.where(accepted & ~ends, top_logprobs, NEG_INF)
    cache = _gather_cache(cache, top_beams, k)
    return step + 1, top_seqs, live_logprobs, finished_seqs, finished_scores, num_finished, cache

  final = jax.lax.while_loop(cond, body, state)
  finished_seqs, finished_scores = final[3], final[4]
  return finished_seqs[:, :, 1:], finished_scores
