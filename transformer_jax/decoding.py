"""Autoregressive decoding over a model-agnostic callback.

`tokens_to_logits(ids [n, 1], cache) -> (logits [n, vocab], new_cache)` is all decoding knows
of the model. Loops run inside `lax.while_loop`, so a decode function jit-compiles whole.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array
TokensToLogits = Callable[[Array, Any], tuple[Array, Any]]


def _decode_loop(cache: Any, tokens_to_logits: TokensToLogits,
                 choose: Callable[[Array, Array], Array], *, batch_size: int, bos_id: int,
                 eos_id: int, max_decode_len: int) -> Array:
  """Feeds each chosen token back until every row has produced EOS or max_decode_len tokens.

  Returns:
    int32 [batch, max_decode_len] tokens, EOS included, zeros after it.
  """

  def cond(state):
    step, _, _, finished, _ = state
    return (step < max_decode_len) & ~jnp.all(finished)

  def body(state):
    step, last, sequences, finished, cache = state
    logits, cache = tokens_to_logits(last, cache)  # [batch, vocab]
    token = jnp.where(finished, 0, choose(logits, step))  # [batch]
    sequences = jax.lax.dynamic_update_slice(sequences, token[:, None], (0, step))
    return step + 1, token[:, None], sequences, finished | (token == eos_id), cache

  state = (jnp.array(0), jnp.full((batch_size, 1), bos_id, jnp.int32),
           jnp.zeros((batch_size, max_decode_len), jnp.int32),
           jnp.zeros((batch_size,), jnp.bool_), cache)
  return jax.lax.while_loop(cond, body, state)[2]


def greedy_search(cache: Any, tokens_to_logits: TokensToLogits, *, batch_size: int,
                  bos_id: int, eos_id: int, max_decode_len: int) -> Array:
  """Most likely token at every step. Returns [batch, max_decode_len] tokens."""
  choose = lambda logits, step: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return _decode_loop(cache, tokens_to_logits, choose, batch_size=batch_size, bos_id=bos_id,
                      eos_id=eos_id, max_decode_len=max_decode_len)


def sample(cache: Any, tokens_to_logits: TokensToLogits, rng: Array, *, batch_size: int,
           bos_id: int, eos_id: int, max_decode_len: int, temperature: float = 1.0) -> Array:
  """Random sampling from softmax(logits / temperature); seeded by `rng`."""

  def choose(logits, step):
    scaled = logits.astype(jnp.float32) / temperature
    return jax.random.categorical(jax.random.fold_in(rng, step), scaled).astype(jnp.int32)

  return _decode_loop(cache, tokens_to_logits, choose, batch_size=batch_size, bos_id=bos_id,
                      eos_id=eos_id, max_decode_len=max_decode_len)
