"""What a Hugging Face architecture module offers, and the registry of them.

Adding an architecture is one module beside t5.py / bart.py / bert.py / gpt2.py that offers
the `Architecture` members (plus any of OPTIONAL it needs), one line in MODULES below, and its
tests against transformers (tests/hf_fixtures.py's table of test kinds; docs/ARCHITECTURE.md,
"Adding a pretrained architecture"). Everything that lists the supported model_types reads
MODEL_TYPES from here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Collection, Protocol

from transformer_jax.pretrained import bart
from transformer_jax.pretrained import bert
from transformer_jax.pretrained import gemma
from transformer_jax.pretrained import gpt2
from transformer_jax.pretrained import llama
from transformer_jax.pretrained import m2m_100
from transformer_jax.pretrained import mapping
from transformer_jax.pretrained import marian
from transformer_jax.pretrained import t5


class Architecture(Protocol):
  """The members every architecture module has (module-level names and functions)."""
  MODEL_TYPES: tuple[str, ...]  # config.json's model_type values it reads
  FAMILY: str  # the family it trains as (families.NAMES)
  EMBEDDING_TENSOR: str  # the token embedding (its rows give the vocabulary size)
  OUTPUT_TENSOR: str | None  # an untied LM output; None: the model has no LM output

  def model_fields(self, hf: dict, tied: bool) -> dict:
    """TransformerConfig fields of config.json `hf` (`tied`: the checkpoint has no output
    tensor of its own); ValueError, in words a user can act on, for what it cannot import."""

  def special_ids(self, hf: dict) -> tuple[int | None, int]:
    """The checkpoint's (pad, eos) ids; pad None where it has none (one is added)."""

  def weight_table(self, hf: dict, fields: dict,
                   names: Collection[str] | None = None) -> list[mapping.Entry]:
    """Every parameter of ours and the checkpoint tensors it comes from (`names`: the
    checkpoint's tensors, where the layout depends on them; None: what an export writes)."""


# Members a module has only where it needs them, and what each does.
OPTIONAL = {
    "complete_config": "(hf, folder) -> hf: what config.json leaves to the tokenizer files",
    "head_tensors": "(hf) -> names: a classifier's head, absent from a bare encoder",
    "export_config": "(hf, label_names) -> the config.json an export writes",
}

MODULES: tuple[ModuleType, ...] = (t5, bart, marian, m2m_100, bert, gpt2, llama, gemma)
ARCHITECTURES: dict[str, ModuleType] = {
    name: module for module in MODULES for name in module.MODEL_TYPES}
MODEL_TYPES = tuple(sorted(ARCHITECTURES))


def missing_members(module: ModuleType) -> list[str]:
  """The `Architecture` members `module` lacks (a test checks every registered one)."""
  required = [*Architecture.__annotations__, "model_fields", "special_ids", "weight_table"]
  return [name for name in required if not hasattr(module, name)]
