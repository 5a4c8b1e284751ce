"""The files a workdir keeps beside its checkpoints for its run: the tokenizer (a SentencePiece
model, or a pretrained checkpoint's tokenizer files) and a pretrained checkpoint's config
files, in WORKDIR/pretrained/, so that evaluate, predict, serve and export need only the
workdir. Reading them needs neither the training data nor the training code."""

from __future__ import annotations

import json
import os

import ml_collections

from transformer_jax import tokenizer as sentencepiece_lib
from transformer_jax import workdir as workdir_lib
from transformer_jax.data import directions as directions_lib
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import tokenizer as tokenizer_lib
from transformer_jax.pretrained import vocab as vocab_lib

FILES_DIR = "pretrained"  # in a workdir
# config.model keys a fine-tuning run may set (everything else comes from the checkpoint).


def files_dir(workdir: str):
  return workdir_lib.path(workdir) / FILES_DIR


def workdir_tokenizer(config: ml_collections.ConfigDict, workdir: str):
  """The tokenizer a trained workdir holds (a SentencePiece model, or a pretrained
  checkpoint's tokenizer files)."""
  if config.get("pretrained"):
    return saved_tokenizer(workdir, config)
  return sentencepiece_lib.Tokenizer.load(workdir_lib.tokenizer_path(workdir))


def save_files(checkpoint: checkpoint_lib.Checkpoint, workdir: str) -> None:
  """Copies the checkpoint's config (as read: with what `complete_config` added), generation
  config and tokenizer files into the workdir (not the weights: the workdir's own checkpoints
  hold those). config.json goes last: its presence marks the copy complete (`saved`)."""
  target = files_dir(workdir)
  target.mkdir(parents=True, exist_ok=True)
  tokenizer(checkpoint.folder, checkpoint.vocab).save(target)
  source = os.path.join(checkpoint.folder, "generation_config.json")
  if os.path.exists(source):
    with open(source, "rb") as f:
      workdir_lib.write_atomic(target / "generation_config.json", f.read())
  workdir_lib.write_atomic(target / "config.json",
                           json.dumps(checkpoint.hf_config, indent=2).encode())


def saved(workdir: str) -> bool:
  """Whether the workdir holds a complete copy of its checkpoint's files."""
  return (files_dir(workdir) / "config.json").exists()


def tokenizer(folder, vocab: vocab_lib.VocabMap,
              config: ml_collections.ConfigDict | None = None
              ) -> tokenizer_lib.PretrainedTokenizer:
  """The checkpoint's tokenizer, tagging texts with `config`'s source_lang / target_lang
  where it has language codes; refused where it ends sequences with something other than
  EOS or, as mBART-cc25 and NLLB's legacy_behaviour do, EOS and a language code."""
  loaded = tokenizer_lib.PretrainedTokenizer(folder, vocab)
  # A many-direction run without target_lang tags each example with its own (data/features.py).
  if (config is not None and loaded.languages is not None
      and (config.get("target_lang") or not directions_lib.pairs(config))):
    try:
      loaded.set_languages(config.get("source_lang", ""), config.get("target_lang", ""))
    except ValueError as e:
      raise checkpoint_lib.PretrainedError(str(e)) from None
  # A multilingual tokenizer ends as its kind says (`X </s>`, or `X </s> [code]`), and may
  # not end a target at all before it is given a target language (M2M100's tgt_lang=None).
  if loaded.languages is None and not loaded.ends_with_eos:
    raise checkpoint_lib.PretrainedError(
        f"The tokenizer of {folder} does not end sequences with its EOS token; such "
        "tokenizers are not supported.")
  return loaded


def saved_json(workdir: str) -> dict:
  """The checkpoint's config.json as the workdir keeps it."""
  return json.loads((files_dir(workdir) / "config.json").read_text())


def saved_vocab(workdir: str) -> vocab_lib.VocabMap:
  """The renumbering of a workdir trained from a checkpoint."""
  return checkpoint_lib.vocab_map(saved_json(workdir))


def saved_tokenizer(workdir: str, config: ml_collections.ConfigDict | None = None
                    ) -> tokenizer_lib.PretrainedTokenizer:
  return tokenizer(files_dir(workdir), saved_vocab(workdir), config)
