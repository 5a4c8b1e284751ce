"""Recomputing in the backward pass: rematerialised layers (`config.model.remat`), and the
data dependence that makes XLA recompute a value only when the backward pass needs it.

XLA may run any computation as soon as its operands exist. A rematerialised layer's
recomputation depends only on the layer's input and weights, which exist from the forward
pass on, so XLA:CPU's schedulers (the memory-minimising one too) may recompute layers early
and keep their activations, which is what remat was meant to avoid: at Qwen2.5-1.5B's widths
with 16 layers, seven to ten layers' MLP activations were live at once. `once_ready` makes a
value depend on another one (here: the layer's output gradient) without changing it.
"""

from __future__ import annotations

import contextvars
import inspect
from typing import Any

import flax.core.lift
import flax.linen as nn
import flax.struct
import jax
import jax.extend as jax_extend
import jax.numpy as jnp
import numpy as np

# What a rematerialised layer keeps from its forward pass; the rest is recomputed.
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # least memory: only layer inputs
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul outputs kept: no matmul recomputed
    # matmul outputs without batch dimensions (the projections, not attention scores), so
    # the [b, h, q, k] scores of long sequences are recomputed rather than stored.
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# Set while a rematerialised layer is traced (for its forward pass and its recomputation):
# it is not differentiated there, yet it trains, so what waits for its input in a
# differentiated forward pass (a quantized product's dequantization) waits there too.
_TRACING_FORWARD = contextvars.ContextVar("tracing_rematerialised_layer", default=False)


def rematerialising() -> bool:
  """Whether a rematerialised layer ('full' policy) is being traced."""
  return _TRACING_FORWARD.get()


def once_ready(operand: Any, tree: Any) -> Any:
  """`tree` with its float leaves made to depend on `operand` (the first value of each of its
  float leaves), so that XLA computes nothing from them before all of `operand` exists. The
  same values, unless one of those is NaN: then all NaN (the step's loss or gradients are NaN
  then anyway, which stops a run before it saves). An optimization barrier does not do this
  on XLA:CPU: it merges computations across one."""
  firsts = [v.reshape(-1)[0] for v in jax.tree.leaves(operand) if _is_float(v) and v.size]
  if not firsts:
    return tree
  nan = jnp.isnan(jnp.stack(firsts)).any()
  return jax.tree.map(lambda v: jnp.where(nan, jnp.nan, v).astype(v.dtype)
                      if _is_float(v) else v, tree)


def remat(layer: type[nn.Module], policy: str, static: tuple[str, ...]) -> type[nn.Module]:
  """`layer` rematerialised with `policy` (REMAT_POLICIES); `static`: the names of its
  `__call__` arguments that must stay Python values (flags such as `deterministic`), passed
  positionally. With 'full' the backward pass recomputes the layer only once the gradient of
  its output exists (`_recomputed_after_gradient`); the other policies are `nn.remat`."""
  if policy not in REMAT_POLICIES:
    raise ValueError(f"Unknown remat_policy {policy!r}; use one of {sorted(REMAT_POLICIES)}.")
  arguments = list(inspect.signature(layer.__call__).parameters)[1:]  # without self
  static_argnums = tuple(arguments.index(name) for name in static)
  if policy != "full":
    return nn.remat(layer, static_argnums=tuple(i + 1 for i in static_argnums),
                    policy=REMAT_POLICIES[policy])
  return nn.transforms.lift_transform(_lifted_full_remat, layer, static_argnums=static_argnums)


def _lifted_full_remat(fn, static_argnums: tuple[int, ...] = ()):
  """flax.core.lift.checkpoint's counterpart (all variables and rngs lifted) for
  `_recomputed_after_gradient`."""

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    if kwargs:
      raise TypeError(f"A rematerialised layer takes its arguments positionally, not "
                      f"{sorted(kwargs)} by name.")

    def apply(variable_groups, rng_groups, *args):
      scope = scope_fn(variable_groups, rng_groups)
      return fn(scope, *args), repack_fn(scope)

    return _recomputed_after_gradient(apply, tuple(i + 2 for i in static_argnums))(
        variable_groups, rng_groups, *args)

  return flax.core.lift.pack(inner, (True,), (True,), (True,), name="remat",
                             enable_kwargs=True)


@flax.struct.dataclass
class _Trained:
  """Which argument leaves a forward pass differentiated, carried in its residuals' structure
  so that each backward pass reads its own forward pass's."""
  leaves: tuple[int, ...] = flax.struct.field(pytree_node=False)


def _recomputed_after_gradient(apply, static_argnums: tuple[int, ...]):
  """`apply(variables, rngs, *inputs)` whose forward pass keeps only its arguments and whose
  backward pass recomputes it from them (jax.checkpoint with nothing saveable) in order: the
  recomputation once the gradient of its output exists, and the gradient of its inputs (the
  layer before's output gradient) once the trained weights' gradients exist; otherwise XLA
  defers those (nothing else needs them before the update) and keeps every layer's
  activations for them. Only what is differentiated gets a gradient (symbolic zeros: none
  for a frozen base). `apply` is traced once, here, where it is called (inside the Flax and
  qwix contexts); both passes replay that trace, its constants passed as arguments."""

  def call(*args):
    static = {i: args[i] for i in static_argnums}

    def with_static(*dynamic):
      it = iter(dynamic)
      return apply(*(static[i] if i in static else next(it) for i in range(len(args))))

    tracing = _TRACING_FORWARD.set(True)
    try:
      closed, shape = jax.make_jaxpr(with_static, return_shape=True)(
          *(a for i, a in enumerate(args) if i not in static))
    finally:
      _TRACING_FORWARD.reset(tracing)
    arguments = tuple(a for i, a in enumerate(args) if i not in static) + (closed.consts,)
    arguments_tree, output_tree = jax.tree.structure(arguments), jax.tree.structure(shape)
    weights = len(jax.tree.leaves(arguments[:2]))  # leaves of the variables and rngs

    def replay(leaves):
      *leaves, consts = jax.tree.unflatten(arguments_tree, leaves)
      replayed = jax_extend.core.jaxpr_as_fun(jax_extend.core.ClosedJaxpr(closed.jaxpr, consts))
      return jax.tree.unflatten(output_tree, replayed(*jax.tree.leaves(leaves)))

    @jax.custom_vjp
    def run(*arguments):
      return replay(jax.tree.leaves(arguments))

    def forward(*arguments):
      leaves = jax.tree.leaves(arguments)
      trained = _Trained(tuple(i for i, leaf in enumerate(leaves)
                               if leaf.perturbed and _is_float(leaf.value)))
      values = [leaf.value for leaf in leaves]
      return replay(values), (values, trained)

    def backward(residuals, grad):
      leaves, trained = residuals[0], residuals[1].leaves
      grad = jax.tree.map(_instantiated, grad)
      # Everything waits for the gradient, the weights too: from them alone XLA would
      # convert every layer's bfloat16 kernels to float32 at the start and keep them.
      leaves = once_ready(grad, leaves)

      def from_trained(values):
        values = iter(values)
        return replay([next(values) if i in trained else v for i, v in enumerate(leaves)])

      grads = jax.vjp(from_trained, [leaves[i] for i in trained])[1](grad)[0]
      weight_grads = [g for i, g in zip(trained, grads) if i < weights]
      if weight_grads:
        grads = [g if i < weights else once_ready(weight_grads, g)
                 for i, g in zip(trained, grads)]
      by_leaf = dict(zip(trained, grads))
      return jax.tree.unflatten(arguments_tree, [by_leaf.get(i) for i in range(len(leaves))])

    run.defvjp(forward, backward, symbolic_zeros=True)
    return run(*arguments)

  return call


def _is_float(value) -> bool:
  return hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.inexact)


def _instantiated(cotangent):
  """A symbolic zero (symbolic_zeros) as an array of zeros."""
  if isinstance(cotangent, jax.custom_derivatives.SymbolicZero):
    return np.zeros(cotangent.shape, cotangent.dtype)
  return cotangent
