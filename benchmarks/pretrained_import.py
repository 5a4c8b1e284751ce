"""Import time and peak memory of Hugging Face checkpoints, against reading the file.

  python benchmarks/pretrained_import.py --size t5-base --folder /tmp/t5-base
  python benchmarks/pretrained_import.py --size flan-t5-large --folder /tmp/flan-t5-large
  python benchmarks/pretrained_import.py --size nllb-1.3b --folder /tmp/nllb_size
  python benchmarks/pretrained_import.py --size qwen2.5-1.5b --folder /tmp/qwen_size \
      --compute_dtype bfloat16

Writes a randomly initialised checkpoint of the named size (config.json from the published
config's sizes; model.safetensors in transformers' tensor names: T5 from this project's own
weight table, Qwen2.5 in bfloat16 by name, as the hub's file is, so no torch is needed) unless
the folder has one, then times, each in a fresh process: `safetensors` reading every tensor
into numpy (the floor), and `pretrained.checkpoint.read_params` (config translation,
renumbering, q/k/v fusing, transposes) into the dtype a run computing in `--compute_dtype`
holds (`checkpoint.held_dtype`: a bfloat16 file stays bfloat16 for a bfloat16 model). Peak RSS
is the process's high-water mark (VmHWM), also given above its resident set before reading
(the Python + JAX baseline).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SIZES = {  # the published configs' sizes (google-t5/t5-base, google/flan-t5-large)
    "t5-base": dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12,
                    feed_forward_proj="relu", tie_word_embeddings=True),
    "flan-t5-large": dict(d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_heads=16,
                          feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}


# Qwen/Qwen2.5-1.5B's config.json (its published values).
QWEN2_5_1_5B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", hidden_size=1536,
    intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    max_position_embeddings=131072, max_window_layers=28, rms_norm_eps=1e-6, rope_theta=1e6,
    sliding_window=131072, use_sliding_window=False, tie_word_embeddings=True,
    vocab_size=151936, bos_token_id=151643, eos_token_id=151643, torch_dtype="bfloat16")


def _qwen2_tensors(hf: dict) -> dict[str, tuple[int, ...]]:
  """transformers' tensor names and shapes of a Qwen2 causal LM (tied output)."""
  d, ff, heads, kv = (hf["hidden_size"], hf["intermediate_size"], hf["num_attention_heads"],
                      hf["num_key_value_heads"])
  head_dim = d // heads
  shapes = {"model.embed_tokens.weight": (hf["vocab_size"], d), "model.norm.weight": (d,)}
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (d, d), p + "self_attn.q_proj.bias": (d,),
        p + "self_attn.k_proj.weight": (kv * head_dim, d),
        p + "self_attn.k_proj.bias": (kv * head_dim,),
        p + "self_attn.v_proj.weight": (kv * head_dim, d),
        p + "self_attn.v_proj.bias": (kv * head_dim,),
        p + "self_attn.o_proj.weight": (d, d),
        p + "mlp.gate_proj.weight": (ff, d), p + "mlp.up_proj.weight": (ff, d),
        p + "mlp.down_proj.weight": (d, ff)})
  return shapes


def write_bfloat16_safetensors(path: str, shapes: dict[str, tuple[int, ...]],
                               seed: int = 0) -> None:
  """Random bfloat16 tensors in the safetensors format, written one at a time (the header
  first, then each tensor's bytes), so the writer holds one tensor, not the model."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape in shapes.items():
    size = int(np.prod(shape)) * 2
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  encoded = json.dumps(header).encode()
  encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
  rng = np.random.default_rng(seed)
  with open(path, "wb") as f:
    f.write(len(encoded).to_bytes(8, "little") + encoded)
    for shape in shapes.values():
      value = rng.standard_normal(shape, dtype=np.float32) * 0.02
      f.write(value.astype(ml_dtypes.bfloat16).tobytes())


def write_checkpoint(size: str, folder: str) -> None:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if size.startswith("nllb"):  # written by transformers (m2m_100, with NLLB's tokenizer)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compare_generate  # pylint: disable=g-import-not-at-top
    compare_generate.make_folder(size, folder)
    return
  if size == "qwen2.5-1.5b":
    os.makedirs(folder, exist_ok=True)
    write_bfloat16_safetensors(os.path.join(folder, "model.safetensors"),
                               _qwen2_tensors(QWEN2_5_1_5B))
    with open(os.path.join(folder, "config.json"), "w") as f:
      json.dump(QWEN2_5_1_5B, f, indent=1)
    return
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import checkpoint, mapping, t5  # pylint: disable=g-import-not-at-top
  hf = dict(model_type="t5", vocab_size=32128, relative_attention_num_buckets=32,
            relative_attention_max_distance=128, layer_norm_epsilon=1e-6, pad_token_id=0,
            eos_token_id=1, decoder_start_token_id=0, architectures=["T5ForConditionalGeneration"],
            **SIZES[size])
  fields = t5.model_fields(hf, tied=hf["tie_word_embeddings"])
  vocab = checkpoint.vocab_lib.VocabMap.create(hf["vocab_size"], 0, 1)
  shapes = mapping.Shapes(hf["num_heads"], hf["d_kv"], vocab)
  rng = np.random.default_rng(0)
  tensors = {}
  for entry in t5.weight_table(hf, fields):  # one of ours at a time -> its HF tensors
    shape = _our_shape(entry, hf, fields)
    value = rng.standard_normal(shape, dtype=np.float32) * 0.05
    tensors.update(zip(entry.hf, mapping.to_hf(entry, value, shapes)))
  os.makedirs(folder, exist_ok=True)
  save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
            os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf, f, indent=1)


def _our_shape(entry, hf, fields):
  d, h, k, ff, v = hf["d_model"], hf["num_heads"], hf["d_kv"], hf["d_ff"], hf["vocab_size"]
  name = entry.path[-2] if entry.path[-1] in ("kernel", "scale", "embedding") else ""
  if entry.kind == "vocab_rows":
    return (v, d)
  if entry.kind == "vocab_dense":
    return (d, v)
  if entry.kind == "heads_in":
    return (d, len(entry.hf), h, k)
  if entry.kind == "heads_out":
    return (h, k, d)
  if entry.path[-1] == "scale":
    return (d,)
  if "relative_bias" in entry.path[-2]:
    return (fields["relative_attention_num_buckets"], h)
  return {"wi": (d, ff), "wi_gate": (d, ff), "wo": (ff, d)}[name]


def _memory_mb(field: str) -> float:
  """VmRSS (now) or VmHWM (the peak) of this process. Not getrusage's ru_maxrss: a child
  process inherits its parent's."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(f"{field}:"):
        return int(line.split()[1]) / 1024
  return 0.0


def measure(what: str, folder: str, compute_dtype: str) -> dict:
  """In this (fresh) process: read the checkpoint one way; seconds and memory."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import checkpoint  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  baseline = _memory_mb("VmRSS")
  start = time.perf_counter()
  if what == "safetensors":
    with safe_open(os.path.join(folder, "model.safetensors"), framework="np") as f:
      held = {name: f.get_tensor(name) for name in f.keys()}
  else:
    opened = checkpoint.open_checkpoint(folder)
    held = checkpoint.read_params(opened, dtype=checkpoint.held_dtype(opened, compute_dtype))
  seconds = time.perf_counter() - start
  peak = _memory_mb("VmHWM")
  leaves = jax.tree.leaves(held)
  held_mb = sum(x.nbytes for x in leaves) / 2**20
  dtypes = sorted({str(x.dtype) for x in leaves})
  del held, leaves
  return dict(seconds=seconds, peak_rss_mb=peak, peak_above_baseline_mb=peak - baseline,
              held_mb=held_mb, dtypes=dtypes)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--size", choices=sorted(SIZES) + ["nllb-1.3b", "nllb-tiny",
                                                        "qwen2.5-1.5b"],
                      default="t5-base")
  parser.add_argument("--folder", required=True)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--compute_dtype", default="float32",
                      help="config.model.dtype of the run that imports (float32, bfloat16)")
  parser.add_argument("--measure", choices=["safetensors", "import"], help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    print(json.dumps(measure(args.measure, args.folder, args.compute_dtype)))
    return
  if not os.path.exists(os.path.join(args.folder, "model.safetensors")):
    write_checkpoint(args.size, args.folder)
  weights_mb = os.path.getsize(os.path.join(args.folder, "model.safetensors")) / 2**20
  results = {}
  for what in ("safetensors", "import"):
    runs = [json.loads(subprocess.run(
        [sys.executable, __file__, "--folder", args.folder, "--measure", what,
         "--compute_dtype", args.compute_dtype],
        capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for _ in range(args.repeats)]
    results[what] = {k: (runs[0][k] if k == "dtypes" else float(np.median([r[k] for r in runs])))
                     for k in runs[0]}
  ratio = results["import"]["seconds"] / results["safetensors"]["seconds"]
  print(json.dumps(dict(size=args.size, weights_mb=round(weights_mb), **results,
                        import_over_read=round(ratio, 2),
                        peak_above_baseline_over_weights=round(
                            results["import"]["peak_above_baseline_mb"] / weights_mb, 2)),
                   indent=1))


if __name__ == "__main__":
  main()
