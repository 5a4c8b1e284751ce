"""The server's slot pool reading a burst of new rows: packed (prompt_packing.py) against
unpacked, the time of one refill of --rows prompts of different lengths.

  python benchmarks/pool_refill.py --pretrained /tmp/smollm2_135m [--make smollm2-135m] \
      [--rows 32] [--source_length 64] [--rounds 5]

Prompts are the starts of one long text, 6 to source_length tokens, spread evenly. Each
refill reads them all into an empty pool, timed from the call to its cache being ready (one
untimed refill first: the compile; then the median of --rounds). A benchmark, not a test.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import compare_generate  # noqa: E402  # pylint: disable=wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pretrained", required=True)
  parser.add_argument("--make", choices=sorted(compare_generate.SIZES))
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--source_length", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  if args.make and not os.path.exists(os.path.join(args.pretrained, "config.json")):
    compare_generate.make_folder(args.make, args.pretrained)
  # pylint: disable=import-outside-toplevel,protected-access
  import jax
  import numpy as np
  from tests import hf_fixtures
  from transformer_jax import default_config
  from transformer_jax import predict
  from transformer_jax.serving import batch_decoder
  from transformer_jax.serving import slot_pool
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = args.source_length, 16
  predictor = predict.Predictor.from_pretrained(args.pretrained, config)
  decoder = batch_decoder.BatchDecoder(predictor, args.rows)
  ids = predictor.tokenizer.encode(" ".join(hf_fixtures.model_sentences("en")))
  lengths = np.linspace(6, args.source_length, args.rows).astype(int)
  rows = [batch_decoder.Row(np.asarray(ids[:n], np.int32), 1) for n in lengths]
  print(f"{args.rows} prompts of {lengths.min()} to {lengths.max()} tokens "
        f"({lengths.sum()} in all, {args.rows * args.source_length} padded)")
  for packs in (False, True):
    pool = slot_pool.SlotPool(decoder)
    pool.packs = packs
    # The shapes a server's warm-up compiles for this burst (a packed refill is used once
    # compiled).
    pool.warm_up(shapes=[s for s in pool.shapes() if s[:2] == (args.source_length, args.rows)])
    seconds = []
    for _ in range(args.rounds + 1):
      pool.fail_all()
      pool._carried = jax.block_until_ready(pool._start())
      start = time.perf_counter()
      pool.admit(rows, list(range(args.rows)))
      jax.block_until_ready(pool._carried)
      seconds.append(time.perf_counter() - start)
    packed = pool.packed_rows(args.rows) if pool.packed_refills else args.rows
    print(f"{'packed' if packs else 'unpacked':9s} prompts read in {packed:3d} rows: "
          f"refill {statistics.median(seconds[1:]) * 1e3:8.1f} ms", flush=True)


if __name__ == "__main__":
  main()
