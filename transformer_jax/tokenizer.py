"""SentencePiece tokenizer: train on a text sample, save, load, encode, decode.

Reserved ids: 0 = padding, 1 = end of sequence, 2 = beginning of sequence, 3 = unknown.
"""

from __future__ import annotations

import io
import itertools
import os
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from transformer_jax import workdir as workdir_lib

PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
# Fewer texts than this are encoded one by one in the calling thread (`encode_batch`).
FEW_TEXTS = 64


class Tokenizer:
  """A SentencePiece model with the reserved ids above."""

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    if (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id()) != (PAD_ID, EOS_ID, BOS_ID):
      raise ValueError("This SentencePiece model does not use pad=0, eos=1, bos=2; retrain it "
                       "with transformer_jax.tokenizer.train_tokenizer.")

  @property
  def vocab_size(self) -> int:
    return self._sp.get_piece_size()

  def encode(self, text: str) -> list[int]:
    return self._sp.encode(text)

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True
                   ) -> list[list[int]]:
    """`encode` of every text, on all cores (SentencePiece's own threads) where there are
    many: below FEW_TEXTS, starting the threads costs more than the texts (a server's
    request: 80 us against 3). This tokenizer adds no special tokens either way."""
    del add_special_tokens
    if len(texts) < FEW_TEXTS:
      return [self._sp.encode(text) for text in texts]
    return self._sp.encode(list(texts), num_threads=os.cpu_count() or 1)

  def encode_target_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Target texts: one vocabulary serves both sides (imported Marian models have two)."""
    return self.encode_batch(texts)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Decodes up to the first EOS; padding and reserved ids are dropped."""
    ids = [int(i) for i in ids]
    if EOS_ID in ids:
      ids = ids[:ids.index(EOS_ID)]
    return self._sp.decode([i for i in ids if i > UNK_ID])

  def id_to_piece(self, token_id: int) -> str:
    """The piece an id stands for, e.g. '▁Haus' (a word start), '</s>' (EOS) or '<pad>'."""
    return self._sp.id_to_piece(int(token_id))

  def save(self, path: str | os.PathLike) -> None:
    """Writes the model to a local path or URL; a killed run never leaves half a file."""
    workdir_lib.write_atomic(workdir_lib.path(path), self.model_proto)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Tokenizer":
    return cls(workdir_lib.path(path).read_bytes())


def sample(texts: Iterable[str], size: int, seed: int) -> list[str]:
  """A seeded uniform sample of `size` texts from a stream (all of them, in order, when there
  are fewer), holding only the sample: reservoir sampling, a chunk of random draws at a time."""
  rng = np.random.default_rng(seed)
  kept, seen, texts = [], 0, iter(texts)
  while chunk := list(itertools.islice(texts, 100_000)):
    fill = min(size - len(kept), len(chunk))
    kept.extend(chunk[:fill])
    # Text number i (from 0) replaces a uniform slot of 0..i when that slot is in the sample.
    slots = rng.integers(0, np.arange(seen + fill, seen + len(chunk)) + 1)
    for position in np.flatnonzero(slots < size).tolist():
      kept[slots[position]] = chunk[fill + position]
    seen += len(chunk)
  return kept


def train_tokenizer(sentences: Iterable[str], vocab_size: int, *,
                    character_coverage: float = 1.0, byte_fallback: bool = False,
                    model_type: str = "unigram", max_sentences: int = 1_000_000) -> Tokenizer:
  """Trains a SentencePiece model on (a sample of) `sentences`."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
      model_type=model_type, character_coverage=character_coverage,
      byte_fallback=byte_fallback, input_sentence_size=max_sentences,
      shuffle_input_sentence=True, hard_vocab_limit=False,
      pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
      minloglevel=2)
  return Tokenizer(model.getvalue())

