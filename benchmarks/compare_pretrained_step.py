"""Fine-tuning step time of a t5-small-size model: this project against PyTorch transformers.

  python benchmarks/compare_pretrained_step.py [--batch_size 8 --seq_len 64 --rounds 5 --steps 3]

Both sides: T5 v1.0 at t5-small's size (60M parameters: d_model 512, 6 + 6 layers, 8 heads,
FFN 2048, vocabulary 32128, tied output with the d^-0.5 rescale, relative position bias),
float32, dropout 0.1, cross-entropy without label smoothing, Adam (AdamW in PyTorch, weight
decay 0), random tokens with sources and targets of --seq_len. Ours: the model that
`config.pretrained` builds for a T5 checkpoint (pretrained/t5.py's fields), trained by
train.py's compiled step. PyTorch: `T5ForConditionalGeneration` eager, and compiled with
`torch.compile` where that works (--compile).

Each side runs in its own process and they take turns, `--steps` steps each per round, so
that both see the same drift of a shared machine; prints one JSON line (median seconds per
step over the rounds, and the ratio). A benchmark, not a test.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

T5_SMALL = dict(model_type="t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=2048,
                num_layers=6, num_heads=8, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, dropout_rate=0.1, layer_norm_epsilon=1e-6,
                feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=0,
                eos_token_id=1, decoder_start_token_id=0)


def jax_runner(batch_size: int, seq_len: int):
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import benchmark, default_config, families  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import t5  # pylint: disable=g-import-not-at-top
  del jax
  config = default_config.get_config()
  config.model.update(t5.model_fields(T5_SMALL, tied=True), max_len=seq_len)
  config.update(label_smoothing=0.0, max_source_length=seq_len, max_target_length=seq_len)
  return benchmark.train_step_runner(config, families.get(config), batch_size, seq_len)


def torch_runner(batch_size: int, seq_len: int, compile_model: bool):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  hf = {k: v for k, v in T5_SMALL.items() if k != "model_type"}
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf)).train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
  forward = torch.compile(model) if compile_model else model
  inputs = torch.randint(3, T5_SMALL["vocab_size"], (batch_size, seq_len))
  labels = torch.randint(3, T5_SMALL["vocab_size"], (batch_size, seq_len))

  def run():
    optimizer.zero_grad(set_to_none=True)
    loss = forward(input_ids=inputs, labels=labels).loss
    loss.backward()
    optimizer.step()

  return run


def serve(args) -> None:
  """Child process: builds its side, warms up, then answers 'go' with the seconds per step."""
  run = (jax_runner(args.batch_size, args.seq_len) if args.side == "jax" else
         torch_runner(args.batch_size, args.seq_len, args.side == "torch_compile"))
  for _ in range(2):
    run()
  print("ready", flush=True)
  for line in sys.stdin:
    start = time.perf_counter()
    for _ in range(int(line)):
      run()
    print((time.perf_counter() - start) / int(line), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--compile", action="store_true", help="also torch.compile")
  parser.add_argument("--side", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.side:
    serve(args)
    return
  sides = ["jax", "torch_eager"] + (["torch_compile"] if args.compile else [])
  children = {}
  for side in sides:
    children[side] = subprocess.Popen(
        [sys.executable, __file__, "--side", side, "--batch_size", str(args.batch_size),
         "--seq_len", str(args.seq_len)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd=ROOT)
    assert children[side].stdout.readline().strip() == "ready", side
  times = {side: [] for side in sides}
  for _ in range(args.rounds):
    for side, child in children.items():
      child.stdin.write(f"{args.steps}\n")
      child.stdin.flush()
      times[side].append(float(child.stdout.readline()))
  for child in children.values():
    child.stdin.close()
    child.wait()
  medians = {side: statistics.median(t) for side, t in times.items()}
  print(json.dumps(dict(batch_size=args.batch_size, seq_len=args.seq_len,
                        step_s=medians, speedup_vs_torch_eager=round(
                            medians["torch_eager"] / medians["jax"], 2))))


if __name__ == "__main__":
  main()
