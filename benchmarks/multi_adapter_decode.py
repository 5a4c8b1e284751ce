"""What serving named LoRA adapters per row costs: the server's segmented greedy decode
(serving/batch_decoder.py, one static batch) of the base model alone, of one adapter merged
(`--adapter DIR`) and of rows alternating between named adapters (`--adapter NAME=DIR`).

  python benchmarks/multi_adapter_decode.py --pretrained /tmp/smollm2_135m [--make smollm2-135m] \
      [--adapters 2] [--rank 16] [--batch_sizes 1,8] [--new_tokens 32] [--rounds 3]

The adapters are written by peft (`--rank`, alpha 2 x rank, every linear layer, random B) into
FOLDER_adapters/. Each batch: one untimed call (the compile), then the median of --rounds;
tokens per second count the tokens generated. A benchmark, not a test.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import compare_generate  # noqa: E402  # pylint: disable=wrong-import-position


def write_adapters(folder: str, count: int, rank: int) -> dict[str, str]:
  """`count` PEFT adapters of `folder` (made once): {name: adapter folder}."""
  import peft  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  named = {}
  for i in range(count):
    path = os.path.join(folder.rstrip("/") + "_adapters", f"adapter{i}")
    named[f"adapter{i}"] = path
    if os.path.exists(os.path.join(path, "adapter_config.json")):
      continue
    torch.manual_seed(i)
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules="all-linear"))
    with torch.no_grad():
      for name, parameter in model.named_parameters():
        if "lora_B" in name:
          parameter.normal_(0.0, 0.02)
    model.save_pretrained(path)
  return named


def tokens_per_s(decoder, rows, rounds: int) -> float:
  decoder.decode(rows)  # the compile
  seconds, tokens = [], 0
  for _ in range(rounds):
    start = time.perf_counter()
    outputs = decoder.decode(rows)
    seconds.append(time.perf_counter() - start)
    tokens = sum(len(o.ids) for o in outputs)
  return tokens / statistics.median(seconds)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pretrained", required=True)
  parser.add_argument("--make", choices=sorted(compare_generate.SIZES))
  parser.add_argument("--adapters", type=int, default=2)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--batch_sizes", default="1,8")
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  if args.make and not os.path.exists(os.path.join(args.pretrained, "config.json")):
    compare_generate.make_folder(args.make, args.pretrained)
  named = write_adapters(args.pretrained, args.adapters, args.rank)
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tests import hf_fixtures  # pylint: disable=import-outside-toplevel
  from transformer_jax import default_config  # pylint: disable=import-outside-toplevel
  from transformer_jax import predict  # pylint: disable=import-outside-toplevel
  from transformer_jax.serving import adapters as adapters_lib  # pylint: disable=import-outside-toplevel
  from transformer_jax.serving import batch_decoder  # pylint: disable=import-outside-toplevel
  config = default_config.get_config()
  config.max_source_length, config.max_target_length = 32, args.new_tokens
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  base = predict.Predictor.from_pretrained(args.pretrained, config)
  merged = predict.Predictor.from_pretrained(args.pretrained, config,
                                             adapter=next(iter(named.values())))
  decoders = {
      "base": batch_decoder.BatchDecoder(base, max(batch_sizes)),
      "one merged": batch_decoder.BatchDecoder(merged, max(batch_sizes)),
      f"{args.adapters} named, per row": batch_decoder.BatchDecoder(
          base, max(batch_sizes), adapters=adapters_lib.load(base, named, "base"))}
  texts = hf_fixtures.model_sentences("en")
  print(f"{'adapters':24s} " + " ".join(f"{'b' + str(b) + ' tok/s':>11s}" for b in batch_sizes))
  for label, decoder in decoders.items():
    per_row = decoder.adapters is not None
    speeds = []
    for batch in batch_sizes:
      rows = [batch_decoder.Row(
          np.asarray(base.family.prompt(base.tokenizer.encode(texts[i % len(texts)]))),
          args.new_tokens, adapter=1 + i % args.adapters if per_row else 0)
              for i in range(batch)]
      speeds.append(tokens_per_s(decoder, rows, args.rounds))
    print(f"{label:24s} " + " ".join(f"{s:11.1f}" for s in speeds), flush=True)


if __name__ == "__main__":
  main()
