"""The optimizer and its learning-rate schedule, built from the config in one place."""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import optax

from transformer_jax import layer_decay


def rsqrt_schedule(peak_learning_rate: float, warmup_steps: int) -> optax.Schedule:
  """Linear warmup to the peak, then decay with 1/sqrt(step), as in the paper."""

  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0  # optax counts from 0
    warmup = jnp.float32(max(warmup_steps, 1))
    return peak_learning_rate * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

  return schedule


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """The config's schedule: what the optimizer steps with, and what the train log reports."""
  return rsqrt_schedule(config.learning_rate, config.warmup_steps)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam (0.9, 0.98, 1e-9) on the rsqrt schedule; optional clipping, weight decay and
  layer-wise learning-rate decay (`config.layer_decay`, see layer_decay.py)."""
  schedule = learning_rate_schedule(config)
  if config.weight_decay > 0:
    adam = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=config.weight_decay)
  else:
    adam = optax.adam(schedule, b1=0.9, b2=0.98, eps=1e-9)
  parts = [adam]
  if config.grad_clip_norm > 0:
    parts.insert(0, optax.clip_by_global_norm(config.grad_clip_norm))
  # Last, so that it scales whole updates (Adam's and AdamW's decoupled decay term). At 1.0
  # nothing is added: the optimizer state keeps the structure older checkpoints hold.
  if config.get("layer_decay", 1.0) < 1.0:
    parts.append(layer_decay.scale_by_layer_decay(config.layer_decay))
  return parts[0] if len(parts) == 1 else optax.chain(*parts)
