"""The time of top-p / top-k filtering per decode step: a server's 32 rows, each with its own
settings, over SmolLM2's 49,152-token vocabulary.

  python benchmarks/sampling_filters.py [--rows 32] [--vocab 49152] [--rounds 20]

`decoding.filter_logits` looks for each row's nucleus (and top_k) among its CANDIDATES best
tokens (lax.top_k) and sorts the whole vocabulary only where some row's reaches past them.
Rows are Zipf-shaped ('zipf S': probabilities falling as rank^-S, in a random order per row;
roughly how a trained model's next-token probabilities fall, the larger S the more peaked;
the table says how many tokens each nucleus holds) or 'flat' (a random-weight model's: the
nucleus holds most of the vocabulary, so the full sort runs).
Each case: half the rows greedy-like (top_p 1, top_k 0), half filtering; jitted once, then
the median of --rounds calls. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from transformer_jax.inference import decoding  # pylint: disable=wrong-import-position


def logits_of(kind: str, rows: int, vocab: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  if kind == "flat":
    return (rng.normal(size=(rows, vocab)) * 0.1).astype(np.float32)
  zipf = -float(kind.split()[1]) * np.log(np.arange(1, vocab + 1))
  return np.stack([rng.permutation(zipf) for _ in range(rows)]).astype(np.float32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--vocab", type=int, default=49152)
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--zipf", default="1.2,1.5,2", help="exponents of the Zipf-shaped rows")
  args = parser.parse_args()
  half = args.rows // 2
  settings = {
      "none (top_p 1, top_k 0)": ([0] * args.rows, [1.0] * args.rows),
      "top_p 0.9": ([0] * args.rows, [1.0] * half + [0.9] * (args.rows - half)),
      "top_k 50": ([0] * half + [50] * (args.rows - half), [1.0] * args.rows),
      "top_k 50, top_p 0.95": ([0] * half + [50] * (args.rows - half),
                               [1.0] * half + [0.95] * (args.rows - half)),
  }
  run = jax.jit(decoding.filter_logits)
  print(f"{jax.devices()[0].device_kind}, {args.rows} rows x {args.vocab} tokens, "
        f"CANDIDATES {getattr(decoding, 'CANDIDATES', 'none (every filter sorts)')}")
  print("| logits | filter | nucleus size (top_p rows, median) | ms per call |\n|---|---|---|---|")
  for kind in [f"zipf {s}" for s in args.zipf.split(",")] + ["flat"]:
    logits = jnp.asarray(logits_of(kind, args.rows, args.vocab))
    for name, (top_k, top_p) in settings.items():
      top_k, top_p = jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)
      kept = np.asarray(jax.block_until_ready(run(logits, top_k, top_p)))
      seconds = []
      for _ in range(args.rounds):
        start = time.perf_counter()
        jax.block_until_ready(run(logits, top_k, top_p))
        seconds.append(time.perf_counter() - start)
      sizes = (kept[half:] > decoding.NEG_INF / 2).sum(axis=1)
      print(f"| {kind} | {name} | {int(np.median(sizes))} | "
            f"{statistics.median(seconds) * 1e3:.2f} |", flush=True)


if __name__ == "__main__":
  main()
