"""LoRA against full fine-tuning on the same model, shapes and machine: step time, peak memory,
optimizer state and what each step's checkpoint holds.

  python benchmarks/compare_lora.py [--model t5-base|qwen2.5-0.5b|qwen2.5-1.5b] [--rank 16]
      [--targets all] [--batch_size 8 --seq_len 64 --rounds 3 --steps 2]

Models (random weights, float32 parameters, dropout 0.1): t5-base (223M: d_model 768, 12 + 12
layers, 12 heads, FFN 3072, T5 v1.0), qwen2.5-0.5b, Qwen2.5-0.5B's sizes (494M: 24 Llama
blocks, d 896, 14 query / 2 key-value heads, SwiGLU 4864, q/k/v biases, vocabulary 151936,
tied) and qwen2.5-1.5b, Qwen2.5-1.5B's (1.54B: 28 blocks, d 1536, 12 / 2 heads, SwiGLU
8960), built as `config.pretrained` would build them (pretrained/t5.py, pretrained/llama.py).
Variants, each in a process of its own, taking turns (--rounds of --steps steps each):
  full         every weight trained (Adam moments for all of them);
  lora         rank --rank adapters on --targets (config.lora), the base frozen in float32;
  lora_bf16    the same with the frozen base held in bfloat16 (config.lora.base_dtype);
  lora_int8, lora_int4  the same over a base whose kernels are int8 / int4 (QLoRA; int4 in
               groups of 128); lora_int8e, lora_int4e: its token embedding int8 too
               (config.quantization.embeddings).
--variants picks them (default full,lora,lora_bf16); ratios are against the first. --remat:
every variant with config.model.remat (each layer recomputed in the backward pass);
--logits_chunk_length N: every variant with the fused output layer and loss over N positions
at a time (config.logits_chunk_length, config.fused_loss).
Per variant: the median seconds per step over the rounds after two warm-up steps, the
process's peak resident memory (ru_maxrss), the bytes the compiled step needs (XLA's memory
analysis: its arguments, outputs and temporaries), the optimizer state's bytes, and the bytes of the
arrays a step's checkpoint writes (the trained parameters and their optimizer state; a LoRA
run's frozen base is written once, not per step). Prints one JSON line. A benchmark, not a test.
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
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from compare_pretrained_step import T5_SMALL  # noqa: E402 pylint: disable=g-import-not-at-top

QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                  intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                  eos_token_id=151643)
QWEN25_15B = dict(QWEN25_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12)
MODELS = {"t5-base": dict(T5_SMALL, d_model=768, d_ff=3072, num_layers=12, num_heads=12),
          "qwen2.5-0.5b": QWEN25_05B, "qwen2.5-1.5b": QWEN25_15B}
# The frozen base's config.lora.base_dtype per LoRA variant.
BASE_DTYPES = {"lora": "float32", "lora_bf16": "bfloat16", "lora_int8": "int8",
               "lora_int4": "int4", "lora_int8e": "int8", "lora_int4e": "int4"}


def serve(args) -> None:
  """Child process: builds one variant, warms up, answers each line N on stdin with its
  seconds per step over N steps, and at the end of stdin prints its memory and sizes."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from transformer_jax import benchmark, default_config, families  # pylint: disable=g-import-not-at-top
  from transformer_jax.model import quantization  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import llama, t5  # pylint: disable=g-import-not-at-top
  hf, seq_len = MODELS[args.model], args.seq_len
  config = default_config.get_config()
  config.label_smoothing = 0.0
  config.model.remat = args.remat
  config.update(logits_chunk_length=args.logits_chunk_length,
                fused_loss=args.logits_chunk_length > 0)
  batch = None
  if hf["model_type"] == "t5":
    config.model.update(t5.model_fields(hf, tied=True), max_len=seq_len)
    config.update(max_source_length=seq_len, max_target_length=seq_len)
  else:
    families.set_family(config, "decoder_only")
    config.model.update(llama.model_fields(hf, tied=True), dropout_rate=0.1)
    config.update(max_source_length=0, max_target_length=seq_len)
    rng = np.random.default_rng(0)
    shape = (args.batch_size, seq_len)
    batch = {"targets": rng.integers(3, hf["vocab_size"], shape, dtype=np.int32),
             "weights": np.ones(shape, np.float32)}
  if args.side != "full":
    config.lora.update(rank=args.rank, targets=args.targets, base_dtype=BASE_DTYPES[args.side])
    config.quantization.embeddings = args.side.endswith("e")
  run, state, step_bytes = benchmark.train_step_runner(
      config, families.get(config), args.batch_size, seq_len, batch=batch, with_state=True)
  for _ in range(2):
    run()
  print("ready", flush=True)
  for line in sys.stdin:
    start = time.perf_counter()
    for _ in range(int(line)):
      run()
    print((time.perf_counter() - start) / int(line), flush=True)
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  current = state()
  print(json.dumps(dict(
      peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
      step_gb=step_bytes() / 2**30,
      trained_params=sum(x.size for x in jax.tree.leaves(current.params)),
      frozen_params=sum(x.size for x in jax.tree.leaves(current.frozen)),
      frozen_mb=quantization.parameter_bytes(current.frozen) / 2**20,
      optimizer_state_mb=nbytes(current.opt_state) / 2**20,
      checkpoint_per_step_mb=(nbytes(current.params) + nbytes(current.opt_state)) / 2**20)),
        flush=True)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="t5-base", choices=list(MODELS))
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--targets", default="all")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--steps", type=int, default=2)
  parser.add_argument("--variants", default="full,lora,lora_bf16")
  parser.add_argument("--remat", action="store_true")  # config.model.remat: layers recomputed
  parser.add_argument("--logits_chunk_length", type=int, default=0)
  parser.add_argument("--side", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.side:
    serve(args)
    return
  variants = args.variants.split(",")
  children = {}
  for side in variants:
    children[side] = subprocess.Popen(
        [sys.executable, __file__, "--side", side, "--model", args.model, "--rank",
         str(args.rank), "--targets", args.targets, "--batch_size", str(args.batch_size),
         "--seq_len", str(args.seq_len), "--logits_chunk_length", str(args.logits_chunk_length)]
        + ["--remat"] * args.remat, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=ROOT)
    assert children[side].stdout.readline().strip() == "ready", side
  times = {side: [] for side in variants}
  for _ in range(args.rounds):  # turns, so that every variant sees the same machine
    for side, child in children.items():
      child.stdin.write(f"{args.steps}\n")
      child.stdin.flush()
      times[side].append(float(child.stdout.readline()))
  result = dict(model=args.model, rank=args.rank, targets=args.targets,
                batch_size=args.batch_size, seq_len=args.seq_len, remat=args.remat,
                logits_chunk_length=args.logits_chunk_length)
  for side, child in children.items():
    child.stdin.close()
    result[side] = dict(step_s=statistics.median(times[side]),
                        **json.loads(child.stdout.readline()))
    child.wait()
  for side in variants[1:]:
    result[f"{side}_vs_{variants[0]}"] = {
        key: (round(result[side][key] / result[variants[0]][key], 3)
              if result[variants[0]][key] else None)  # full fine-tuning freezes nothing
        for key in ("step_s", "peak_rss_gb", "step_gb", "frozen_mb", "optimizer_state_mb",
                    "checkpoint_per_step_mb")}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
