"""Fine-tuning step time of a BERT-base-size classifier: this project against PyTorch transformers.

  python benchmarks/compare_encoder_step.py [--batch_size 32 --seq_len 128 --pad_fraction 0.25
      --rounds 3 --steps 2 --warmup 2 --attention_implementation reference]

Both sides: BERT-base's size (110M parameters: 12 layers, hidden 768, 12 heads, FFN 3072,
vocabulary 30522, 512 learned positions, 2 token types, all inputs type 0), post-LN with
epsilon 1e-12, exact (erf) GELU, a LayerNorm after the embeddings, a tanh pooler over the first
token and a dense head over 2 classes, float32, dropout 0.1 on embeddings, sub-layer outputs
and the pooled vector, 0.1 on the attention weights (--attention_dropout), none inside the
FFN; cross-entropy without label smoothing, AdamW (weight decay 0.01), random weights, random
tokens with the last --pad_fraction of every row padding (id 0, masked out of attention) and
random labels. Ours: `EncoderClassifier` from a `TransformerConfig` with those fields, in the
'encoder_classifier' family, trained by train.py's compiled step. PyTorch:
`BertForSequenceClassification` eager (its default attention, reported as torch_attention),
and compiled with `torch.compile` where that works (--compile); `torch.set_num_threads` is the
core count.

Each side runs in its own process and they take turns, `--steps` steps each per round, so
that both see the same drift of a shared machine; prints one JSON line: the minimum and the
median seconds per step over every timed step (step_s_min, step_s), and the ratios PyTorch
eager / ours of both (above 1: ours is faster). A benchmark, not a test.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BERT_BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, hidden_act="gelu",
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                 num_labels=2, pad_token_id=0)
# The same model in this project's fields (its vocabulary renumbers ids: no matter for speed).
OURS = dict(vocab_size=30522, emb_dim=768, num_heads=12, qkv_dim=768, mlp_dim=3072,
            num_layers=12, max_len=512, pre_ln=False, final_norm=False,
            layer_norm_epsilon=1e-12, norm="layernorm", ffn_activation="gelu", use_bias=True,
            position_embedding="learned", scale_embeddings=False, embedding_norm=True,
            num_token_types=2, pooling="cls_pooler", num_classes=2, dropout_rate=0.1,
            attention_dropout_rate=0.1, activation_dropout_rate=0.0)
LEARNING_RATE, WEIGHT_DECAY = 2e-5, 0.01


def random_batch(batch_size: int, seq_len: int, pad_fraction: float):
  """Token ids [b, len] (the last round(len * pad_fraction) of each row 0, padding) and labels
  [b], the same on both sides."""
  rng = np.random.default_rng(0)
  inputs = rng.integers(3, OURS["vocab_size"], (batch_size, seq_len), dtype=np.int32)
  inputs[:, seq_len - int(round(seq_len * pad_fraction)):] = 0
  labels = rng.integers(0, OURS["num_classes"], (batch_size,), dtype=np.int32)
  return inputs, labels


def jax_runner(args):
  import jax  # pylint: disable=g-import-not-at-top
  from transformer_jax import benchmark, families  # pylint: disable=g-import-not-at-top
  from transformer_jax.model import models  # pylint: disable=g-import-not-at-top
  model_config = models.TransformerConfig(**dict(
      OURS, attention_dropout_rate=args.attention_dropout,
      attention_implementation=args.attention_implementation))
  family = families.from_model_config(
      "encoder_classifier", model_config, label_smoothing=0.0,
      max_source_length=args.seq_len, learning_rate=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
  config = family.config
  inputs, labels = random_batch(args.batch_size, args.seq_len, args.pad_fraction)
  run = benchmark.train_step_runner(config, family, args.batch_size, args.seq_len,
                                    batch={"inputs": inputs, "labels": labels})
  return run, {"jax": jax.__version__}


def torch_runner(args, compile_model: bool):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(os.cpu_count())
  torch.manual_seed(0)
  model = transformers.BertForSequenceClassification(transformers.BertConfig(**dict(
      BERT_BASE, attention_probs_dropout_prob=args.attention_dropout))).train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
  forward = torch.compile(model) if compile_model else model
  inputs, labels = random_batch(args.batch_size, args.seq_len, args.pad_fraction)
  inputs, labels = torch.from_numpy(inputs).long(), torch.from_numpy(labels).long()
  mask = (inputs != 0).long()

  def run():
    optimizer.zero_grad(set_to_none=True)
    loss = forward(input_ids=inputs, attention_mask=mask, labels=labels).loss
    loss.backward()
    optimizer.step()

  return run, {"torch": torch.__version__, "transformers": transformers.__version__,
               "torch_threads": torch.get_num_threads(),
               "torch_attention": model.config._attn_implementation}  # pylint: disable=protected-access


def serve(args) -> None:
  """Child process: builds its side, warms up, says what it runs, then answers each 'N' with
  the seconds of each of N steps."""
  run, about = (jax_runner(args) if args.side == "jax" else
                torch_runner(args, args.side == "torch_compile"))
  for _ in range(args.warmup):
    run()
  print(json.dumps(about), flush=True)
  for line in sys.stdin:
    times = []
    for _ in range(int(line)):
      start = time.perf_counter()
      run()
      times.append(time.perf_counter() - start)
    print(json.dumps(times), flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--seq_len", type=int, default=128)
  parser.add_argument("--pad_fraction", type=float, default=0.25,
                      help="padding at the end of every row")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=2, help="timed steps per side and round")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps (the first compiles)")
  parser.add_argument("--attention_dropout", type=float, default=0.1, help="both sides")
  parser.add_argument("--attention_implementation", default="reference",
                      help="ours: config.model.attention_implementation ('xla' is used only "
                      "without attention dropout in training)")
  parser.add_argument("--compile", action="store_true", help="also torch.compile")
  parser.add_argument("--side", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.side:
    serve(args)
    return
  sides = ["jax", "torch_eager"] + (["torch_compile"] if args.compile else [])
  children, about = {}, {}
  for side in sides:
    children[side] = subprocess.Popen(
        [sys.executable, __file__, "--side", side] +
        [f"--{k}={v}" for k, v in vars(args).items() if k not in ("side", "compile")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    about.update(json.loads(children[side].stdout.readline()))
  times = {side: [] for side in sides}
  for _ in range(args.rounds):
    for side, child in children.items():
      child.stdin.write(f"{args.steps}\n")
      child.stdin.flush()
      times[side].extend(json.loads(child.stdout.readline()))
  for child in children.values():
    child.stdin.close()
    child.wait()
  medians = {side: round(statistics.median(t), 4) for side, t in times.items()}
  minima = {side: round(min(t), 4) for side, t in times.items()}
  print(json.dumps(dict(
      batch_size=args.batch_size, seq_len=args.seq_len, pad_fraction=args.pad_fraction,
      attention_dropout=args.attention_dropout,
      attention_implementation=args.attention_implementation,
      timed_steps=args.rounds * args.steps, step_s=medians, step_s_min=minima,
      speedup_vs_torch_eager=round(medians["torch_eager"] / medians["jax"], 2),
      speedup_vs_torch_eager_min=round(minima["torch_eager"] / minima["jax"], 2), **about)))


if __name__ == "__main__":
  main()
