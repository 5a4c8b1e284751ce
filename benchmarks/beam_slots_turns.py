"""Beam search with shared cache slots against whole-cache beams, in one process, in turns.

  python benchmarks/beam_slots_turns.py --pretrained DIR [--batch 8] [--rounds 6]
  # DIR: a folder that compare_generate.py --make wrote (random weights at a known size)

Two `generate.Generator`s decode the same prompts (compare_generate.py's: a sentence each) with
beam 4 for exactly 32 tokens: one as predict does (beams read their slots where their
hypotheses wrote them, kv_cache.reorder_beams), one traced with the reorder that gathers every
layer's keys and values per step (what beam search did before). The calls alternate, so the
machine's drift hits both alike; prints each side's median and every round's seconds. A
benchmark, not a test.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compare_generate  # pylint: disable=g-import-not-at-top,wrong-import-position
from transformer_jax.inference import generate  # pylint: disable=g-import-not-at-top,wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pretrained", required=True)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=6)
  args = parser.parse_args()
  predictor, prompts, _ = compare_generate.prompts(args.pretrained, args.batch)
  family, params = predictor.family, predictor.device_params
  decoding = predictor.decoding_config(method="beam", beam_size=4, min_length=31,
                                       max_decode_len=32)
  generators = {"shared slots": generate.Generator(family, predictor.layout)}
  generators["shared slots"].output_ids(params, prompts, 1, decoding)  # compiled here
  # The whole-cache side: the callback without `beams`, beam search's default reorder.
  start_decoding, search = family.runner.start_decoding, generate.search
  family.runner.start_decoding = (lambda params, inputs, rows, max_len, packing=None, beams=1:
                           start_decoding(params, inputs, rows, max_len, packing))
  generate.search = lambda *a, reorder_cache=None, expand_beams=None, **kw: search(*a, **kw)
  generators["whole caches"] = generate.Generator(family, predictor.layout)
  generators["whole caches"].output_ids(params, prompts, 1, decoding)
  times = {name: [] for name in generators}
  for _ in range(args.rounds):
    for name, generator in generators.items():
      start = time.perf_counter()
      generator.output_ids(params, prompts, 1, decoding)
      times[name].append(time.perf_counter() - start)
  for name, seconds in times.items():
    print(f"{name}: median {statistics.median(seconds):.2f} s per call "
          f"({' '.join(f'{s:.2f}' for s in seconds)}), batch {args.batch}, beam 4, 32 tokens")


if __name__ == "__main__":
  main()
