"""Generation speed against transformers `generate` on the same Hugging Face folder.

  python benchmarks/compare_generate.py --pretrained DIR [--batch_sizes 1,8,32] \
      [--methods greedy,beam4,sample] [--new_tokens 64] [--prompt_tokens 0] [--rounds 3] \
      [--threads 2] [--turns] [--sides ours,torch] [--device cpu|cuda] [--profile_dir DIR]
  # A folder of random weights at a known size first (no download needed): gpt2 (124M,
  # decoder-only), smollm2-135m (Llama blocks, GQA), llama-0.5b (Qwen2.5-0.5B's sizes),
  # t5-small (60M, encoder-decoder) or
  # nllb-1.3b (NLLB-200-distilled-1.3B's sizes, m2m_100, 5.5 GB of float32; English ->
  # Vietnamese with the target code forced first; nllb-tiny: the same at toy size), with a
  # small trained tokenizer:
  python benchmarks/compare_generate.py --make gpt2 --pretrained /tmp/gpt2_size
  python benchmarks/compare_generate.py --make nllb-1.3b --pretrained /tmp/nllb_size \
      --methods beam4 --batch_sizes 1,8 --new_tokens 32 --threads 2

Both sides decode the same prompts (the same token ids: ours as `Predictor.from_pretrained`
builds them; transformers gets them as input_ids, left-padded with an attention mask) for
exactly --new_tokens tokens (EOS is held back until then: our `min_length` / `max_decode_len`,
transformers' `min_new_tokens` / `max_new_tokens`), float32, greedy (`num_beams=1`), beam 4
(`num_beams=4`, our beam search) or sampling (temperature 1, no top-k / top-p). Each (side,
method, batch) runs in a process of its own with --threads threads (XLA's CPU thread pool is
the machine's cores; torch.set_num_threads), one untimed call first (our compile), then the
median of --rounds calls; with --turns both sides run in one process, their calls taking
turns, so that a machine whose speed drifts from minute to minute slows both alike (on the
2-core machine, two separate runs of the same measurement gave 0.85x and 1.31x an hour apart).
Prints one JSON line per measurement and a table, with the
memory-bandwidth bound at batch 1: every weight is read once per token, so tokens/s can be at
most (measured read bandwidth) / (bytes of weights). With --device cuda both sides run on the
GPU (JAX's default backend; transformers on cuda), their float32 matrix products on TF32 alike
(JAX's default there; transformers is told to allow it). With --profile_dir only our side runs:
one traced call per method and batch after its compile, in DIR/METHOD_bBATCH (read it with
benchmarks/trace_summary.py DIR/METHOD_bBATCH --steps NEW_TOKENS). A benchmark, not a test.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = {"greedy": dict(method="greedy"), "beam4": dict(method="beam", beam_size=4),
           "sample": dict(method="sample", temperature=1.0, top_k=0, top_p=1.0)}
SIZES = {
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                 vocab_size=50257),
    # HuggingFaceTB/SmolLM2-135M's sizes: Llama blocks, 3 key/value heads for 9, tied output.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=2048, vocab_size=49152, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    # Qwen2.5-0.5B's sizes in Llama blocks (no query/key/value bias): 494M parameters, 14
    # query and 2 key/value heads, its 151,936-row vocabulary, tied output.
    "llama-0.5b": dict(model_type="llama", hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=2048, vocab_size=151936, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True),
    "t5-small": dict(model_type="t5", d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                     num_heads=8, vocab_size=32128, feed_forward_proj="relu",
                     tie_word_embeddings=True, decoder_start_token_id=0),
    # facebook/nllb-200-distilled-1.3B's sizes (its 256,206-row vocabulary included).
    "nllb-1.3b": dict(model_type="m2m_100", d_model=1024, encoder_layers=24, decoder_layers=24,
                      encoder_attention_heads=16, decoder_attention_heads=16,
                      encoder_ffn_dim=8192, decoder_ffn_dim=8192, vocab_size=256206,
                      max_position_embeddings=1024, scale_embedding=True),
    "nllb-tiny": dict(model_type="m2m_100", d_model=64, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4,
                      encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1024,
                      max_position_embeddings=256, scale_embedding=True),
}
# The languages of a multilingual checkpoint (its codes): source, then the target code that
# both sides force as the first output token.
LANGUAGES = ("eng_Latn", "vie_Latn")


def make_folder(size: str, folder: str) -> None:
  """A Hugging Face folder of `size` with random weights and a small trained tokenizer (its
  pieces are the first ids of the model's vocabulary)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  texts = hf_fixtures.model_sentences("en")
  hf = dict(SIZES[size])
  model_type = hf.pop("model_type")
  if model_type == "llama":
    files = hf_fixtures.llama_tokenizer_files(folder, texts, vocab_size=800)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **hf, bos_token_id=files.tokenizer.bos_token_id, eos_token_id=files.eos_id))
  elif model_type == "gpt2":
    files = hf_fixtures.gpt2_tokenizer_files(folder, texts, vocab_size=800)
    end = files.eos_id  # the tokenizer's <|endoftext|>
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **hf, bos_token_id=end, eos_token_id=end))
  elif model_type == "m2m_100":
    spm = hf_fixtures.fairseq_spm_model(texts + hf_fixtures.model_sentences("vi"))
    hf_fixtures.multilingual_tokenizer_files("nllb", folder, spm, LANGUAGES)
    model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(
        **hf, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))
  else:
    hf_fixtures.t5_tokenizer_files(folder, texts)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        **hf, pad_token_id=0, eos_token_id=1))
  model.save_pretrained(folder)


def _languages(folder: str) -> dict:
  """config keys naming the languages of a checkpoint with language codes (NLLB's)."""
  with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    multilingual = json.load(f)["model_type"] == "m2m_100"
  return dict(source_lang=LANGUAGES[0], target_lang=LANGUAGES[1]) if multilingual else {}


def prompts(folder: str, batch_size: int, length: int = 0) -> tuple[list, list[list[int]]]:
  """Our prompts (internal ids) and the same as the checkpoint's ids, `batch_size` of them:
  a sentence each, or with `length` that many tokens of running text."""
  from tests import hf_fixtures  # pylint: disable=g-import-not-at-top
  from transformer_jax import default_config  # pylint: disable=g-import-not-at-top
  from transformer_jax import predict  # pylint: disable=g-import-not-at-top
  config = default_config.get_config()
  config.update(_languages(folder))
  predictor = predict.Predictor.from_pretrained(folder, config)
  texts = hf_fixtures.model_sentences("en")
  if length:  # sentences joined until the prompt has `length` tokens, then cut there
    texts = [" ".join(texts[i:i + length]) for i in range(batch_size)]
  ours = list(predictor._prompts([texts[i % len(texts)] for i in range(batch_size)]).values())  # pylint: disable=protected-access
  if length:
    ours = [p[:length] for p in ours]
    assert all(len(p) == length for p in ours), "the sentences are too short"
  return predictor, ours, [predictor.tokenizer.to_hf(p) for p in ours]


def run_ours(folder: str, method: str, batch_size: int, new_tokens: int, length: int = 0):
  predictor, ours, _ = prompts(folder, batch_size, length)
  # max_decode_len counts the EOS too: EOS held back for new_tokens - 1 steps, N steps run.
  decoding = predictor.decoding_config(**METHODS[method], min_length=new_tokens - 1,
                                       max_decode_len=new_tokens)
  return lambda: predictor.output_ids(ours, 1, decoding)


def run_torch(folder: str, method: str, batch_size: int, new_tokens: int, threads: int,
              length: int = 0, device: str = "cpu"):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(threads)
  torch.backends.cuda.matmul.allow_tf32 = True  # as JAX's float32 products on a GPU
  _, _, hf_prompts = prompts(folder, batch_size, length)
  config = transformers.AutoConfig.from_pretrained(folder)
  auto = (transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder
          else transformers.AutoModelForCausalLM)
  model = auto.from_pretrained(folder, dtype=torch.float32).eval().to(device)
  pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
  width = max(map(len, hf_prompts))
  left = not config.is_encoder_decoder  # a causal LM continues the prompt's last token
  ids = torch.tensor([[pad] * (width - len(p)) + list(p) if left else
                      list(p) + [pad] * (width - len(p)) for p in hf_prompts], device=device)
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) if left else
                       [1] * len(p) + [0] * (width - len(p)) for p in hf_prompts],
                      device=device)
  m = METHODS[method]
  kwargs = dict(num_beams=m.get("beam_size", 1), do_sample=m["method"] == "sample",
                min_new_tokens=new_tokens, max_new_tokens=new_tokens, pad_token_id=pad)
  if kwargs["do_sample"]:
    kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
  if _languages(folder):  # the target code first, as ours forces it
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    kwargs["forced_bos_token_id"] = tokenizer.convert_tokens_to_ids(LANGUAGES[1])

  def call():
    with torch.inference_mode():
      return model.generate(input_ids=ids, attention_mask=mask, **kwargs).cpu()  # waits

  return call


def read_bandwidth() -> float:
  """Bytes per second of a read of a 1 GiB array on JAX's default device (a compiled sum; on
  a CPU, XLA splits it over its threads), best of 5."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  array = jnp.ones(2 ** 28, jnp.float32)
  total = jax.jit(jnp.sum)
  total(array).block_until_ready()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    total(array).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return array.nbytes / best


def measure(args) -> list[dict]:
  """Each side's tokens per second (median of --rounds calls after a warm-up): --side's, or
  with 'both' ours and transformers' in this process, their calls in turns."""
  calls = {}
  if args.side in ("ours", "both"):
    calls["ours"] = run_ours(args.pretrained, args.method, args.batch, args.new_tokens,
                             args.prompt_tokens)
  if args.side in ("torch", "both"):
    calls["torch"] = run_torch(args.pretrained, args.method, args.batch, args.new_tokens,
                               args.threads, args.prompt_tokens, args.device)
  times = {side: [] for side in calls}
  for call in calls.values():
    call()
  for _ in range(args.rounds):
    for side, call in calls.items():
      start = time.perf_counter()
      call()
      times[side].append(time.perf_counter() - start)
  return [{"side": side, "method": args.method, "batch": args.batch,
           "seconds": statistics.median(seconds), "rounds": seconds,
           "tokens_per_s": args.batch * args.new_tokens / statistics.median(seconds)}
          for side, seconds in times.items()]


def profile(args) -> None:
  """--profile_dir: a jax.profiler trace of one call of ours per method and batch."""
  from transformer_jax import benchmark  # pylint: disable=g-import-not-at-top
  for method in args.methods.split(","):
    for batch in map(int, args.batch_sizes.split(",")):
      call = run_ours(args.pretrained, method, batch, args.new_tokens, args.prompt_tokens)
      call()  # the compile, untraced
      folder = os.path.join(args.profile_dir, f"{method}_b{batch}")
      benchmark.trace_steps(call, folder, steps=1)
      print(f"traced: {folder}", flush=True)


def weights_bytes(folder: str) -> int:
  """Bytes of float32 weights (what both sides compute in) that one decoding step reads: all of
  a decoder-only model's, an encoder-decoder's without its encoder (run once per input)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
    encoder_decoder = json.load(f).get("is_encoder_decoder", False)
  with safe_open(os.path.join(folder, "model.safetensors"), "np") as f:
    return sum(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys()
               if not (encoder_decoder and "encoder." in name))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pretrained", required=True)
  parser.add_argument("--make", choices=sorted(SIZES))
  parser.add_argument("--batch_sizes", default="1,8,32")
  parser.add_argument("--methods", default="greedy,beam4,sample")
  parser.add_argument("--new_tokens", type=int, default=64)
  parser.add_argument("--prompt_tokens", type=int, default=0)  # 0: a sentence each
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  parser.add_argument("--turns", action="store_true")  # both sides in one process, in turns
  parser.add_argument("--sides", default="ours,torch")  # 'ours': no generate
  parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
  parser.add_argument("--profile_dir")
  parser.add_argument("--side", choices=["ours", "torch", "both"])  # internal: a measurement
  parser.add_argument("--method", choices=sorted(METHODS))
  parser.add_argument("--batch", type=int)
  args = parser.parse_args()
  if args.side:
    for result in measure(args):
      print(json.dumps(result), flush=True)
    return
  sides_env = dict(os.environ)
  if args.device == "cpu":
    os.environ["JAX_PLATFORMS"] = sides_env["JAX_PLATFORMS"] = "cpu"
  else:  # this process's JAX must not hold 75% of the GPU while the sides run
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  if args.make:
    make_folder(args.make, args.pretrained)
  if args.profile_dir:
    profile(args)
    return
  bandwidth = read_bandwidth()  # before the sides start: nothing else is running
  bound = bandwidth / weights_bytes(args.pretrained)  # tokens/s at batch 1
  print(json.dumps({"read_bandwidth_gb_s": bandwidth / 1e9, "batch1_bound_tokens_per_s": bound}))
  rows = []
  for method in args.methods.split(","):
    for batch in map(int, args.batch_sizes.split(",")):
      result = {}
      for side in (("both",) if args.turns else args.sides.split(",")):
        out = subprocess.run(
            [sys.executable, __file__, "--side", side, "--pretrained", args.pretrained,
             "--method", method, "--batch", str(batch), "--new_tokens", str(args.new_tokens),
             "--prompt_tokens", str(args.prompt_tokens),
             "--rounds", str(args.rounds), "--threads", str(args.threads),
             "--device", args.device], capture_output=True, text=True, check=False,
            env=sides_env)
        if out.returncode:
          sys.exit(f"{side} {method} batch {batch} failed:\n{out.stderr[-3000:]}")
        for line in out.stdout.strip().splitlines()[-(2 if side == "both" else 1):]:
          print(line, flush=True)
          result[json.loads(line)["side"]] = json.loads(line)
      rows.append((method, batch, result["ours"]["tokens_per_s"],
                   result.get("torch", {}).get("tokens_per_s", math.nan)))
  print(f"\n{'method':8s} {'batch':>5s} {'ours tok/s':>11s} {'generate tok/s':>15s} {'ratio':>6s}"
        f" {'of bound':>9s}")
  for method, batch, ours, theirs in rows:
    of_bound = f"{ours / bound:8.2f}x" if batch == 1 else ""
    print(f"{method:8s} {batch:5d} {ours:11.1f} {theirs:15.1f} {ours / theirs:5.2f}x {of_bound}")


if __name__ == "__main__":
  main()
