"""Training throughput of transformer_jax against PyTorch eager `nn.Transformer`, same shapes.

  python benchmarks/compare_pytorch.py [--batch_size 32 --seq_len 32 --rounds 10 --steps 3]

Both sides: float32, shared embeddings tied to the output layer (vocab 8192), d_model 256,
4 heads, FFN 1024, 3 + 3 layers, dropout 0.1 on sub-layer outputs, FFN activations and
attention weights (PyTorch's default), sinusoidal positions, label smoothing 0.1, Adam
(0.9, 0.98, 1e-9), random tokens. PyTorch runs post-LN and pre-LN (`norm_first`); ours runs
post-LN, the paper's layout.

Each of the three runs in its own process, and they take turns: every round runs `--steps`
steps of each, in a shuffled order. A shared machine's speed drifts over seconds to minutes;
taking turns exposes all three to the same drift, and the per-round ratios compare steps
taken moments apart. Prints one JSON line; a benchmark, not a test.
"""

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, D_MODEL, HEADS, FFN, LAYERS = 8192, 256, 4, 1024, 3
RUNS = ("jax", "torch_post_ln", "torch_pre_ln")


def torch_step(batch_size, seq_len, norm_first):
  """A blocking training step of PyTorch eager nn.Transformer."""
  import torch
  from torch import nn
  from transformer_jax.model.layers import sinusoidal_positions
  torch.manual_seed(0)
  positions = torch.tensor(sinusoidal_positions(seq_len, D_MODEL))

  class Model(nn.Module):
    def __init__(self):
      super().__init__()
      self.embedding = nn.Embedding(VOCAB, D_MODEL)
      self.transformer = nn.Transformer(D_MODEL, HEADS, LAYERS, LAYERS, FFN, dropout=0.1,
                                        batch_first=True, norm_first=norm_first)

    def forward(self, source, decoder_inputs):
      embed = lambda ids: self.embedding(ids) * math.sqrt(D_MODEL) + positions
      causal = nn.Transformer.generate_square_subsequent_mask(seq_len)
      hidden = self.transformer(embed(source), embed(decoder_inputs), tgt_mask=causal,
                                tgt_is_causal=True)
      return hidden @ self.embedding.weight.T

  model = Model()
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
  source = torch.randint(3, VOCAB, (batch_size, seq_len))
  targets = torch.randint(3, VOCAB, (batch_size, seq_len))
  decoder_inputs = torch.cat([torch.full((batch_size, 1), 2), targets[:, :-1]], dim=1)

  def step():
    optimizer.zero_grad()
    logits = model(source, decoder_inputs)
    loss_fn(logits.reshape(-1, VOCAB), targets.reshape(-1)).backward()
    optimizer.step()

  return step, {"torch_version": torch.__version__, "torch_threads": torch.get_num_threads()}


def comparison_config(max_len: int):
  """configs/demo.py with this comparison's model: the shapes above, post-LN, dropout 0.1 on
  attention weights too, label smoothing 0.1."""
  from configs import demo
  config = demo.get_config()
  config.label_smoothing = 0.1
  config.model.update(vocab_size=VOCAB, emb_dim=D_MODEL, qkv_dim=D_MODEL, num_heads=HEADS,
                      mlp_dim=FFN, num_layers=LAYERS, max_len=max_len, dropout_rate=0.1,
                      attention_dropout_rate=0.1, pre_ln=False)
  return config


def jax_step(batch_size, seq_len):
  """A blocking training step of this project's EncoderDecoder, as `main` trains it."""
  import jax
  from transformer_jax import benchmark
  from transformer_jax import families
  config = comparison_config(max(64, seq_len))
  step = benchmark.train_step_runner(config, families.get(config), batch_size, seq_len)
  return step, {"jax_version": jax.__version__, "device": jax.devices()[0].device_kind}


def worker(run, batch_size, seq_len, warmup):
  """Builds `run`'s step, warms it up, then for every line N on stdin runs N steps and
  answers the mean seconds per step."""
  if run == "jax":
    step, info = jax_step(batch_size, seq_len)
  else:
    step, info = torch_step(batch_size, seq_len, norm_first=run == "torch_pre_ln")
  for _ in range(warmup):
    step()
  print(json.dumps(info), flush=True)
  for line in sys.stdin:
    steps = int(line)
    start = time.perf_counter()
    for _ in range(steps):
      step()
    print((time.perf_counter() - start) / steps, flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--seq_len", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--steps", type=int, default=3, help="steps per run and round")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    return worker(args.worker, args.batch_size, args.seq_len, args.warmup)

  info, workers = {}, {}
  for run in RUNS:  # started one at a time, so that no compilation overlaps a timed step
    workers[run] = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", run,
         "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len),
         "--warmup", str(args.warmup)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ready = workers[run].stdout.readline()
    if not ready:
      sys.exit(f"The {run} worker failed to start (its error is above).")
    info.update(json.loads(ready))
  seconds = {run: [] for run in RUNS}
  order = list(RUNS)
  shuffle = random.Random(0).shuffle
  for _ in range(args.rounds):
    shuffle(order)
    for run in order:
      workers[run].stdin.write(f"{args.steps}\n")
      workers[run].stdin.flush()
      seconds[run].append(float(workers[run].stdout.readline()))
  for process in workers.values():
    process.stdin.close()
    process.wait()

  median = {run: statistics.median(s) for run, s in seconds.items()}
  faster_torch = min(RUNS[1:], key=median.get)
  per_round = [t / j for t, j in zip(seconds[faster_torch], seconds["jax"])]
  tokens = args.batch_size * args.seq_len
  print(json.dumps({
      "batch_size": args.batch_size, "seq_len": args.seq_len, "rounds": args.rounds,
      "steps_per_round": args.steps, **info,
      **{f"{run}_step_s": median[run] for run in RUNS},
      "jax_tokens_per_s": tokens / median["jax"],
      "torch_best_tokens_per_s": tokens / median[faster_torch], "faster_torch": faster_torch,
      "speedup_vs_best_torch": median[faster_torch] / median["jax"],
      "speedup_per_round": {"median": statistics.median(per_round), "min": min(per_round),
                            "max": max(per_round)},
      "step_s_per_round": seconds}), flush=True)


if __name__ == "__main__":
  main()
