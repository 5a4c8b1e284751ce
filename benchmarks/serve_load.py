"""Load test of `--mode serve`: requests/s, generated tokens/s and p50 / p99 latency at a few
concurrencies, against a server this script starts (and stops) on 127.0.0.1.

  python benchmarks/serve_load.py --workdir runs/demo
  python benchmarks/serve_load.py --smollm2_135m /tmp/smollm2_135m --max_tokens 16 --fixed_length \
      --max_words 4 -- --config.max_source_length=16 --config.max_target_length=16

Each of `--concurrency` clients sends its next request as soon as the last is answered, for
`--requests` requests per concurrency (after a warm-up round); prompts are sentences of
different lengths, half of the requests greedy, half sampled with their own seed and
temperature (the server batches them together). With `--fixed_length` every output is
`--max_tokens` long (config.decoding.min_length: no EOS before it, as vLLM's benchmarks
use ignore_eos); otherwise outputs end where the model ends them. Arguments after `--` go to
the server (e.g. --config.serve.max_batch_size=16). With `--stream` the requests are
streamed and the table adds the median time to the first chunk carrying text. With
`--mixed LOW,HIGH` each request asks for its own max_tokens, drawn from LOW..HIGH (a mixed
workload), and the table adds the p50 latency of the short ones (max_tokens <= `--short`).
`--compare_static` runs the sweep twice, against a server that decodes each batch to its end
(serve.continuous_batching=False) and one with continuous batching; with `--static_root DIR`
the static side is the server of another checkout (e.g. `git worktree add DIR c42699e`, the
code issue #58 was filed against), measured once its /health answers. Prints a Markdown
table.

  python benchmarks/serve_load.py --smollm2_135m /tmp/smollm2_135m --requests 128 \
      --mixed 8,128 --compare_static -- --config.max_source_length=16 \
      --config.max_target_length=128
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Sentences of the demo's grammar (configs/demo.py's test split), of 5 to 13 words.
SENTENCES = [
    "He hopes that our tired woman feeds a key.", "A brave mouse brings a cup to the red horse.",
    "Now the girl sees my red cup.", "I think that my mice find our lazy friend.",
    "A girl watches young apples.", "Our big children like the woman.",
    "They believe that my teacher has given my new apple to our friend.",
    "A brave friend has visited my small neighbour.",
]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
  request = urllib.request.Request(url, json.dumps(body).encode(),
                                   {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=600) as response:
      return json.loads(response.read())
  except urllib.error.HTTPError as e:
    raise SystemExit(f"{body} -> HTTP {e.code}: {e.read().decode()}") from e


def start_server(args, port: int, log, server_args: list[str],
                 after_compile: bool = False, root: str = ROOT) -> subprocess.Popen:
  """The server of `args` on `port`, run from the code in `root`, once /health answers (with
  `after_compile`, once it has also compiled every shape)."""
  model = ["--workdir", args.workdir] if args.workdir else ["--pretrained", args.pretrained]
  extra = [f"--config.decoding.min_length={args.max_tokens}"] if args.fixed_length else []
  command = [sys.executable, "-m", "transformer_jax.main", "--mode", "serve", "--port",
             str(port), *model, *extra, *args.server_args, *server_args]
  process = subprocess.Popen(command, cwd=root, stdout=log, stderr=log)
  deadline = time.time() + args.start_timeout
  while time.time() < deadline:
    if process.poll() is not None:
      raise SystemExit(f"The server ended (exit {process.returncode}); see {log.name}")
    try:
      with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
        pass
    except OSError:
      time.sleep(1)
      continue
    # Measured once every shape has compiled: the background compile would take the CPU
    # from the first requests (the server answers before it has finished).
    with open(log.name, encoding="utf-8", errors="replace") as text:
      if "Compiled all" in text.read() or not after_compile:
        return process
    time.sleep(1)
  process.kill()
  raise SystemExit(f"The server did not start in {args.start_timeout} s; see {log.name}")


def post_streamed(url: str, body: dict) -> tuple[float, int]:
  """Sends a streamed request and reads its server-sent events: (seconds to the first chunk
  carrying text, completion tokens from the usage on the last chunk)."""
  request = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                   {"Content-Type": "application/json"})
  start, first, tokens = time.perf_counter(), None, 0
  try:
    with urllib.request.urlopen(request, timeout=600) as response:
      for line in response:
        if not line.startswith(b"data: {"):
          continue
        chunk = json.loads(line[len(b"data: "):])
        if first is None and any(c.get("text") for c in chunk.get("choices", ())):
          first = time.perf_counter() - start
        tokens = chunk.get("usage", {}).get("completion_tokens", tokens)
  except urllib.error.HTTPError as e:
    raise SystemExit(f"{body} -> HTTP {e.code}: {e.read().decode()}") from e
  return (first if first is not None else time.perf_counter() - start), tokens


def request_max_tokens(i: int, max_tokens: int, mixed: tuple[int, int] | None) -> int:
  """Request i's max_tokens: `max_tokens`, or drawn from the `mixed` range (fixed by i)."""
  if mixed is None:
    return max_tokens
  return int(np.random.default_rng(i).integers(mixed[0], mixed[1] + 1))


def request_body(i: int, max_tokens: int, max_words: int = 0) -> dict:
  words = SENTENCES[i % len(SENTENCES)].split()
  body = {"prompt": " ".join(words[:max_words or None]), "max_tokens": max_tokens}
  if i % 2:
    body.update(temperature=0.7 + 0.01 * (i % 30), seed=i)
  else:
    body.update(temperature=0)
  return body


def measure(url: str, concurrency: int, count: int, max_tokens: int, max_words: int,
            stream: bool = False, mixed: tuple[int, int] | None = None,
            short: int = 0) -> dict:
  """Sends `count` requests from `concurrency` clients; the round's statistics (with
  `stream`, streamed requests and their time to the first text; with `mixed`, the p50
  latency of the requests of at most `short` tokens)."""
  latencies, tokens, firsts, short_latencies = [], [], [], []

  def one(i: int):
    start = time.perf_counter()
    limit = request_max_tokens(i, max_tokens, mixed)
    if stream:
      first, count = post_streamed(url, request_body(i, limit, max_words))
      firsts.append(first)
      tokens.append(count)
    else:
      tokens.append(post(url, request_body(i, limit, max_words))["usage"][
          "completion_tokens"])
    latencies.append(time.perf_counter() - start)
    if limit <= short:
      short_latencies.append(latencies[-1])

  # The client's own collector stays out of the round: a full collection stops its threads.
  gc.collect()
  gc.disable()
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    list(pool.map(one, range(count)))
  elapsed = time.perf_counter() - start
  gc.enable()
  return {"concurrency": concurrency, "requests": count, "requests_per_s": count / elapsed,
          "tokens_per_s": sum(tokens) / elapsed, "tokens_per_request": np.mean(tokens),
          "p50_s": float(np.percentile(latencies, 50)),
          "p99_s": float(np.percentile(latencies, 99)),
          "first_p50_s": float(np.percentile(firsts, 50)) if firsts else float("nan"),
          "short_p50_s": (float(np.percentile(short_latencies, 50)) if short_latencies
                          else float("nan"))}


def make_smollm2_135m(folder: str) -> str:
  """A Hugging Face folder of a SmolLM2-135M-size Llama (30 blocks, 576 wide, 9 query / 3
  key-value heads, vocabulary 49152) with random weights and a small byte-level BPE tokenizer
  trained here (tests/hf_fixtures.py; ids past it are padding rows): no download needed."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, ROOT)
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  files = hf_fixtures.llama_tokenizer_files(folder, hf_fixtures.model_sentences("en"))
  config = transformers.LlamaConfig(
      vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
      bos_token_id=files.tokenizer.bos_token_id, eos_token_id=files.tokenizer.eos_token_id)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(folder)
  return folder


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  model = parser.add_mutually_exclusive_group(required=True)
  model.add_argument("--workdir")
  model.add_argument("--pretrained")
  model.add_argument("--smollm2_135m", metavar="DIR", help="build a random SmolLM2-135M-size "
                     "checkpoint in DIR (if not there yet) and serve it")
  parser.add_argument("--concurrency", default="1,8,32")
  parser.add_argument("--requests", type=int, default=64, help="per concurrency")
  parser.add_argument("--max_tokens", type=int, default=28)
  parser.add_argument("--fixed_length", action="store_true")
  parser.add_argument("--max_words", type=int, default=0,
                      help="prompts cut to their first N words (0: whole sentences)")
  parser.add_argument("--stream", action="store_true",
                      help="streamed requests; also reports the time to the first text")
  parser.add_argument("--start_timeout", type=float, default=1800)
  parser.add_argument("--mixed", metavar="LOW,HIGH",
                      help="each request's max_tokens drawn from LOW..HIGH")
  parser.add_argument("--short", type=int, default=32,
                      help="with --mixed: the p50 latency of requests of at most this many")
  parser.add_argument("--after_compile", action=argparse.BooleanOptionalAction, default=True,
                      help="start once the server has compiled every shape (its log says "
                      "'Compiled all'); --no-after_compile: as soon as /health answers")
  parser.add_argument("--compare_static", action="store_true",
                      help="the sweep against static batching, then continuous batching")
  parser.add_argument("--static_root", metavar="DIR",
                      help="with --compare_static: the static side's server runs the code in "
                      "DIR (a `git worktree` of a commit from before continuous batching, "
                      "which compiles every shape before it answers /health)")
  parser.add_argument("server_args", nargs="*")
  args = parser.parse_args()
  if args.smollm2_135m:
    if not os.path.exists(os.path.join(args.smollm2_135m, "config.json")):
      make_smollm2_135m(args.smollm2_135m)
    args.pretrained = args.smollm2_135m
  mixed = tuple(int(x) for x in args.mixed.split(",")) if args.mixed else None
  static = (["--config.serve.continuous_batching=false"], ROOT)
  if args.static_root:
    static = ([], os.path.abspath(args.static_root))
  sides = ([("static", *static), ("continuous", [], ROOT)] if args.compare_static
           else [(None, [], ROOT)])
  first = " p50 time to first text |" if args.stream else ""
  short = f" p50 latency, max_tokens <= {args.short} |" if mixed else ""
  print(("| server " if args.compare_static else "") +
        "| concurrency | requests | requests/s | generated tokens/s | tokens/request | "
        f"p50 latency | p99 latency |{first}{short}\n" + "|---" * args.compare_static +
        "|---|---|---|---|---|---|---|" + "---|" * (args.stream + bool(mixed)), flush=True)
  for label, server_args, root in sides:
    sweep(args, server_args, label, mixed, root)


def sweep(args, server_args: list[str], label: str | None,
          mixed: tuple[int, int] | None, root: str = ROOT) -> None:
  """Starts a server, measures each concurrency, prints a table row each, stops it."""
  port = free_port()
  url = f"http://127.0.0.1:{port}/v1/completions"
  with tempfile.NamedTemporaryFile("w+", prefix="serve_load_", suffix=".log",
                                   delete=False) as log:
    start = time.perf_counter()
    server = start_server(args, port, log, server_args, args.after_compile and root == ROOT,
                          root)
    print(f"Server{' (' + label + ')' if label else ''} ready in "
          f"{time.perf_counter() - start:.0f} s (log: {log.name})", flush=True)
    try:
      levels = [int(c) for c in args.concurrency.split(",")]
      measure(url, max(levels), max(levels), args.max_tokens, args.max_words,
              args.stream, mixed, args.short)  # warm-up
      for level in levels:
        r = measure(url, level, max(args.requests, level), args.max_tokens, args.max_words,
                    args.stream, mixed, args.short)
        first = f" {r['first_p50_s'] * 1000:.0f} ms |" if args.stream else ""
        short = f" {r['short_p50_s'] * 1000:.0f} ms |" if mixed else ""
        print((f"| {label} " if label else "") +
              f"| {level} | {r['requests']} | {r['requests_per_s']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['tokens_per_request']:.1f} | "
              f"{r['p50_s'] * 1000:.0f} ms | {r['p99_s'] * 1000:.0f} ms |{first}{short}",
              flush=True)
    finally:
      server.terminate()
      server.wait(120)


if __name__ == "__main__":
  main()
