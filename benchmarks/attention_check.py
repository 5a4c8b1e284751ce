"""Attention implementations against 'reference' on padded and packed inputs, and their speed.

  python benchmarks/attention_check.py [--speed]

For each implementation this backend has ('xla'; 'cudnn' on GPU) and each mask the models
build (encoder padding, packed encoder, packed causal decoder, packed cross-attention), prints
the relative error ||out - ref|| / ||ref|| of the outputs and of the gradients of Q, K and V
against the float32 reference path, and the NaN count, both for `jax.nn.dot_product_attention`
called with the mask as it is ('raw') and through `attention.fused_attention` (what the models
call). With --speed, also the forward + backward time of each at Transformer-base shapes
(128 x 256 tokens, 8 heads of 64), bfloat16. One JSON line per measurement.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformer_jax.model import attention  # noqa: E402
from transformer_jax.model import models  # noqa: E402


def packed_tokens(rng: np.random.Generator, batch: int, length: int, packed: bool):
  """(tokens, segment ids) with random lengths; every row ends in padding, one row is empty
  but for a single token, so fully masked queries occur."""
  tokens = np.zeros((batch, length), np.int32)
  segments = np.zeros((batch, length), np.int32)
  for row in range(batch):
    position, segment = 0, 1
    budget = 1 if row == 0 else rng.integers(length // 2, length)
    while position < budget:
      n = min(int(rng.integers(1, length // 3)) if packed else budget, budget - position)
      tokens[row, position:position + n] = rng.integers(3, 100, n)
      segments[row, position:position + n] = segment
      position, segment = position + n, segment + 1
  return tokens, segments


def masks(rng: np.random.Generator, batch: int, length: int) -> dict:
  """The masks EncoderDecoder builds, [b, 1, q, k]."""
  src, src_seg = packed_tokens(rng, batch, length, packed=True)
  tgt, tgt_seg = packed_tokens(rng, batch, length, packed=True)
  pad_src, _ = packed_tokens(rng, batch, length, packed=False)
  # Packed targets whose segments exceed the source's have no source to attend to.
  cross = attention.combine_masks(attention.padding_mask(tgt, src),
                                  attention.segment_mask(tgt_seg, src_seg))
  return {
      "padded": models.self_attention_mask(jnp.asarray(pad_src), None, causal=False),
      "packed": models.self_attention_mask(jnp.asarray(src), jnp.asarray(src_seg), False),
      "packed_causal": models.self_attention_mask(jnp.asarray(tgt), jnp.asarray(tgt_seg), True),
      "packed_cross": cross,
  }


def rel(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def implementations() -> list[str]:
  return ["xla", "cudnn"] if jax.default_backend() == "gpu" else ["xla"]


def check(dtype=jnp.bfloat16, batch=8, length=128, heads=4, head_dim=64):
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  shape = (batch, length, heads, head_dim)
  q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  for name, mask in masks(rng, batch, length).items():
    def reference(q, k, v, mask=mask):
      with jax.default_matmul_precision("highest"):
        return attention.dot_product_attention(q, k, v, mask)
    ref_out, ref_vjp = jax.vjp(reference, q, k, v)
    ref_grads = ref_vjp(cotangent)
    for implementation in implementations():
      for path in ("raw", "fused"):
        if path == "raw":
          fn = lambda q, k, v, m=mask, i=implementation: jax.nn.dot_product_attention(
              q, k, v, mask=jnp.broadcast_to(m, (batch, 1, length, length)), implementation=i)
        else:
          fn = lambda q, k, v, m=mask, i=implementation: attention.fused_attention(q, k, v, m, i)
        row = {"mask": name, "implementation": implementation, "path": path,
               "dtype": jnp.dtype(dtype).name}
        try:
          out, vjp = jax.vjp(jax.jit(fn), *(x.astype(dtype) for x in (q, k, v)))
          grads = vjp(cotangent.astype(dtype))
          row.update(out_rel_err=rel(out, ref_out),
                     grad_rel_err=max(rel(g, r) for g, r in zip(grads, ref_grads)),
                     out_nans=int(jnp.isnan(out).sum()),
                     grad_nans=int(sum(jnp.isnan(g).sum() for g in grads)))
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = str(e).splitlines()[0][:300]
        print(json.dumps(row), flush=True)


def speed(batch=128, length=256, heads=8, head_dim=64, repeats=20):
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16)
             for key in keys)
  tokens, _ = packed_tokens(rng, batch, length, packed=False)
  padded = models.self_attention_mask(jnp.asarray(tokens), None, causal=False)
  causal = models.self_attention_mask(jnp.asarray(tokens), None, causal=True)
  for mask_name, mask in (("padded", padded), ("padded_causal", causal)):
    for implementation in ["reference"] + implementations():
      def loss(q, k, v, i=implementation, m=mask):
        if i == "reference":
          out = attention.dot_product_attention(q, k, v, m)
        else:
          out = attention.fused_attention(q, k, v, m, i)
        return jnp.sum(out.astype(jnp.float32))
      step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      jax.block_until_ready(step(q, k, v))
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
      print(json.dumps({"speed_mask": mask_name, "implementation": implementation,
                        "fwd_bwd_ms_median": 1e3 * float(np.median(times)),
                        "shape": [batch, length, heads, head_dim]}), flush=True)


if __name__ == "__main__":
  print(json.dumps({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                    "jax": jax.__version__}))
  check(jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
  if "--speed" in sys.argv:
    speed()
