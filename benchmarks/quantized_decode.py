"""Weights in float32, bfloat16, int8 and int4: the memory they take and greedy decode speed.

  python benchmarks/quantized_decode.py --pretrained /tmp/smollm2_135m [--make smollm2-135m] \
      [--weights float32,bfloat16,int8,int8+embeddings,int4,int4+embeddings] \
      [--group_size 64] [--batch_sizes 1,32] \
      [--new_tokens 32] [--rounds 3]

Each weight format runs in a process of its own (`Predictor.from_pretrained`; bfloat16: a
bfloat16 copy of the folder, FOLDER_bf16, served with config.model.dtype='bfloat16', which holds
its weights in bfloat16; int8 / int4: config.quantization.weights) and
reports: the bytes its parameters hold on the device, the process's peak resident memory (a
checkpoint's float32 read included: quantization happens at load), and greedy tokens per second
at each batch size (exactly --new_tokens per row, EOS held back; one untimed call first, then
the median of --rounds). --make builds the folder first (random weights at a known size:
benchmarks/compare_generate.py's SIZES). A benchmark, not a test.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import compare_generate  # noqa: E402  # pylint: disable=wrong-import-position


def measure(folder: str, weights: str, group_size: int, batch_sizes: list[int],
            new_tokens: int, rounds: int) -> dict:
  """One weight format's memory and tokens per second (run in a process of its own)."""
  from tests import hf_fixtures  # pylint: disable=import-outside-toplevel
  from transformer_jax import default_config  # pylint: disable=import-outside-toplevel
  from transformer_jax import predict  # pylint: disable=import-outside-toplevel
  from transformer_jax.model import quantization  # pylint: disable=import-outside-toplevel
  config = default_config.get_config()
  if weights == "bfloat16":
    config.model.dtype = "bfloat16"
    folder = bfloat16_copy(folder)
  elif weights.startswith(("int8", "int4")):  # 'int8+embeddings': the token embedding too
    config.quantization.update(weights=weights[:4], group_size=group_size,
                               embeddings=weights.endswith("+embeddings"))
  predictor = predict.Predictor.from_pretrained(folder, config)
  result = {"weights": weights,
            "parameter_bytes": quantization.parameter_bytes(predictor.device_params)}
  texts = hf_fixtures.model_sentences("en")
  for batch in batch_sizes:
    prompts = list(predictor._prompts([texts[i % len(texts)] for i in range(batch)]).values())  # pylint: disable=protected-access
    decoding = predictor.decoding_config(method="greedy", min_length=new_tokens - 1,
                                         max_decode_len=new_tokens)
    predictor.output_ids(prompts, 1, decoding)  # the compile
    seconds = []
    for _ in range(rounds):
      start = time.perf_counter()
      predictor.output_ids(prompts, 1, decoding)
      seconds.append(time.perf_counter() - start)
    result[f"batch{batch}_tokens_per_s"] = batch * new_tokens / statistics.median(seconds)
  result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  return result


def bfloat16_copy(folder: str) -> str:
  """FOLDER_bf16: the folder with its weights in bfloat16 (made once)."""
  import shutil  # pylint: disable=import-outside-toplevel
  import ml_dtypes  # pylint: disable=import-outside-toplevel
  from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
  copy = folder.rstrip("/") + "_bf16"
  if not os.path.exists(os.path.join(copy, "model.safetensors")):
    shutil.copytree(folder, copy, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
              os.path.join(copy, "model.safetensors"), metadata={"format": "pt"})
  return copy


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pretrained", required=True)
  parser.add_argument("--make", choices=sorted(compare_generate.SIZES))
  parser.add_argument("--weights",
                      default="float32,bfloat16,int8,int8+embeddings,int4,int4+embeddings")
  parser.add_argument("--group_size", type=int, default=0)  # int4: 0 = 128
  parser.add_argument("--batch_sizes", default="1,32")
  parser.add_argument("--new_tokens", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--one")  # internal: measure this format here
  args = parser.parse_args()
  batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
  if args.one:
    print(json.dumps(measure(args.pretrained, args.one, args.group_size, batch_sizes,
                             args.new_tokens, args.rounds)), flush=True)
    return
  if args.make and not os.path.exists(os.path.join(args.pretrained, "config.json")):
    compare_generate.make_folder(args.make, args.pretrained)
  rows = []
  for weights in args.weights.split(","):
    out = subprocess.run([sys.executable, __file__, "--pretrained", args.pretrained,
                          "--one", weights, "--group_size", str(args.group_size),
                          "--batch_sizes", args.batch_sizes, "--new_tokens",
                          str(args.new_tokens), "--rounds", str(args.rounds)],
                         capture_output=True, text=True, check=False,
                         env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS",
                                                                            "cpu")))
    if out.returncode:
      sys.exit(f"{weights} failed:\n{out.stderr[-3000:]}")
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps(rows[-1]), flush=True)
  base = rows[0]["parameter_bytes"]
  print(f"\n{'weights':16s} {'params MB':>10s} {'x first':>8s} {'peak RSS MB':>12s} "
        + " ".join(f"{'b' + str(b) + ' tok/s':>11s}" for b in batch_sizes))
  for row in rows:
    print(f"{row['weights']:16s} {row['parameter_bytes'] / 1e6:10.1f} "
          f"{row['parameter_bytes'] / base:7.2f}x {row['peak_rss_bytes'] / 1e6:12.0f} "
          + " ".join(f"{row[f'batch{b}_tokens_per_s']:11.1f}" for b in batch_sizes))


if __name__ == "__main__":
  main()
