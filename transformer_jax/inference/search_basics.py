"""What every search shares: the model callback's and the logits processors' types, the
finite minus infinity of dead hypotheses, argument checks, the tokens forced at the start of
an output (and a prompt's trailing target-language code, forced first), first inputs, end
tokens, and the per-token log-probability and argmax."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
TokensToLogits = Callable[[Array, Any], tuple[Array, Any]]
LogitsProcessor = Callable[[Array, Array, Array], Array]
NEG_INF = -1.0e7  # finite, so that sums and comparisons of dead beams stay well defined


def check(name: str, value: Any, ok: Callable[[np.ndarray], Any], requirement: str) -> None:
  """ValueError unless `value` passes `ok`; traced values (known only inside jit) pass."""
  if isinstance(value, jax.core.Tracer):
    return
  if not np.all(ok(np.asarray(value))):
    raise ValueError(f"{name}={value} must be {requirement}")


def forced_tokens(decoder_prompt: Array | None, copies: int,
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


def split_code(inputs):
  """[b, len] prompts whose last non-pad token is a code -> (the prompts without it, the codes
  [b]; 0 for an all-pad row)."""
  last = jnp.sum(inputs != 0, axis=1) - 1  # [b]; -1 for an all-pad row
  codes = jnp.where(last >= 0, jnp.take_along_axis(inputs, jnp.maximum(last, 0)[:, None],
                                                    axis=1)[:, 0], 0)
  return jnp.where(jnp.arange(inputs.shape[1])[None, :] == last[:, None], 0, inputs), codes


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


def first_argmax(logits: Array) -> Array:
  """int32 [n]: each row's first most likely id, as jnp.argmax gives it for finite logits.
  A max and a min, which XLA:CPU vectorises, where argmax's (value, index) reduction is not:
  a tenth of a t5-small decoding step at batch 32 (issue #42)."""
  vocab = logits.shape[-1]
  best = jnp.max(logits, axis=-1, keepdims=True)
  ids = jnp.where(logits == best, jnp.arange(vocab, dtype=jnp.int32), vocab)
  return jnp.minimum(jnp.min(ids, axis=-1), vocab - 1)  # NaN logits: the last id


def flat_batch_beam_expand(x: Array, beam_size: int) -> Array:
  """[batch, ...] -> [batch * beam, ...], each row repeated beam_size times."""
  return jnp.repeat(x, beam_size, axis=0)


def expand_cache(cache: Any, beam_size: int) -> Any:
  # Scalars (cache indices) are shared by all rows.
  return jax.tree.map(lambda x: x if x.ndim == 0 else flat_batch_beam_expand(x, beam_size),
                      cache)
