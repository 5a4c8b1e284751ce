"""The architecture table of benchmarks/RESULTS.md, in the spirit of the T5 paper's Table 2:
encoder-decoder, decoder-only LM and prefix LM, with and without RoPE and grouped-query
attention, each trained for one budget and scored on the validation split.

  python benchmarks/architectures.py dialogsum ../shared/data/dialogsum /tmp/arch --steps 250
  python benchmarks/architectures.py multi30k ../shared/data/multi30k /tmp/arch --steps 250

Each variant trains in a process of its own from the dataset's config (configs/dialogsum.py,
configs/multi30k.py: model sizes, tokenizer, learning rate) with `--steps` steps, then its
checkpoint decodes the whole validation split greedily (`--decoding`; the same for every
architecture: beam search cut the decoder-only models' DialogSum summaries short, see
configs/dialogsum_decoder_only.py) in a second process (`--mode evaluate`). A variant whose
workdir is trained already is only scored. The decoder-only variants are one stack of 4 layers
(as configs/dialogsum_decoder_only.py) over `SOURCE <eos> TARGET <eos>` in packed rows; the
rows per step are chosen so that every variant sees about as many examples per step (printed:
measured by packing the variant's own training token cache). Prints one Markdown row per
variant.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# pylint: disable=wrong-import-position
from transformer_jax import families
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import pipeline
from transformer_jax.data import token_cache

DECODER_ONLY = {"architecture": "decoder_only", "pack_examples": True, "model.num_layers": 4}
ROPE = {"model.position_embedding": "rope"}
GQA = {"model.num_kv_heads": 1}  # 1 of the 4 heads' keys/values (multi-query)
VARIANTS = {
    "encoder-decoder": {},
    "encoder-decoder + RoPE + GQA": {**ROPE, **GQA},
    "decoder-only LM": DECODER_ONLY,
    "prefix LM": {**DECODER_ONLY, "model.prefix_lm": True},
    "prefix LM + RoPE": {**DECODER_ONLY, "model.prefix_lm": True, **ROPE},
    "prefix LM + RoPE + GQA": {**DECODER_ONLY, "model.prefix_lm": True, **ROPE, **GQA},
}
# Per dataset: the config, the validation metric, rows per step (encoder-decoder, decoder-only:
# a DialogSum dialogue fills 1.15 packed 320-token rows; Multi30k packs both families), and the
# validation examples decoded during training (the table scores the whole split after it).
DATASETS = {
    "dialogsum": ("configs/dialogsum.py", "rougeL", (8, 7), 100),
    "multi30k": ("configs/multi30k.py", "bleu", (16, 16), 500),
}


def _overrides(settings: dict) -> list[str]:
  return [f"--config.{key}={value}" for key, value in settings.items()]


def _examples_per_row(workdir: pathlib.Path) -> float:
  """Mean examples per training row, by packing the run's training token cache (unpacked:
  1)."""
  folder = next((workdir / "token_cache").glob("train-*"))
  encoded = token_cache.load(folder)
  order = np.random.default_rng(0).permutation(len(encoded))
  return len(encoded) / len(pipeline.pack_rows(encoded, order))


# Scores a trained workdir (argv[1]) on its validation split with decoding.method argv[2]:
# the saved config with another decoding, as `--mode evaluate` takes it.
SCORE = """
import json, sys
from transformer_jax import commands, workdir
config = workdir.load_config(sys.argv[1])
config.decoding.method = sys.argv[2]
print(json.dumps(commands.run_evaluate(sys.argv[1], split="validation", config=config)))
"""


def _parameters(workdir: pathlib.Path) -> int:
  family = families.get(workdir_lib.load_config(str(workdir)))
  shapes = jax.eval_shape(lambda: family.init_params(jax.random.PRNGKey(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def _failed(name: str, done: subprocess.CompletedProcess) -> None:
  print(f"| {name} | failed (exit {done.returncode}): "
        f"{done.stderr.strip().splitlines()[-1:]} |||||", flush=True)


def run(dataset: str, data_dir: str, out: pathlib.Path, steps: int, names: list[str],
        decoding: str) -> None:
  config, metric, (rows, decoder_only_rows), generate = DATASETS[dataset]
  print(f"| {dataset} ({steps} steps) | parameters | examples / step | train min | "
        f"validation {metric} ({decoding}, whole split) | validation loss |")
  print("|---|---|---|---|---|---|")
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  for name in names:
    settings = VARIANTS[name]
    decoder_only = settings.get("architecture") == "decoder_only"
    budget = {"num_train_steps": steps, "eval_every_steps": steps,
              "checkpoint_every_steps": steps, "warmup_steps": min(300, steps // 2),
              "num_generate_examples": generate,
              "per_device_batch_size": decoder_only_rows if decoder_only else rows}
    if decoder_only:
      budget["model.max_len"] = 128 if dataset == "multi30k" else 320
    workdir = out / dataset / re.sub(r"\W+", "_", name).strip("_")
    command = [sys.executable, "-m", "transformer_jax.main", "--config", config,
               "--workdir", str(workdir), f"--config.data_dir={data_dir}",
               *_overrides({**budget, **settings})]
    minutes = "trained before"
    if not (workdir / "config.json").exists():
      start = time.time()
      done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
      minutes = f"{(time.time() - start) / 60:.1f}"
      if done.returncode:
        _failed(name, done)
        continue
    done = subprocess.run([sys.executable, "-c", SCORE, str(workdir), decoding], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    if done.returncode:
      _failed(name, done)
      continue
    found = json.loads(done.stdout.strip().splitlines()[-1])
    per_row = _examples_per_row(workdir) if settings.get("pack_examples", dataset == "multi30k") \
        else 1.0
    print(f"| {name} | {_parameters(workdir):,} | "
          f"{per_row * budget['per_device_batch_size']:.1f} | {minutes} | "
          f"{found[metric]:.2f} | {found['loss']:.3f} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dataset", choices=sorted(DATASETS))
  parser.add_argument("data_dir", help="the corpus folder (../shared/data/<dataset>)")
  parser.add_argument("out", type=pathlib.Path, help="where the runs' workdirs go")
  parser.add_argument("--steps", type=int, default=250)
  parser.add_argument("--decoding", default="greedy", choices=["greedy", "beam"],
                      help="how every variant decodes the validation split")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="comma-separated names of VARIANTS")
  args = parser.parse_args()
  if not os.path.isdir(args.data_dir):
    sys.exit(f"error: no corpus folder {args.data_dir}; see ../shared/data/README.md")
  names = args.variants.split(",")
  unknown = [n for n in names if n not in VARIANTS]
  if unknown:
    sys.exit(f"error: unknown variants {unknown}; use names of {list(VARIANTS)}")
  run(args.dataset, os.path.abspath(args.data_dir), args.out, args.steps, names, args.decoding)


if __name__ == "__main__":
  main()
