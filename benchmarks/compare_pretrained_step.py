"""Fine-tuning step time of an imported model's architecture: this project against PyTorch
transformers, on the same shapes.

  python benchmarks/compare_pretrained_step.py [--model t5-small|t5-base|gpt2-0.5b|smollm2-135m]
      [--dtype float32|bfloat16] [--device cpu|cuda] [--compile] [--logits_chunk_length N]
      [--batch_size 8 --seq_len 64 --rounds 5 --steps 3] [--attention auto,tokamax]
      [--torch eager,compile|none]

Models, the same on both sides: t5-small (60M parameters: d_model 512, 6 + 6 layers, 8 heads,
FFN 2048) and t5-base (223M: d_model 768, 12 + 12 layers, 12 heads, FFN 3072), T5 v1.0 (relu,
vocabulary 32128, tied output with the d^-0.5 rescale, relative position bias); gpt2-0.5b, a
GPT-2 (pre-LN, learned positions, tanh GELU, tied output) of 506M parameters: n_embd 1024,
36 layers, 16 heads, 1024 positions, vocabulary 50257; smollm2-135m, SmolLM2-135M's sizes (30
Llama blocks, d 576, 9 query and 3 key/value heads, SwiGLU 1536, tied, no dropout: the
decoder_only family as gpt2-0.5b, LlamaForCausalLM in PyTorch). Both sides: dropout 0.1,
cross-entropy without label smoothing, Adam (AdamW in PyTorch, weight decay 0), float32
parameters (--dtype bfloat16: bf16 compute), random token ids.

Each step computes, per row of --seq_len tokens:
  t5        ours: `config.pretrained`'s model for a T5 checkpoint (pretrained/t5.py's fields),
            source and target of --seq_len tokens, loss on all target positions. PyTorch:
            `T5ForConditionalGeneration(input_ids, labels=labels)`, the same lengths.
  gpt2-0.5b ours: `config.pretrained`'s model for a GPT-2 checkpoint (pretrained/gpt2.py's
            fields, the decoder_only family), one sequence of --seq_len tokens as `targets`
            with loss weight 1 everywhere: the model shifts it right behind bos, so the loss
            covers all --seq_len positions (plain LM, no source part). PyTorch:
            `GPT2LMHeadModel(input_ids, labels=input_ids)`: --seq_len positions read, the loss
            on the --seq_len - 1 next-token predictions.
Ours is trained by train.py's compiled step on JAX's default backend (config.model.dtype
'bfloat16' for --dtype bfloat16); PyTorch on --device, eager and, with --compile, under
`torch.compile`, its forward under `torch.autocast(dtype=torch.bfloat16)` for --dtype bfloat16
(on cuda: fused AdamW, and a `torch.cuda.synchronize()` ending each step).
--logits_chunk_length sets ours' `config.logits_chunk_length` (output layer and loss over that
many positions at a time). --attention_dropout R replaces gpt2-0.5b's attn_pdrop (0.1) on
both sides: above 0, ours runs the reference attention (the dropout needs the weights); at 0,
'auto' (cuDNN flash attention on a GPU). PyTorch's SDPA fuses the dropout either way.
--attention IMPL[,IMPL...] sets ours' config.model.attention_implementation (default 'auto'; a
kernel of transformer_jax/kernels.py; IMPL:chunkedN and IMPL:fusedN set that side's
config.logits_chunk_length to N, the latter with config.fused_loss), one JAX side per name;
--torch picks PyTorch's sides
(default eager, and compile with --compile; 'none': ours alone).
--profile_dir DIR runs ours alone, in this process: --rounds x --steps timed steps after the
warm-up, then a jax.profiler trace of 3 more in DIR (benchmarks/trace_summary.py sums it).

Each side runs in its own process and they take turns, `--steps` steps each per round, so
that both see the same drift of a shared machine; prints one JSON line (median seconds per
step over the rounds, and the ratios). A benchmark, not a test. gpt2-0.5b on the CPU needs
more memory than the 24 GB dev machine has: there its JAX side, building beside PyTorch's,
is killed (out of memory); --profile_dir (ours alone) runs.
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
# Parameters: 51.5M token + 1.0M position embeddings, 36 x 12.6M blocks = 506M.
GPT2_05B = dict(model_type="gpt2", vocab_size=50257, n_embd=1024, n_layer=36, n_head=16,
                n_positions=1024, activation_function="gelu_new", resid_pdrop=0.1,
                embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
                tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256)
# HuggingFaceTB/SmolLM2-135M's sizes: 30 Llama blocks, 9 query / 3 key-value heads, tied.
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                    eos_token_id=2)
MODELS = {"t5-small": T5_SMALL,
          "t5-base": dict(T5_SMALL, d_model=768, d_ff=3072, num_layers=12, num_heads=12),
          "gpt2-0.5b": GPT2_05B, "smollm2-135m": SMOLLM2_135M}


def hf_fields(args) -> dict:
  """The model's transformers config fields, with --attention_dropout where given."""
  hf = dict(MODELS[args.model])
  if args.attention_dropout is not None:
    if hf["model_type"] != "gpt2":
      raise SystemExit("--attention_dropout is for gpt2-0.5b (T5 and SmolLM2 have none apart)")
    hf["attn_pdrop"] = args.attention_dropout
  return hf


def jax_runner(args):
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from transformer_jax import benchmark, default_config, families  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import gpt2, llama, t5  # pylint: disable=g-import-not-at-top
  hf, seq_len = hf_fields(args), args.seq_len
  config = default_config.get_config()
  config.label_smoothing = 0.0
  if hf["model_type"] == "t5":
    config.model.update(t5.model_fields(hf, tied=True), max_len=seq_len)
    config.update(max_source_length=seq_len, max_target_length=seq_len)
    batch = None  # the runner's random sources and targets
  else:
    # As pretrained_run.apply sets up a GPT-2 checkpoint: its family, its fields (max_len: its
    # positions). The whole row is the target part: no source, every position weighs 1.
    families.set_family(config, "decoder_only")
    module = gpt2 if hf["model_type"] == "gpt2" else llama
    config.model.update(module.model_fields(hf, tied=True))
    config.update(max_source_length=0, max_target_length=seq_len)
    rng = np.random.default_rng(0)
    shape = (args.batch_size, seq_len)
    batch = {"targets": rng.integers(3, hf["vocab_size"], shape, dtype=np.int32),
             "weights": np.ones(shape, np.float32)}
  config.model.dtype = args.dtype  # parameters stay float32
  config.logits_chunk_length = args.logits_chunk_length
  # --attention's 'IMPL:chunkedN' / 'IMPL:fusedN' sides: the output layer and loss over N
  # positions at a time, recomputed or fused with their gradients (output_loss.py).
  config.model.attention_implementation, _, variant = args.attention.partition(":")
  if variant:
    config.fused_loss = variant.startswith("fused")
    config.logits_chunk_length = int(variant.removeprefix("fused").removeprefix("chunked"))
  run = benchmark.train_step_runner(config, families.get(config), args.batch_size, seq_len,
                                    batch=batch)
  return run, jax.default_backend()


def torch_runner(args, compile_model: bool):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  hf = hf_fields(args)
  model_type = hf.pop("model_type")
  is_t5 = model_type == "t5"
  if is_t5:
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**hf))
  elif model_type == "llama":
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
  else:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf))
  model = model.to(args.device).train()
  cuda = args.device == "cuda"
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0,
                                **(dict(fused=True) if cuda else {}))
  forward = torch.compile(model) if compile_model else model
  shape = (args.batch_size, args.seq_len)
  inputs = torch.randint(3, hf["vocab_size"], shape, device=args.device)
  labels = (torch.randint(3, hf["vocab_size"], shape, device=args.device)
            if is_t5 else inputs)  # GPT-2 shifts its labels itself
  bf16 = args.dtype == "bfloat16"

  def run():
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(args.device, dtype=torch.bfloat16, enabled=bf16):
      loss = forward(input_ids=inputs, labels=labels).loss
    loss.backward()
    optimizer.step()
    if cuda:  # CUDA runs asynchronously: the step ends when the GPU is done
      torch.cuda.synchronize()

  return run, torch.__version__


def serve(args) -> None:
  """Child process: builds its side, warms up, then answers 'go' with the seconds per step."""
  run, info = (jax_runner(args) if args.side == "jax" else
               torch_runner(args, args.side == "torch_compile"))
  if args.side == "jax":
    info = f"{info}:{args.attention}"
  for _ in range(2):
    run()
  print("ready", info, flush=True)
  for line in sys.stdin:
    start = time.perf_counter()
    for _ in range(int(line)):
      run()
    print((time.perf_counter() - start) / int(line), flush=True)


def profile(args) -> None:
  """Ours alone: the median step over --rounds of --steps, then a trace of 3 steps."""
  from transformer_jax import benchmark  # pylint: disable=g-import-not-at-top
  run, backend = jax_runner(args)
  for _ in range(2):
    run()
  timed = benchmark._timed  # pylint: disable=protected-access
  rounds = [timed(run, args.steps, warmup=0) for _ in range(args.rounds)]
  benchmark.trace_steps(run, args.profile_dir)
  print(json.dumps(dict(model=args.model, dtype=args.dtype, jax_backend=backend,
                        logits_chunk_length=args.logits_chunk_length,
                        attention_dropout=hf_fields(args).get("attn_pdrop"),
                        batch_size=args.batch_size, seq_len=args.seq_len,
                        step_s=statistics.median(rounds), profile_dir=args.profile_dir)))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="t5-small", choices=list(MODELS))
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                      help="PyTorch's device (JAX uses its default backend)")
  parser.add_argument("--batch_size", type=int, default=8)
  parser.add_argument("--seq_len", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--compile", action="store_true", help="also torch.compile")
  parser.add_argument("--logits_chunk_length", type=int, default=0)
  parser.add_argument("--attention_dropout", type=float,
                      help="gpt2-0.5b's attn_pdrop on both sides (default: its 0.1)")
  parser.add_argument("--profile_dir", help="ours alone, then a trace of 3 steps here")
  parser.add_argument("--attention", default="auto",
                      help="ours' attention implementation(s), comma-separated")
  parser.add_argument("--torch", help="PyTorch sides: eager,compile or none "
                      "(default: eager, and compile with --compile)")
  parser.add_argument("--side", help=argparse.SUPPRESS)
  args = parser.parse_args()
  hf_fields(args)  # a wrong --attention_dropout stops here, before any child starts
  if args.side:
    serve(args)
    return
  if args.profile_dir:
    profile(args)
    return
  torch_sides = (args.torch or ("eager,compile" if args.compile else "eager")).split(",")
  jax_sides = [f"jax:{name}" for name in args.attention.split(",")]
  sides = jax_sides + [f"torch_{name}" for name in torch_sides if name != "none"]
  # The sides share one GPU at once, and JAX would preallocate 75% of its memory.
  fraction = f"{0.9 / (len(jax_sides) + 1):.2f}"
  jax_env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=fraction) \
      if args.device == "cuda" else None
  # The sides build and compile at the same time (the untimed part), then take turns.
  children = {side: subprocess.Popen(
      [sys.executable, __file__, "--side", side.partition(":")[0], "--model", args.model,
       "--dtype", args.dtype, "--attention", side.partition(":")[2],
       "--device", args.device, "--batch_size", str(args.batch_size),
       "--seq_len", str(args.seq_len), "--logits_chunk_length", str(args.logits_chunk_length)]
      + ([] if args.attention_dropout is None else
         ["--attention_dropout", str(args.attention_dropout)]),
      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
      text=True, cwd=ROOT, env=jax_env if side.startswith("jax") else None)
      for side in sides}
  versions, failed = {}, {}
  for side, child in list(children.items()):
    ready, _, versions[side] = child.stdout.readline().strip().partition(" ")
    if ready != "ready":  # it died building: reported, the others measured
      failed[side] = child.wait()
      del children[side]
  sides = [side for side in sides if side in children]
  jax_sides = [side for side in jax_sides if side in children]
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
  result = dict(model=args.model, dtype=args.dtype, device=args.device,
                jax_backend=versions[jax_sides[0]],
                torch=versions[sides[-1]] if len(sides) > len(jax_sides) else None,
                logits_chunk_length=args.logits_chunk_length,
                attention_dropout=hf_fields(args).get("attn_pdrop"),
                batch_size=args.batch_size, seq_len=args.seq_len, step_s=medians,
                failed_sides=failed)
  for jax_side in jax_sides:
    for side in sides[len(jax_sides):]:
      result[f"speedup_{jax_side}_vs_{side}"] = round(medians[side] / medians[jax_side], 2)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
