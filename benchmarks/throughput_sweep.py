"""Training throughput against batch size and sequence length, as a table and a plot.

  pip install matplotlib   # for the plot only
  python benchmarks/throughput_sweep.py --out benchmarks/results/throughput_cpu \
      [--batch_sizes 8,16,32,64 --seq_lens 16,32,64 --steps 4]

Model: the PyTorch-comparison shape (float32, vocab 8192 tied, d 256, 4 heads, FFN 1024, 3+3
layers, dropout 0.1), `configs/demo.py` otherwise, on random tokens, all local devices. Writes
OUT.json (one row per shape: step seconds, target tokens/s, MFU) and OUT.png (tokens/s
against batch size, one line per sequence length). A benchmark, not a test.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sweep(batch_sizes, seq_lens, steps):
  import jax
  from benchmarks.compare_pytorch import comparison_config
  from transformer_jax import benchmark
  from transformer_jax import flops
  from transformer_jax import families
  config = comparison_config(max_len=max(seq_lens))
  family = families.get(config)
  model_config = family.model_config
  peak, peak_source = flops.peak_tflops(model_config.dtype, jax.devices()[0])
  rows = []
  for seq_len in seq_lens:
    for batch_size in batch_sizes:
      speed = benchmark.train_speed(config, family, batch_size, seq_len, steps, warmup=1)
      step_flops = flops.train_step_flops(model_config, batch_size, seq_len, seq_len)
      rows.append(dict(batch_size=batch_size, seq_len=seq_len, **speed,
                       mfu=step_flops / speed["train_step_s"] / (peak * 1e12 *
                                                                 jax.device_count())))
      print(json.dumps(rows[-1]), flush=True)
  return rows, dict(device=jax.devices()[0].device_kind, devices=jax.device_count(),
                    peak_tflops=peak, peak_source=peak_source)


def plot(rows, info, path):
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  figure, axis = plt.subplots(figsize=(6, 4))
  for seq_len in sorted({r["seq_len"] for r in rows}):
    line = [r for r in rows if r["seq_len"] == seq_len]
    axis.plot([r["batch_size"] for r in line], [r["train_tokens_per_s"] for r in line],
              marker="o", label=f"sequence length {seq_len}")
  axis.set_xscale("log", base=2)
  axis.set_xlabel("batch size (rows)")
  axis.set_ylabel("target tokens / s (training)")
  axis.set_title(f"transformer_jax, d 256, 3+3 layers, vocab 8192, float32\n"
                 f"{info['devices']} x {info['device']}", fontsize=9)
  axis.grid(alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=110)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="benchmarks/results/throughput")
  parser.add_argument("--batch_sizes", default="8,16,32,64")
  parser.add_argument("--seq_lens", default="16,32,64")
  parser.add_argument("--steps", type=int, default=4)
  args = parser.parse_args()
  parse = lambda text: [int(x) for x in text.split(",")]
  rows, info = sweep(parse(args.batch_sizes), parse(args.seq_lens), args.steps)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(f"{args.out}.json", "w") as f:
    json.dump({**info, "rows": rows}, f, indent=1)
  plot(rows, info, f"{args.out}.png")
  print(f"Wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
  main()
