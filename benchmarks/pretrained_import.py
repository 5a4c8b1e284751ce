"""Import time and peak memory of Hugging Face checkpoints, against reading the file.

  python benchmarks/pretrained_import.py --size t5-base --folder /tmp/t5-base
  python benchmarks/pretrained_import.py --size flan-t5-large --folder /tmp/flan-t5-large
  python benchmarks/pretrained_import.py --size nllb-1.3b --folder /tmp/nllb_size

Writes a randomly initialised checkpoint of the named size (config.json from the published
config's sizes; model.safetensors in transformers' tensor names, written from this project's
own weight table, so no torch is needed) unless the folder has one, then times, each in a
fresh process: `safetensors` reading every tensor into numpy (the floor), and
`pretrained.checkpoint.read_params` (config translation, renumbering, q/k/v fusing,
transposes). Peak RSS is the process's high-water mark (VmHWM), also given above its resident set before
reading (the Python + JAX baseline).
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


def write_checkpoint(size: str, folder: str) -> None:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if size.startswith("nllb"):  # written by transformers (m2m_100, with NLLB's tokenizer)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compare_generate  # pylint: disable=g-import-not-at-top
    compare_generate.make_folder(size, folder)
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


def measure(what: str, folder: str) -> dict:
  """In this (fresh) process: read the checkpoint one way; seconds and memory."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import checkpoint  # pylint: disable=g-import-not-at-top
  import jax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  baseline = _memory_mb("VmRSS")
  start = time.perf_counter()
  if what == "safetensors":
    with safe_open(os.path.join(folder, "model.safetensors"), framework="np") as f:
      held = {name: f.get_tensor(name) for name in f.keys()}
  else:
    held = checkpoint.read_params(checkpoint.open_checkpoint(folder))
  seconds = time.perf_counter() - start
  peak = _memory_mb("VmHWM")
  del held
  return dict(seconds=seconds, peak_rss_mb=peak, peak_above_baseline_mb=peak - baseline)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--size", choices=sorted(SIZES) + ["nllb-1.3b", "nllb-tiny"],
                      default="t5-base")
  parser.add_argument("--folder", required=True)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--measure", choices=["safetensors", "import"], help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.measure:
    print(json.dumps(measure(args.measure, args.folder)))
    return
  if not os.path.exists(os.path.join(args.folder, "model.safetensors")):
    write_checkpoint(args.size, args.folder)
  weights_mb = os.path.getsize(os.path.join(args.folder, "model.safetensors")) / 2**20
  results = {}
  for what in ("safetensors", "import"):
    runs = [json.loads(subprocess.run(
        [sys.executable, __file__, "--folder", args.folder, "--measure", what],
        capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for _ in range(args.repeats)]
    results[what] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
  ratio = results["import"]["seconds"] / results["safetensors"]["seconds"]
  print(json.dumps(dict(size=args.size, weights_mb=round(weights_mb), **results,
                        import_over_read=round(ratio, 2),
                        peak_above_baseline_over_weights=round(
                            results["import"]["peak_above_baseline_mb"] / weights_mb, 2)),
                   indent=1))


if __name__ == "__main__":
  main()
