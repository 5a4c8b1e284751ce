"""When a streamed row's tokens reach the server's event loop: one row decoded by the serving
batch decoder (`--mode serve`'s, in segments of serve.stream_steps tokens), the time from the
start of its batch to each hand-over of its tokens, against the batch's whole decode time.

  python benchmarks/stream_timing.py --pretrained /tmp/smollm2_135m --max_tokens 32 \
      --stream_steps 4

(`benchmarks/serve_load.py --smollm2_135m DIR` builds that random SmolLM2-135M-size
checkpoint.) In process, no HTTP: what a streamed request can be sent at the earliest. Prints
a Markdown table (median of --repeats decodes after a warm-up).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax import default_config  # noqa: E402  pylint: disable=g-import-not-at-top
from transformer_jax import predict  # noqa: E402  pylint: disable=g-import-not-at-top
from transformer_jax.serving import batch_decoder  # noqa: E402  pylint: disable=g-import-not-at-top


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pretrained", required=True)
  parser.add_argument("--max_tokens", type=int, default=32)
  parser.add_argument("--stream_steps", type=int, default=4)
  parser.add_argument("--prompt", default="A brave mouse brings a cup")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 16, args.max_tokens
  config.decoding.min_length = args.max_tokens  # every output max_tokens long
  predictor = predict.Predictor.from_pretrained(args.pretrained, config)
  decoder = batch_decoder.BatchDecoder(predictor, 1, args.stream_steps)
  prompt = np.asarray(predictor.family.prompt(predictor.tokenizer.encode(args.prompt)))
  times: dict[int, list[float]] = {}
  totals = []
  for repeat in range(args.repeats + 1):  # the first compiles
    start = time.perf_counter()
    seen = {}
    row = batch_decoder.Row(prompt, args.max_tokens,
                            on_tokens=lambda ids, _: seen.setdefault(len(ids),
                                                                     time.perf_counter()))
    decoder.decode([row])
    total = time.perf_counter() - start
    if repeat:
      totals.append(total)
      for count, when in seen.items():
        times.setdefault(count, []).append(when - start)
  whole = float(np.median(totals))
  print(f"| tokens handed over | seconds after the batch started | of the whole decode "
        f"({whole:.2f} s) |\n|---|---|---|")
  for count in sorted(times):
    at = float(np.median(times[count]))
    print(f"| {count} | {at:.2f} | {at / whole:.0%} |")


if __name__ == "__main__":
  main()
