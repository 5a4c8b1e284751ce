"""Beam-4 decoding speed with fewer key/value heads: grouped-query and multi-query attention
against multi-head attention on one model size, timed in turns.

  python benchmarks/gqa_decode.py --architecture decoder_only --rounds 5
  python benchmarks/gqa_decode.py --architecture encoder_decoder --rounds 5

The model: d 512, 8 query heads, 6 layers (encoder-decoder: 6 + 6), ff 2048, vocabulary 8,000,
random weights. 8 prompts of 256 tokens (DialogSum's dialogues), beam 4, exactly 64 output
tokens per prompt (EOS is never chosen), with the KV cache, as evaluation and predict decode
(`transformer_jax.benchmark`'s decoding). Each `--kv_heads` setting (8: multi-head, 2: a
quarter, 1: multi-query) is compiled once; every round then times each setting in turn, so
the machine's load drifts over all alike. Prints each round, then the medians and the speed-up
against the first setting.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

# pylint: disable=wrong-import-position
from transformer_jax import benchmark
from transformer_jax import default_config
from transformer_jax import families

PROMPTS, PROMPT_LEN, OUTPUT_LEN, BEAM = 8, 256, 64, 4


def decoder(architecture: str, kv_heads: int):
  """A compiled beam-4 decode of random prompts and its parameters, for `kv_heads`."""
  config = default_config.get_config()
  config.task, config.architecture = "summarization", architecture
  config.model.update(vocab_size=8000, emb_dim=512, num_heads=8, num_kv_heads=kv_heads,
                      num_layers=6, qkv_dim=512, mlp_dim=2048, max_len=PROMPT_LEN + OUTPUT_LEN,
                      pre_ln=True, dropout_rate=0.0)
  family = families.get(config)
  params = jax.jit(lambda: family.init_params(jax.random.PRNGKey(0)))()
  fn = jax.jit(functools.partial(benchmark._decode, family=family, decode_len=OUTPUT_LEN,  # pylint: disable=protected-access
                                 beam_size=BEAM, use_cache=True))
  return fn, params


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--architecture", default="decoder_only",
                      choices=["decoder_only", "encoder_decoder"])
  parser.add_argument("--kv_heads", default="8,2,1", help="comma-separated; the first is the "
                      "baseline")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--repeats", type=int, default=3, help="timed decodes per round")
  args = parser.parse_args()
  settings = [int(k) for k in args.kv_heads.split(",")]
  inputs = jnp.asarray(np.random.default_rng(0).integers(3, 8000, (PROMPTS, PROMPT_LEN)),
                       jnp.int32)
  compiled = {}
  for kv_heads in settings:
    fn, params = decoder(args.architecture, kv_heads)
    jax.block_until_ready(fn(params, inputs))  # compile
    compiled[kv_heads] = lambda fn=fn, params=params: jax.block_until_ready(fn(params, inputs))
  speeds = {k: [] for k in settings}
  for round_index in range(args.rounds):
    for kv_heads, run in compiled.items():
      seconds = benchmark._timed(run, args.repeats, 1)  # pylint: disable=protected-access
      speeds[kv_heads].append(PROMPTS * OUTPUT_LEN / seconds)
    print(f"round {round_index + 1}: " + ", ".join(
        f"{k} kv heads {v[-1]:,.1f}" for k, v in speeds.items()) + " output tokens/s", flush=True)
  baseline = statistics.median(speeds[settings[0]])
  print(f"{args.architecture}, {jax.devices()[0].device_kind}, beam {BEAM}, {PROMPTS} prompts "
        f"of {PROMPT_LEN} tokens, {OUTPUT_LEN} output tokens each:")
  for kv_heads, values in speeds.items():
    median = statistics.median(values)
    print(f"  {kv_heads} kv heads: median {median:,.1f} output tokens/s "
          f"(min {min(values):,.1f}, max {max(values):,.1f}); {median / baseline:.2f}x")


if __name__ == "__main__":
  main()
