"""Token ids of an imported checkpoint against this project's convention.

Every model and pipeline here reads id 0 as padding and id 1 as end of sequence (see
tokenizer.py). A Hugging Face checkpoint has its own ids for them (BART: pad 1, eos 2;
Marian: pad = vocab size - 1, eos 0). Rather than teach every mask and loss another pad id,
an import renumbers the vocabulary: the embedding rows, output columns and logits bias are
permuted so that the checkpoint's pad is internal 0 and its eos internal 1, and the tokenizer
adapter maps ids through the same permutation. Outputs are unchanged; export permutes back.

A checkpoint without a pad token (GPT-2) gets one added: an id past its vocabulary, whose
embedding row starts at zero and whose logit the model masks (`mask_padding_logit`); export
leaves that row out.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class VocabMap:
  """A permutation of `vocab_size` ids: the checkpoint's pad -> 0, its eos -> 1.

  `to_internal[hf_id]` is the id inside this project's model; `to_hf[internal_id]` the
  checkpoint's. T5 (pad 0, eos 1) gets the identity.
  """
  to_hf: np.ndarray  # int64 [vocab_size]: internal id -> checkpoint id
  checkpoint_size: int  # the checkpoint's ids; one fewer than to_hf where a pad was added

  @classmethod
  def create(cls, vocab_size: int, pad_id: int | None, eos_id: int) -> "VocabMap":
    """`vocab_size` checkpoint ids; `pad_id` None: the checkpoint has no pad, so one is
    added (checkpoint id `vocab_size`)."""
    size = vocab_size + (pad_id is None)
    pad_id = vocab_size if pad_id is None else pad_id
    if pad_id == eos_id or not (0 <= pad_id < size and 0 <= eos_id < vocab_size):
      raise ValueError(f"pad id {pad_id} and eos id {eos_id} must be two different ids "
                       f"below the vocabulary size {vocab_size}.")
    to_hf = np.arange(size)
    for internal, hf_id in ((0, pad_id), (1, eos_id)):
      at = int(np.flatnonzero(to_hf == hf_id)[0])
      to_hf[[internal, at]] = to_hf[[at, internal]]
    return cls(to_hf, vocab_size)

  @property
  def added_pad(self) -> bool:
    """Whether the pad is an id the checkpoint does not have (GPT-2)."""
    return len(self.to_hf) > self.checkpoint_size

  @property
  def to_internal(self) -> np.ndarray:
    return np.argsort(self.to_hf)

  @property
  def is_identity(self) -> bool:
    return bool(np.all(self.to_hf == np.arange(len(self.to_hf))))

  def internal(self, hf_ids):
    """Checkpoint ids (an int or any integer array) -> internal ids."""
    return self.to_internal[np.asarray(hf_ids)]

  def hf(self, internal_ids):
    """Internal ids -> checkpoint ids."""
    return self.to_hf[np.asarray(internal_ids)]

  def rows_to_internal(self, table: np.ndarray) -> np.ndarray:
    """A [vocab, ...] array in checkpoint order (embedding, logits bias) in internal order,
    with a zero row for an added pad. Only the few renumbered rows move: a writable `table`
    is changed in place, not copied (unless a row is added)."""
    if self.added_pad and len(table) == self.checkpoint_size:
      table = np.concatenate([table, np.zeros((1,) + table.shape[1:], table.dtype)])
    return _permute_rows(table, self.to_hf)

  def rows_to_hf(self, table: np.ndarray) -> np.ndarray:
    """Internal order -> checkpoint order, in a copy (export leaves the model's arrays be);
    an added pad's row is left out."""
    return _permute_rows(np.array(table), self.to_internal)[:self.checkpoint_size]


def _permute_rows(table: np.ndarray, source: np.ndarray) -> np.ndarray:
  """`table[source]`, moving only the rows that change."""
  moved = np.flatnonzero(source != np.arange(len(source)))
  if not table.flags.writeable:
    table = table.copy()
  table[moved] = table[source[moved]]  # the right side is gathered before any write
  return table
