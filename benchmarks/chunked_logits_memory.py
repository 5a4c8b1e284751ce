"""Seconds per fine-tuning step (ours, float32, on JAX's default backend) and the process's
peak resident memory, with `config.logits_chunk_length` N; run one process per N:

  python benchmarks/chunked_logits_memory.py --model smollm2-135m --batch_size 4 \
      --seq_len 512 --logits_chunk_length 128

The model and step are compare_pretrained_step.py's (its --model choices). Prints one JSON line
(median of 5 steps after 2). The resident peak is a CPU figure: on a GPU, see the device's
own memory (benchmark.py's peak_memory_bytes). A benchmark, not a test.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import compare_pretrained_step  # pylint: disable=wrong-import-position


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="smollm2-135m",
                      choices=list(compare_pretrained_step.MODELS))
  parser.add_argument("--batch_size", type=int, default=4)
  parser.add_argument("--seq_len", type=int, default=512)
  parser.add_argument("--logits_chunk_length", type=int, default=0)
  args = parser.parse_args()
  args.dtype = "float32"
  run, _ = compare_pretrained_step.jax_runner(args)
  for _ in range(2):
    run()
  seconds = []
  for _ in range(5):
    start = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - start)
  print(json.dumps(dict(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                        logits_chunk_length=args.logits_chunk_length,
                        step_s=statistics.median(seconds),
                        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)))


if __name__ == "__main__":
  main()
