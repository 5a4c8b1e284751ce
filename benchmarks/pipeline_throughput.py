"""Tokens per second of the training input pipeline alone: shuffled rows packed and padded into
global batches (`pipeline.TrainBatches`), no model, on one thread as in a training run.

  python benchmarks/pipeline_throughput.py --config configs/multi30k.py --workdir /tmp/w19 \
      --config.data_dir=/tmp/multi30k_x155 --row_length 256 --batch_rows 128

The training split comes from the workdir's token cache (encoded first when it has none).
--row_length packs into rows of that many tokens instead of the config's lengths (the token
cache keeps the config's truncation), to compare with a training step at another shape, such
as `configs/wmt14_en_de.py`'s 128 x 256 on an H100. Prints one JSON line: target tokens
(non-padding, what the loss counts) and row tokens (padding included) per second.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax import families  # noqa: E402
from transformer_jax import run_data  # noqa: E402
from transformer_jax.data import pipeline  # noqa: E402

config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Workdir whose tokenizer and token cache are used.")
flags.DEFINE_integer("row_length", 0, "Pack rows of this many tokens (0: the config's).")
flags.DEFINE_integer("batch_rows", 0, "Rows per global batch (0: the config's, one device).")
flags.DEFINE_integer("batches", 200, "Timed batches, after one untimed.")
flags.mark_flags_as_required(["config", "workdir"])
FLAGS = flags.FLAGS


def main(_):
  config = FLAGS.config
  os.makedirs(FLAGS.workdir, exist_ok=True)
  _, _, encoded = run_data.prepare_data(config, FLAGS.workdir, ("train",))
  shards = encoded["train"]
  if FLAGS.row_length:
    for data in shards.held.values():
      data.lengths = {name: FLAGS.row_length for name in data.lengths}
  rows = FLAGS.batch_rows or config.per_device_batch_size
  batches = pipeline.TrainBatches(shards, rows, config.seed,
                                  pack=config.pack_examples and families.get(config).packable)
  next(batches)
  target_tokens = row_tokens = 0
  start = time.perf_counter()
  for _ in range(FLAGS.batches):
    batch = next(batches)
    target_tokens += int((batch["targets"] > 0).sum())
    row_tokens += batch["targets"].size
  seconds = time.perf_counter() - start
  print(json.dumps(dict(
      examples=len(shards), batch_rows=rows, row_length=batch["targets"].shape[1],
      batches=FLAGS.batches, seconds=round(seconds, 2),
      target_tokens_per_s=round(target_tokens / seconds),
      row_tokens_per_s=round(row_tokens / seconds))))


if __name__ == "__main__":
  app.run(main)
