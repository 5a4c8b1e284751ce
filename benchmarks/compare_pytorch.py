"""Training throughput of transformer_jax against PyTorch eager `nn.Transformer`, same shapes.

  python benchmarks/compare_pytorch.py [--batch_size 32 --seq_len 32 --steps 20]

Both sides: float32, shared embeddings tied to the output layer (vocab 8192), d_model 256,
4 heads, FFN 1024, 3 + 3 layers, dropout 0.1 on sub-layer outputs, FFN activations and
attention weights (PyTorch's default), sinusoidal positions, label smoothing 0.1, Adam
(0.9, 0.98, 1e-9), random tokens. PyTorch runs post-LN and pre-LN (`norm_first`); ours runs
post-LN, the paper's layout. Prints one JSON line; a benchmark, not a test.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOCAB, D_MODEL, HEADS, FFN, LAYERS = 8192, 256, 4, 1024, 3


def torch_step_seconds(batch_size, seq_len, steps, warmup, norm_first):
  import torch
  from torch import nn
  from transformer_jax.layers import sinusoidal_positions
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

  for _ in range(warmup):
    step()
  start = time.perf_counter()
  for _ in range(steps):
    step()
  return (time.perf_counter() - start) / steps, torch.get_num_threads()


def jax_step_seconds(batch_size, seq_len, steps, warmup):
  from configs import demo
  from transformer_jax import benchmark
  from transformer_jax import models
  config = demo.get_config()
  config.label_smoothing = 0.1
  config.model.update(vocab_size=VOCAB, emb_dim=D_MODEL, qkv_dim=D_MODEL, num_heads=HEADS,
                      mlp_dim=FFN, num_layers=LAYERS, max_len=max(64, seq_len),
                      dropout_rate=0.1, attention_dropout_rate=0.1, pre_ln=False)
  model = models.EncoderDecoder(models.model_config(config.model))
  return benchmark.train_speed(config, model, batch_size, seq_len, steps, warmup)["train_step_s"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--seq_len", type=int, default=32)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  args = parser.parse_args()
  shape = (args.batch_size, args.seq_len, args.steps, args.warmup)
  ours = jax_step_seconds(*shape)
  post_ln, threads = torch_step_seconds(*shape, norm_first=False)
  pre_ln, _ = torch_step_seconds(*shape, norm_first=True)
  tokens = args.batch_size * args.seq_len
  print(json.dumps({
      "batch_size": args.batch_size, "seq_len": args.seq_len, "torch_threads": threads,
      "jax_step_s": ours, "torch_post_ln_step_s": post_ln, "torch_pre_ln_step_s": pre_ln,
      "jax_tokens_per_s": tokens / ours, "torch_best_tokens_per_s": tokens / min(post_ln, pre_ln),
      "speedup_vs_best_torch": min(post_ln, pre_ln) / ours}), flush=True)


if __name__ == "__main__":
  main()
