"""Attention kernels of the table (transformer_jax/kernels.py) side by side: speed, error and
memory.

  python benchmarks/attention_kernels.py [--shapes smollm2,gpt2-0.5b,long]
      [--kernels reference,xla,cudnn,tokamax,splash] [--dtype bfloat16] [--rounds 20]
  python benchmarks/attention_kernels.py --memory 8192 --kernels reference,splash

Speed: per shape and kernel, the forward and the forward + backward (gradients of queries,
keys and values) of causal self-attention over rows of one segment each, jit-compiled on
JAX's default backend, the median of --rounds calls after one warm-up; the error is the
largest absolute difference of the forward from the float32 reference on the same inputs
(on a GPU with float32 matrix products at full precision). A kernel that cannot take a call
is listed with its reason (kernels.Kernel.refusal). Shapes (rows, length, query heads,
key/value heads, head dim): smollm2 (8, 1024, 9, 3, 64), gpt2-0.5b (8, 1024, 16, 16, 64),
long (1, 8192, 16, 16, 128).

--memory LENGTH compiles one row of LENGTH tokens (16 heads of 128) forward + backward per
kernel on this backend and prints the compiled program's temporary memory
(`memory_analysis()`): on the CPU, the TPU's splash kernel runs in Pallas interpret mode,
whose buffers are the kernel's blocks, against the reference's [heads, length, length]
scores. A benchmark, not a test; one JSON line per measurement.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {"smollm2": (8, 1024, 9, 3, 64), "gpt2-0.5b": (8, 1024, 16, 16, 64),
          "long": (1, 8192, 16, 16, 128)}


def _inputs(shape, dtype):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from transformer_jax.model import kernels, models  # pylint: disable=g-import-not-at-top
  rows, length, heads, kv_heads, dim = shape
  r = jax.random.split(jax.random.PRNGKey(0), 3)
  query = jax.random.normal(r[0], (rows, length, heads, dim), dtype)
  key, value = (jax.random.normal(x, (rows, length, kv_heads, dim), dtype) for x in r[1:])
  tokens = jnp.ones((rows, length), jnp.int32)
  mask = models.structured_self_mask(tokens, None, causal=True)
  assert isinstance(mask, kernels.StructuredMask)
  return (query, key, value), mask


def _attention(name):
  from transformer_jax.model import attention  # pylint: disable=g-import-not-at-top
  return lambda q, k, v, mask: attention.fused_attention(q, k, v, mask, name)


def _timed(fn, args, rounds):
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def speed(args) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from transformer_jax.model import kernels  # pylint: disable=g-import-not-at-top
  for shape_name in args.shapes.split(","):
    shape = SHAPES[shape_name]
    qkv, mask = _inputs(shape, jnp.dtype(args.dtype))
    with jax.default_matmul_precision("highest"):
      expected = jax.jit(_attention("reference"))(*(x.astype(jnp.float32) for x in qkv), mask)
    rows, length, heads, _, dim = shape
    causal_flops = 4 * rows * heads * length * length * dim / 2  # two matmuls, half the scores
    for name in args.kernels.split(","):
      why = kernels.KERNELS[name].refusal(kernels.Call.of(qkv[0], qkv[1], mask))
      result = dict(shape=shape_name, kernel=name, dtype=args.dtype,
                    backend=jax.default_backend())
      if name != "reference" and why:
        print(json.dumps({**result, "refused": why}), flush=True)
        continue
      forward = jax.jit(_attention(name))
      loss = lambda q, k, v, m, f=_attention(name): jnp.sum(f(q, k, v, m).astype(jnp.float32))
      backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
      try:
        out = forward(*qkv, mask)
        result.update(
            forward_ms=round(1e3 * _timed(forward, (*qkv, mask), args.rounds), 3),
            forward_backward_ms=round(1e3 * _timed(backward, (*qkv, mask), args.rounds), 3),
            max_error=float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected))))
        result["forward_tflops"] = round(causal_flops / result["forward_ms"] / 1e9, 1)
      except Exception as error:  # pylint: disable=broad-except  # a benchmark reports it
        result["failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
      print(json.dumps(result), flush=True)


def memory(args) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from transformer_jax.model import kernels  # pylint: disable=g-import-not-at-top
  os.environ.setdefault(kernels.INTERPRET_ENV, "1")
  shape = (1, args.memory, 16, 16, 128)
  qkv, mask = _inputs(shape, jnp.dtype(args.dtype))
  for name in args.kernels.split(","):
    loss = lambda q, k, v, m, f=_attention(name): jnp.sum(f(q, k, v, m).astype(jnp.float32))
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*qkv, mask).compile()
    analysis = compiled.memory_analysis()
    print(json.dumps(dict(kernel=name, length=args.memory, heads=16, head_dim=128,
                          dtype=args.dtype, backend=jax.default_backend(),
                          interpret=jax.default_backend() not in kernels.KERNELS[name].platforms,
                          temp_bytes=analysis.temp_size_in_bytes,
                          temp_gib=round(analysis.temp_size_in_bytes / 2**30, 3),
                          compile_s=round(time.perf_counter() - start, 1))), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--shapes", default="smollm2,gpt2-0.5b,long")
  parser.add_argument("--kernels", default="reference,xla,cudnn,tokamax")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--memory", type=int, help="compiled memory at this length instead")
  args = parser.parse_args()
  if args.memory:
    memory(args)
  else:
    speed(args)


if __name__ == "__main__":
  main()
