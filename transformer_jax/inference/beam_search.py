"""Beam search (t5x's: live and finished hypotheses kept apart; see decoding.py's docstring
for the contract) over a model-agnostic callback, with its length penalties."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from transformer_jax.inference.search_basics import (NEG_INF, Array, LogitsProcessor,
                                                     TokensToLogits, as_eos, check,
                                                     expand_cache, first_inputs, forced_tokens)

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
  check("beam_size", beam_size, lambda v: v >= 1, ">= 1")
  penalty = lambda num_tokens: length_penalty(num_tokens, alpha, length_penalty_kind)
  batch_size = inputs.shape[0]
  if max_decode_len is None:
    max_decode_len = inputs.shape[1] + 50
  check("max_decode_len", max_decode_len, lambda v: v >= 1, ">= 1")
  k, length = beam_size, max_decode_len
  forced = forced_tokens(decoder_prompt, 1, length)  # [batch, length] or None
  state = _initial_beams(batch_size, k, length, bos_id, (expand_beams or expand_cache)(cache, k))
  cond = lambda state: _still_searching(state, penalty, length)

  def body(state):
    step, live_seqs, live_logprobs, finished_seqs, finished_scores, cache = state
    last = jax.lax.dynamic_index_in_dim(live_seqs, step, axis=2, keepdims=False)  # [batch, k]
    logits, cache = tokens_to_logits(last.reshape(batch_size * k, 1), cache)  # [batch*k, V]
    logits = logits.astype(jnp.float32)
    if logits_processor is not None:
      logits = logits_processor(logits, step, live_seqs[:, :, 1:].reshape(batch_size * k, -1))
    log_probs = jax.nn.log_softmax(logits).reshape(batch_size, k, logits.shape[-1])
    log_probs, is_forced = _force_prompt(log_probs, forced, step)
    top_logprobs, top_beams, top_seqs, possible, ends = _extensions(
        live_seqs, live_logprobs, log_probs, is_forced, step, eos_id, end_ids)

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


def _extensions(live_seqs: Array, live_logprobs: Array, log_probs: Array, is_forced: Array,
                step: Array, eos_id: int, end_ids: Sequence[int]) -> tuple[Array, ...]:
  """The 2k best one-token extensions of the k live hypotheses of each example: their
  log-probs [batch, 2k] (best first), beams, sequences [batch, 2k, length + 1], and which are
  possible and which end (EOS, not forced)."""
  batch_size, k, vocab = log_probs.shape
  candidates = (live_logprobs[:, :, None] + log_probs).reshape(batch_size, k * vocab)
  top_logprobs, top_indices = jax.lax.top_k(candidates, 2 * k)  # [batch, 2k], best first
  top_beams, top_tokens = top_indices // vocab, (top_indices % vocab).astype(jnp.int32)
  top_tokens = jnp.where(is_forced[:, None], top_tokens, as_eos(top_tokens, eos_id, end_ids))
  top_seqs = _gather_beams(live_seqs, top_beams)  # [batch, 2k, length + 1]
  top_seqs = jax.lax.dynamic_update_slice(top_seqs, top_tokens[:, :, None], (0, 0, step + 1))
  possible = top_logprobs > NEG_INF / 2
  ends = possible & (top_tokens == eos_id) & ~is_forced[:, None]  # [batch, 2k]
  return top_logprobs, top_beams, top_seqs, possible, ends


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
