"""Several LoRA adapters served on one base, as vLLM's --lora-modules: `--adapter NAME=DIR`
(repeatable) names a PEFT adapter folder; a request's `model` picks its adapter (the base's
own name, or none, picks the base alone). Rows of different adapters share a batch: the
adapters are not merged but stacked (lora.stacked: entry 0 is none, entry i the i-th named),
and every row reads its own (lora.for_rows) in each projection it adapts.

`--adapter DIR` without a name keeps serving the one adapter merged into the weights, which
decodes at the base model's speed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

import jax

from transformer_jax import parallel
from transformer_jax.model import lora as lora_lib


@dataclasses.dataclass
class AdapterSet:
  """Named adapters over one base: `names[i]` is stack entry i + 1 (entry 0: none)."""
  names: tuple[str, ...]
  folders: tuple[str, ...]
  # The base's family over a model with the per-row adapters that hold them all
  # (lora.per_row_spec): what the server decodes with.
  family: Any
  stack: dict  # host arrays [1 + len(names), ...], lora.stacked's layout
  boxed: dict  # the stack's logical axes (one row's, boxed abstract values)

  def index(self, name: str) -> int | None:
    """The stack entry of adapter `name`; None for a name not served."""
    return self.names.index(name) + 1 if name in self.names else None


def parse(values: list[str] | None) -> tuple[str | None, dict[str, str]]:
  """--adapter values -> (the one folder to merge, or None; {name: folder} served per row).
  ValueError in one line for a mix of both, several unnamed folders or a name given twice."""
  merged, named = [], {}
  for value in values or []:
    name, _, folder = value.partition("=")
    if not folder or os.sep in name or "/" in name:  # a folder (whose path may hold '=')
      merged.append(value)
      continue
    if not re.fullmatch(r"[\w.:-]+", name):
      raise ValueError(f"--adapter {value}: an adapter's name is letters, digits and "
                       "'_.:-' (--adapter NAME=DIR).")
    if name in named:
      raise ValueError(f"--adapter {name}=... is given twice: give each adapter its own "
                       "name.")
    named[name] = folder
  if merged and (named or len(merged) > 1):
    raise ValueError("--adapter DIR merges one adapter into the weights; to serve several "
                     "side by side, name each one: --adapter NAME=DIR.")
  return (merged[0] if merged else None), named


def check_names(named: dict[str, str], base_name: str) -> None:
  """ValueError in one line where an adapter takes the base model's name."""
  if base_name in named:
    raise ValueError(f"--adapter {base_name}=...: {base_name!r} is the base model's name; "
                     "give the adapter another.")


def load(predictor, named: dict[str, str], base_name: str) -> AdapterSet:
  """The PEFT adapters `named` ({name: folder}, each made for the predictor's --pretrained
  checkpoint), stacked for per-row serving; ValueError / PretrainedError in one line for a
  folder that is not such an adapter, or a classifier (whose adapters bring heads)."""
  from transformer_jax import predict  # pylint: disable=g-import-not-at-top
  from transformer_jax.pretrained import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  config = predictor.config
  if not predictor.family.generates_text:
    raise ValueError("Named adapters (--adapter NAME=DIR) serve text generation; a "
                     "classifier's adapter brings its own head: serve one, merged, with "
                     "--adapter DIR.")
  check_names(named, base_name)
  checkpoint = checkpoint_lib.open_checkpoint(config.pretrained)
  read = [predict.read_peft_adapter(folder, checkpoint, config) for folder in named.values()]
  wide = lora_lib.per_row_spec([spec for _, spec in read])
  family = predictor.family.with_adapters(wide)
  boxed = jax.eval_shape(functools.partial(family.init_params, boxed=True, quantized=True),
                         jax.random.PRNGKey(0))
  boxed_adapters = lora_lib.split(boxed)[0]
  stack = lora_lib.stacked(read, wide, parallel.unbox(boxed_adapters))
  return AdapterSet(tuple(named), tuple(named.values()), family, stack, boxed_adapters)
