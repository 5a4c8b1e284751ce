"""The output layer and the loss over chunks of positions, for large vocabularies: the float32
[rows, length, vocab] logits never exist at once (1.6 GB for 8 x 1024 tokens of a 50k
vocabulary).

Two ways, the same sums and gradients (tests/test_chunked_loss.py):
- `chunked_score` (config.logits_chunk_length alone): a scan over chunks whose backward pass
  recomputes each chunk's logits (jax.checkpoint): the output matmul runs three times per
  chunk's gradient (forward, recomputed forward, and the two gradient products).
- `fused_score` (with config.fused_loss): each chunk's gradients are taken in the forward pass
  itself (the logits, then at once their gradient and its two products, as Liger's fused
  linear cross-entropy does), kept as the states' gradient [rows, length, emb] and the output
  layer's; the backward pass only scales them. One output matmul fewer per chunk, and the
  chunk's logits live only inside its step. Portable (plain JAX, any platform and layout).

`score(logits, labels, weights)` returns sums over positions (train.train_step's: the loss,
then its metrics); `fused_score` differentiates its first value only (the loss): the others
are metrics, never differentiated.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

Array = jax.Array


def _split(x: Array, chunk_length: int) -> Array:
  """[rows, len, ...] -> [chunks, rows, chunk_length, ...], padded with zeros (weight 0: adds
  nothing to any sum). Rows stay on the chunks' second axis: a batch sharded over devices
  stays where it is."""
  pad = -x.shape[1] % chunk_length
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape((x.shape[0], -1, chunk_length) + x.shape[2:]), 1, 0)


def chunked_score(score, logits, states: Array, labels: Array, weights: Array,
                  chunk_length: int):
  """`score(logits(states), labels, weights)` for `states` [rows, len, emb], computed over
  `chunk_length` positions of every row at a time and summed; the backward pass recomputes
  each chunk's logits."""
  if chunk_length >= states.shape[1]:
    return score(logits(states), labels, weights)
  chunks = tuple(_split(x, chunk_length) for x in (states, labels, weights))
  one_chunk = jax.checkpoint(lambda s, l, w: score(logits(s), l, w), prevent_cse=False)
  add = lambda total, chunk: (jax.tree.map(jnp.add, total, one_chunk(*chunk)), None)
  totals = jax.tree.map(jnp.zeros_like, jax.eval_shape(one_chunk, *(x[0] for x in chunks)))
  return jax.lax.scan(add, totals, chunks)[0]


def fused_score(score, output_layer: Callable[[Any, Array], Array], params, states: Array,
                labels: Array, weights: Array, chunk_length: int):
  """`score(output_layer(params, states), labels, weights)`, summed over chunks of
  `chunk_length` positions, with each chunk's gradients (of the first value) for the output
  layer's parameters and the states taken in the forward pass.

  Only the parameters the output layer reads (found in its jaxpr) are carried through the
  chunks' scan: a tied embedding, an output kernel and bias; the others get no gradient here,
  nor does what `score` closes over (train_step's token count).
  """
  leaves, treedef = jax.tree.flatten(params)
  used = _read_leaves(output_layer, params, states[:, :1])
  rebuild = lambda read: treedef.unflatten(
      [read[used.index(i)] if i in used else jnp.zeros((), leaf.dtype)
       for i, leaf in enumerate(leaves)])

  def one_chunk(read, state_chunk, label_chunk, weight_chunk):
    return score(output_layer(rebuild(read), state_chunk), label_chunk, weight_chunk)

  read = [leaves[i] for i in used]
  chunks = tuple(_split(x, chunk_length) for x in (states, labels, weights))
  # What `score` closes over (train_step's token count, a traced value) becomes explicit
  # arguments: a custom_vjp function may not close over traced values.
  one_chunk, closed = jax.closure_convert(one_chunk, read, *(x[0] for x in chunks))
  # The sums' shapes; each function below makes its own zeros (it may not close over arrays
  # made in an outer trace: under lax.cond, train_step's weighted-part branch, they leak).
  sums = jax.eval_shape(one_chunk, read, *(x[0] for x in chunks), *closed)

  def forward(read, states, labels, weights, closed):
    add = lambda total, chunk: (jax.tree.map(jnp.add, total, one_chunk(read, *chunk, *closed)),
                                None)
    chunks = tuple(_split(x, chunk_length) for x in (states, labels, weights))
    return jax.lax.scan(add, jax.tree.map(jnp.zeros_like, sums), chunks)[0]

  def forward_and_gradients(read, states, labels, weights, closed):
    # Only what is differentiated gets a gradient (symbolic_zeros): a LoRA run's frozen table,
    # or an int8 one, has none, so no [vocab, emb] float32 sum of its gradients is built.
    trained = [i for i, leaf in enumerate(read)
               if leaf.perturbed and jnp.issubdtype(leaf.value.dtype, jnp.inexact)]
    read, states, labels, weights, closed = jax.tree.map(
        lambda leaf: leaf.value, (read, states, labels, weights, closed))

    def with_trained(values, others):
      """`others`, its trained entries replaced by `values` (one per trained leaf, in order)."""
      values = iter(values)
      return [next(values) if i in trained else other for i, other in enumerate(others)]

    def add(carry, chunk):
      total, read_grads = carry
      values, pullback = jax.vjp(
          lambda r, s: one_chunk(with_trained(r, read), s, *chunk[1:], *closed),
          [read[i] for i in trained], chunk[0])
      seed = jax.tree.leaves(jax.tree.map(jnp.zeros_like, values))
      seed = jax.tree.unflatten(jax.tree.structure(values), [jnp.ones_like(seed[0])] + seed[1:])
      chunk_read_grads, state_grads = pullback(seed)
      return (jax.tree.map(jnp.add, total, values),
              jax.tree.map(jnp.add, read_grads, chunk_read_grads)), state_grads

    (total, read_grads), state_grads = jax.lax.scan(
        add, (jax.tree.map(jnp.zeros_like, sums),
              [jnp.zeros_like(read[i]) for i in trained]),
        tuple(_split(x, chunk_length) for x in (states, labels, weights)))
    rows, length = states.shape[:2]
    state_grads = jnp.moveaxis(state_grads, 0, 1).reshape(rows, -1, states.shape[2])
    return total, (with_trained(read_grads, [None] * len(read)), state_grads[:, :length])

  def backward(grads, cotangent):
    scale = jax.tree.leaves(cotangent)[0]  # the loss's; the metrics are not differentiated
    if isinstance(scale, jax.custom_derivatives.SymbolicZero):  # the loss not differentiated
      return None, None, None, None, [None] * len(closed)
    read_grads, state_grads = jax.tree.map(lambda g: (scale * g).astype(g.dtype), grads)
    return read_grads, state_grads, None, None, [None] * len(closed)

  fused = jax.custom_vjp(forward)
  fused.defvjp(forward_and_gradients, backward, symbolic_zeros=True)
  return fused(read, states, labels, weights, closed)


def _read_leaves(output_layer, params, states: Array) -> list[int]:
  """Indices (in jax.tree.leaves order) of the parameters `output_layer` reads."""
  jaxpr = jax.make_jaxpr(output_layer)(params, states).jaxpr
  inputs = jaxpr.invars[:len(jax.tree.leaves(params))]
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
  return [i for i, v in enumerate(inputs) if id(v) in read]
