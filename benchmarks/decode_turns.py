"""Decode speed of two checkouts taken in turns, for before/after comparisons on a noisy machine.

  git worktree add /tmp/before <commit>
  python benchmarks/decode_turns.py /tmp/before . --rounds 5

Each round runs, in a fresh process per checkout (its own `transformer_jax` on PYTHONPATH),
greedy and beam-4 decoding with the KV cache as `python -m transformer_jax.benchmark
--config configs/demo.py --decode_len 64 --decode_batch_size 32` does (random weights, no EOS,
a 32-token source; the demo's encoder-decoder, or with `--architecture decoder_only` the
demo's sizes as one decoder), 10 timed runs after one warm-up; it prints each round's output
tokens/s and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MEASURE = r"""
import functools, json, jax, jax.numpy as jnp, numpy as np
from configs import demo
from transformer_jax import benchmark, families
config = demo.get_config()
config.task, config.architecture = "translation", ARCHITECTURE
config.model.max_len = max(config.model.max_len, 96)  # a decoder-only prompt and its output
family = families.get(config)
inputs = jnp.asarray(np.random.default_rng(0).integers(3, config.model.vocab_size, (32, 32)),
                     jnp.int32)
params = jax.jit(lambda: family.init_params(jax.random.PRNGKey(0)))()
speeds = {}
for name, beam in [("greedy", 1), ("beam4", 4)]:
  fn = jax.jit(functools.partial(benchmark._decode, family=family, decode_len=64,
                                 beam_size=beam, use_cache=True))
  seconds = benchmark._timed(lambda: jax.block_until_ready(fn(params, inputs)), 10, 1)
  speeds[name] = 32 * 64 / seconds
print(json.dumps(speeds))
"""


def measure(checkout: str, architecture: str) -> dict[str, float]:
  env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), JAX_PLATFORMS="cpu")
  code = f"ARCHITECTURE = {architecture!r}\n" + MEASURE
  run = subprocess.run([sys.executable, "-c", code], cwd=checkout, env=env,
                       capture_output=True, text=True, check=True)
  return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("before")
  parser.add_argument("after")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--architecture", default="encoder_decoder",
                      choices=("encoder_decoder", "decoder_only"))
  args = parser.parse_args()
  results = {"before": [], "after": []}
  for round_index in range(args.rounds):
    for side in results:
      speeds = measure(getattr(args, side), args.architecture)
      results[side].append(speeds)
      print(f"round {round_index + 1} {side}: " +
            ", ".join(f"{k} {v:,.0f} tokens/s" for k, v in speeds.items()), flush=True)
  for name in results["before"][0]:
    before, after = (statistics.median(r[name] for r in results[s]) for s in results)
    print(f"{name}: median {before:,.0f} -> {after:,.0f} tokens/s ({after / before:.2f}x)")


if __name__ == "__main__":
  main()
