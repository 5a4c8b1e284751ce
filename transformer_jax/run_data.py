"""A run's tokenizer and token features: what training, evaluate and predict read.

`load_tokenizer` is the one place that decides which tokenizer a workdir uses; `prepare_data`
turns a config's splits into its token features (the training split sharded and cached, see
token_cache.py). Nothing here trains a model, so evaluate uses it without importing
train.py; predict and serve need only the workdir's tokenizer (pretrained/run_files.py).
"""

from __future__ import annotations

import jax
import ml_collections
from absl import logging
from jax.experimental import multihost_utils

from transformer_jax import families
from transformer_jax import tasks
from transformer_jax import tokenizer as tokenizer_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import examples as examples_lib
from transformer_jax.data import features
from transformer_jax.data import pipeline
from transformer_jax.data import sources
from transformer_jax.data import token_cache
from transformer_jax.pretrained import run_files


def load_tokenizer(config: ml_collections.ConfigDict, workdir: str) -> tokenizer_lib.Tokenizer:
  """The workdir's tokenizer; on first use copied from `config.tokenizer.path`, trained on
  a seeded sample of the training split's texts, or, for a run from `config.pretrained`, the
  checkpoint's own (kept in WORKDIR/pretrained/ with its config files). Made by process 0;
  the others wait and load it, so every process of a multi-host run uses the same one."""
  if config.pretrained:
    from transformer_jax.pretrained import checkpoint  # pylint: disable=g-import-not-at-top
    if jax.process_index() == 0 and not run_files.saved(workdir):
      run_files.save_files(checkpoint.open_checkpoint(config.pretrained), workdir)
  else:
    path = workdir_lib.tokenizer_path(workdir)
    if jax.process_index() == 0 and not path.exists():
      _new_tokenizer(config).save(path)
  if jax.process_count() > 1:  # every process passes here, whether or not it was made now
    multihost_utils.sync_global_devices("tokenizer saved")
  return run_files.workdir_tokenizer(config, workdir)


def _new_tokenizer(config: ml_collections.ConfigDict) -> tokenizer_lib.Tokenizer:
  """The tokenizer a new workdir starts with: the only choice between the sources of one (a
  given file, or one trained here), so a new source belongs here."""
  t = config.tokenizer
  if t.path:
    return tokenizer_lib.Tokenizer.load(t.path)
  # The split is streamed: only the sample is held, whatever the corpus size.
  train_examples, _ = examples_lib.stream(config, "train")
  texts = tokenizer_lib.sample(tasks.training_texts(train_examples), t.num_sentences,
                               config.seed)
  logging.info("Training a %d-piece SentencePiece %s tokenizer on %d training texts.",
               config.model.vocab_size, t.model_type, len(texts))
  return tokenizer_lib.train_tokenizer(
      texts, config.model.vocab_size, model_type=t.model_type,
      character_coverage=t.character_coverage, byte_fallback=t.byte_fallback)


def data_shards(config: ml_collections.ConfigDict) -> tuple[int, range]:
  """How many shards the training split is read as, and which of them this process reads."""
  count = config.data_shards or jax.process_count()
  return count, pipeline.shards_of_process(jax.process_index(), jax.process_count(), count)


def prepare_data(config: ml_collections.ConfigDict, workdir: str | None,
                 splits=sources.SPLITS, *, training: bool = True, tokenizer=None):
  """Examples of the evaluation `splits`, the workdir's tokenizer (made on first use), and
  token features: the training split as `pipeline.Shards` (this process's, see
  `data_shards`), the others as `pipeline.Encoded`.

  The training texts are streamed, never held whole (`examples` has no "train"), and each
  shard's features come from the workdir's token cache (data/token_cache.py) when it holds
  them for this tokenizer, config and data; otherwise the shard is encoded and cached. With
  `training` False the training split is read like the others, to be scored. A given
  `tokenizer` (a pretrained checkpoint's, served without a workdir) replaces the workdir's.
  """
  family = families.get(config)
  tokenizer = tokenizer or load_tokenizer(config, workdir)
  eval_splits = [split for split in splits if split != "train" or not training]
  examples = examples_lib.load_examples(config, eval_splits) if eval_splits else {}
  encoded = {}
  if "train" in splits and training:
    encoded["train"] = _training_shards(config, workdir, family, tokenizer)
  for split in eval_splits:  # every reference is scored: overlong examples are truncated
    encoded[split], overlong = features.encode_examples(family, examples[split], tokenizer)
    _warn_overlong(config, split, overlong, len(examples[split]), "truncated")
  return examples, tokenizer, encoded


def _training_shards(config: ml_collections.ConfigDict, workdir: str, family: families.Family,
                     tokenizer: tokenizer_lib.Tokenizer) -> pipeline.Shards:
  count, shards = data_shards(config)
  cache_key = token_cache.key(config, family.name, family.feature_lengths(),
                              tokenizer.model_proto, "train")
  held = {}
  for shard in shards:
    entry = token_cache.entry(workdir, "train", cache_key, shard, count)
    held[shard] = token_cache.load(entry)
    if held[shard] is not None:
      logging.info("Training data: %s examples from the token cache %s.",
                   f"{len(held[shard]):,}", entry)
      continue
    stream, total = examples_lib.stream(config, "train", shard, count)
    drop = config.overlong == "drop"
    held[shard], overlong = features.encode_examples(family, stream, tokenizer,
                                                     drop_overlong=drop, total=total)
    _warn_overlong(config, "train" if count == 1 else f"train shard {shard} of {count}",
                   overlong, len(held[shard]) + overlong * drop,
                   "dropped" if drop else "truncated")
    if jax.process_index() == pipeline.saving_process(shard, jax.process_count(), count):
      token_cache.save(entry, held[shard])
      if not workdir_lib.is_url(workdir):  # from here on memory-mapped: pages the OS can drop
        mapped = token_cache.load(entry)
        held[shard] = held[shard] if mapped is None else mapped
  return pipeline.Shards(count, held)


def _warn_overlong(config: ml_collections.ConfigDict, split: str, overlong: int, total: int,
                   what: str) -> None:
  if overlong:
    logging.warning("%s: %d of %d examples longer than max_source_length=%d / "
                    "max_target_length=%d tokens were %s.", split, overlong, total,
                    config.max_source_length, config.max_target_length, what)
