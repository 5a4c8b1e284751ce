"""Time from `--mode serve`'s start to its first answer, with JAX's compilation cache cold (a
fresh folder) and then warm (the same folder, a second start).

  python benchmarks/serve_start.py --smollm2_135m /tmp/smollm2_135m -- \\
      --config.max_source_length=64 --config.max_target_length=64

Prints, per start, the seconds until /health answers and until the first completion (8
tokens, greedy) is answered; arguments after `--` go to the server.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import serve_load


def one_start(args, cache: str) -> tuple[float, float]:
  port = serve_load.free_port()
  with tempfile.NamedTemporaryFile("w+", prefix="serve_start_", suffix=".log",
                                   delete=False) as log:
    start = time.perf_counter()
    server = serve_load.start_server(args, port, log, ["--compilation_cache", cache])
    ready = time.perf_counter() - start
    try:
      serve_load.post(f"http://127.0.0.1:{port}/v1/completions",
                      {"prompt": "A girl watches young apples.", "max_tokens": 8,
                       "temperature": 0})
      return ready, time.perf_counter() - start
    finally:
      server.terminate()
      server.wait(120)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  model = parser.add_mutually_exclusive_group(required=True)
  model.add_argument("--workdir")
  model.add_argument("--pretrained")
  model.add_argument("--smollm2_135m", metavar="DIR")
  parser.add_argument("--start_timeout", type=float, default=1800)
  parser.add_argument("server_args", nargs="*")
  args = parser.parse_args()
  args.fixed_length = False
  if args.smollm2_135m:
    if not os.path.exists(os.path.join(args.smollm2_135m, "config.json")):
      serve_load.make_smollm2_135m(args.smollm2_135m)
    args.pretrained = args.smollm2_135m
  with tempfile.TemporaryDirectory(prefix="serve_start_cache_") as cache:
    print("| start | compilation cache | /health answers | first answer |\n|---|---|---|---|")
    for i, state in enumerate(["cold (empty folder)", "warm (the first start's)"]):
      ready, answered = one_start(args, cache)
      print(f"| {i + 1} | {state} | {ready:.1f} s | {answered:.1f} s |", flush=True)


if __name__ == "__main__":
  main()
