"""Hugging Face checkpoint folders (or hub names) in: config, weights, special ids.

`open_checkpoint(name_or_path)` resolves a folder (or a GGUF file: gguf_file.py) (downloading a hub name with
`huggingface_hub` when online), reads config.json and generation_config.json and translates
them; `read_params(checkpoint)` reads model.safetensors (one file or an indexed set of
shards) in the safetensors format into numpy, a few tensors at a time, and returns this project's
parameter tree (float32 whatever the file's dtype, or the file's 16-bit dtype where the model
computes in it: `held_dtype`). No torch is needed.

The architecture modules, what each offers and the registry of them: architecture.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import checkpoints
from transformer_jax.pretrained.architecture import ARCHITECTURES, MODEL_TYPES
from transformer_jax.pretrained import files
from transformer_jax.pretrained import gguf_file
from transformer_jax.pretrained import mapping
from transformer_jax.pretrained import vocab as vocab_lib

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# What config.json held for generation before generation_config.json existed.
GENERATION_KEYS = ("num_beams", "max_length", "min_length", "length_penalty", "do_sample",
                   "temperature", "top_k", "top_p", "no_repeat_ngram_size", "bad_words_ids",
                   "forced_bos_token_id", "forced_eos_token_id", "repetition_penalty",
                   "decoder_start_token_id", "max_new_tokens")


PretrainedError = files.PretrainedError


@dataclasses.dataclass
class Checkpoint:
  """A resolved checkpoint folder and what its config says."""
  folder: str
  hf_config: dict
  generation_config: dict
  fields: dict  # models.TransformerConfig fields
  vocab: vocab_lib.VocabMap
  # The weights' tensor names; None where only the config is known (a workdir's copy).
  tensor_names: frozenset[str] | None = None
  gguf: str | None = None  # a GGUF file's path (gguf_file.py): the folder holds its metadata

  @property
  def model_type(self) -> str:
    return self.hf_config["model_type"]

  @property
  def architecture(self) -> ModuleType:
    return ARCHITECTURES[self.model_type]

  @property
  def family(self) -> str:
    """The model family it trains as (families.NAMES)."""
    return self.architecture.FAMILY

  @property
  def has_head(self) -> bool | None:
    """A classifier's: whether the weights hold a classification head (None: unknown)."""
    if self.tensor_names is None:
      return None
    return all(name in self.tensor_names for name in self.architecture.head_tensors(
        self.hf_config))

  @property
  def label_names(self) -> list[str]:
    """A classification head's label names, in class order (config.json's id2label)."""
    id2label = self.hf_config.get("id2label") or {}
    return [str(id2label[key]) for key in sorted(id2label, key=int)]

  def shapes(self) -> mapping.Shapes:
    return mapping.Shapes.of(self.fields, self.vocab)


def resolve(name_or_path: str) -> str:
  """A local folder for a folder path or a hub name (downloaded once into the usual
  huggingface_hub cache; offline, the cached copy is used)."""
  name_or_path = os.path.expanduser(name_or_path)
  if os.path.isdir(name_or_path):
    return name_or_path
  if "://" in name_or_path:
    raise PretrainedError(f"{name_or_path}: checkpoints are read from local folders or hub "
                          "names; copy the folder to local disk first (e.g. gcloud storage "
                          "cp -r).")
  if os.path.exists(name_or_path):
    raise PretrainedError(f"{name_or_path} is a file; pass the checkpoint's folder (with "
                          "config.json and model.safetensors), a GGUF file (.gguf) or a hub "
                          "name.")
  if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
    raise PretrainedError(f"No checkpoint folder {name_or_path}; check the path.")
  try:
    import huggingface_hub  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise PretrainedError(f"{name_or_path} is not a folder; to download hub names, pip install "
                          "huggingface_hub (or pass a downloaded folder).") from e
  # Weights only as safetensors: many repos also hold PyTorch .bin copies of them.
  patterns = ["*.json", "*.safetensors", "*.model", "*.spm", "*.txt"]
  try:
    return huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns)
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ in ("RepositoryNotFoundError", "GatedRepoError"):
      raise PretrainedError(f"The hub has no (accessible) model {name_or_path}; check the "
                            "name, or log in with `hf auth login` for gated models.") from e
    raise PretrainedError(
        f"Cannot download {name_or_path} ({type(e).__name__}: no network, or not cached). "
        "Download the folder on a machine that is online (`hf download "
        f"{name_or_path} --local-dir DIR`) and pass --pretrained DIR.") from e


def _read_json(folder: str, name: str, **checks) -> dict:
  return files.read_json(os.path.join(folder, name), **checks)


def _check_weights(folder: str) -> None:
  names = os.listdir(folder)
  if WEIGHTS in names or WEIGHTS_INDEX in names:
    return
  convert = ("convert them once where torch is installed: python -c \"import transformers as "
             "t; t.AutoModelForSeq2SeqLM.from_pretrained('NAME').save_pretrained('NEW_DIR')\" "
             "and pass NEW_DIR.")
  # Never opened: unpickling a PyTorch file can run any code it holds.
  pickles = sorted(n for n in names if n.endswith(files.PICKLE_SUFFIXES))
  if pickles:
    pickle = os.path.join(folder, pickles[0])
    raise PretrainedError(f"{folder} has PyTorch {os.path.splitext(pickle)[1]} weights but no "
                          f"model.safetensors ({pickle} is a pickle, never loaded here); "
                          + convert.replace("NAME", folder))
  raise PretrainedError(f"{folder} has no weights (model.safetensors): pass a complete "
                        "Hugging Face model folder; for a hub model with only .bin weights, "
                        + convert.replace("NAME", "HUB_NAME"))


@functools.lru_cache(maxsize=4)  # one resolve (a hub look-up) and read per run and checkpoint
def open_checkpoint(name_or_path: str) -> Checkpoint:
  """Resolves and checks a checkpoint and translates its config; reads no weights."""
  gguf_path = gguf_file.find(name_or_path)
  if gguf_path:
    source, folder = gguf_file.open_folder(gguf_path)
    hf_config = source.config
    return dataclasses.replace(
        describe(folder, hf_config, _read_json(folder, "generation_config.json"),
                 tied=hf_config["tie_word_embeddings"], tensor_names=frozenset(source.names)),
        gguf=gguf_path)
  folder = resolve(name_or_path)
  if not os.path.isfile(os.path.join(folder, "config.json")):
    raise PretrainedError(f"{folder} has no config.json; pass a Hugging Face model folder.")
  hf_config = _read_json(folder, "config.json", keys=("model_type",))
  model_type = hf_config.get("model_type")
  if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
    # Never imported: a folder's own modeling code (config.json's auto_map) is not read.
    raise PretrainedError(f"{os.path.join(folder, 'config.json')}: model_type {model_type!r} is "
                          f"not supported; supported: {', '.join(MODEL_TYPES)}.")
  _check_weights(folder)
  module = ARCHITECTURES[model_type]
  if hasattr(module, "complete_config"):
    try:
      hf_config = module.complete_config(hf_config, folder)
    except ValueError as e:
      raise PretrainedError(f"{folder}: {e}.") from None
  tensors = _Tensors(folder)
  _check_vocab_size(folder, hf_config, tensors)
  return describe(folder, hf_config, _read_json(folder, "generation_config.json"),
                  tied=_is_tied(tensors, module), tensor_names=frozenset(tensors.names))


def _check_vocab_size(folder: str, hf_config: dict, tensors: "_Tensors") -> None:
  """config.json's vocab_size is a count that the weights can hold: the renumbering of the
  vocabulary (and the tokenizer's) allocates per id before any tensor is read."""
  size = hf_config.get("vocab_size")
  if not files.natural(size) or not 0 < size <= tensors.num_values:
    raise PretrainedError(f"{os.path.join(folder, 'config.json')}: vocab_size {size!r} is not "
                          f"a positive count that its weights ({tensors.num_values} values) "
                          "can hold; the config.json is damaged or not this model's.")


def describe(folder: str, hf_config: dict, generation_config: dict, tied: bool,
             tensor_names: frozenset[str] | None = None) -> Checkpoint:
  """The Checkpoint of a config.json and generation_config.json ({} where there is none)."""
  module = ARCHITECTURES[hf_config["model_type"]]
  config_path = os.path.join(folder, "config.json")
  try:
    fields = module.model_fields(hf_config, tied=tied)
  except KeyError as e:
    raise PretrainedError(f"{config_path} has no {e}; it is not a complete "
                          f"{hf_config['model_type']} config.") from None
  except (ValueError, TypeError, ZeroDivisionError) as e:
    raise PretrainedError(f"{config_path}: {e}.") from None
  _check_sizes(config_path, fields)
  if not generation_config:  # older checkpoints keep generation settings in config.json
    generation_config = {k: v for k, v in hf_config.items() if k in GENERATION_KEYS}
  # transformers starts decoding from the generation config's start token where it has one.
  if isinstance(generation_config.get("decoder_start_token_id"), int):
    fields["bos_id"] = generation_config["decoder_start_token_id"]
  vocab = vocab_map(hf_config)
  fields["bos_id"] = int(vocab.internal(fields["bos_id"]))  # the decoder start
  return Checkpoint(folder, hf_config, generation_config, fields, vocab, tensor_names)


# The model's sizes, as model_fields translates them: each must be a positive count.
_SIZES = ("vocab_size", "emb_dim", "num_heads", "num_layers", "qkv_dim", "mlp_dim", "max_len")


def _check_sizes(config_path: str, fields: dict) -> None:
  """The sizes config.json gives make a model: positive counts, heads dividing the width."""
  sizes = {name: fields[name] for name in _SIZES if name in fields}
  sizes.update({name: fields[name] for name in ("num_decoder_layers", "num_kv_heads")
                if fields.get(name)})
  for name, value in sizes.items():
    if not files.natural(value) or value == 0:
      raise PretrainedError(f"{config_path} gives the model {name} = {value!r}, which is not "
                            "a positive count; the config.json is damaged or not this "
                            "model's.")
  if fields["qkv_dim"] % fields["num_heads"] or fields["num_heads"] % sizes.get(
      "num_kv_heads", fields["num_heads"]):
    raise PretrainedError(f"{config_path}: {fields['num_heads']} attention heads do not divide "
                          f"the attention width {fields['qkv_dim']} (or are not a multiple of "
                          "the key/value heads); the config.json is damaged or not this "
                          "model's.")


def vocab_map(hf_config: dict) -> vocab_lib.VocabMap:
  """The renumbering of a checkpoint's vocabulary (its pad -> 0, its eos -> 1)."""
  pad_id, eos_id = ARCHITECTURES[hf_config["model_type"]].special_ids(hf_config)
  return vocab_lib.VocabMap.create(hf_config["vocab_size"], pad_id, eos_id)


class _Tensors:
  """Tensors by name across the checkpoint's safetensors files, read on demand.

  The headers are checked against the files first (`files.read_header`). The tensors are read
  with plain reads at the offsets their headers give, not memory-mapped: a mapping's pages
  would count in the process's memory beside every copy made from them (twice the weights'
  size at peak, benchmarks/RESULTS.md). bfloat16 checkpoints read too (numpy has no bfloat16
  of its own).
  """

  def __init__(self, folder: str):
    self._folder = folder
    if os.path.isfile(os.path.join(folder, WEIGHTS_INDEX)):
      self._where = files.read_index(folder, WEIGHTS_INDEX)
    else:
      self._where = files.read_header(os.path.join(folder, WEIGHTS))

  def __contains__(self, name: str) -> bool:
    return name in self._where

  @property
  def names(self) -> list[str]:
    return list(self._where)

  @property
  def float_dtype(self) -> np.dtype:
    """The floating dtype that holds most of the values (float32 if there are none)."""
    counts: dict = {}
    for info in self._where.values():
      if jnp.issubdtype(info.dtype, jnp.floating):  # numpy's own test misses bfloat16
        counts[info.dtype] = counts.get(info.dtype, 0) + math.prod(info.shape)
    return np.dtype(max(counts, key=counts.get)) if counts else np.dtype(np.float32)

  @property
  def num_values(self) -> int:
    """How many values all the tensors hold together."""
    return sum(math.prod(info.shape) for info in self._where.values())

  def shape(self, name: str) -> tuple[int, ...]:
    return self._info(name).shape

  def path(self, name: str) -> str:
    """The file that holds tensor `name`."""
    return self._info(name).path

  def _info(self, name: str) -> files.TensorInfo:
    if name not in self._where:
      raise PretrainedError(f"The weights in {self._folder} have no tensor {name}: they do not "
                            "match its config.json (from different models?).")
    return self._where[name]

  def __getitem__(self, name: str) -> np.ndarray:
    return self._info(name).read()


def _tensors(checkpoint: Checkpoint):
  """The checkpoint's tensors by Hugging Face name: its safetensors files, or its GGUF file."""
  return gguf_file.opened(checkpoint.gguf) if checkpoint.gguf else _Tensors(checkpoint.folder)


def _is_tied(tensors: _Tensors, module: ModuleType) -> bool:
  """Whether the output layer is the token embedding: no output tensor of its own, or one
  equal to the embedding (what transformers ties on load)."""
  output, embedding = module.OUTPUT_TENSOR, module.EMBEDDING_TENSOR
  if output is None or output not in tensors:
    return True
  return embedding in tensors and np.array_equal(tensors[output], tensors[embedding])


def held_dtype(checkpoint: Checkpoint, compute_dtype) -> np.dtype:
  """The dtype to hold a served checkpoint's weights in: its own 16-bit dtype where the model
  computes in that dtype (every kernel is cast to it at use anyway, and a 16-bit file's values
  are exact in either, so the outputs are the same with half the memory), else float32."""
  stored = _tensors(checkpoint).float_dtype
  if stored.itemsize == 2 and stored == np.dtype(compute_dtype):
    return stored
  return np.dtype(np.float32)


def read_params(checkpoint: Checkpoint, expected=None, *, reset_head: bool = False,
                dtype=np.float32) -> dict:
  """This project's parameter tree (numpy, floating leaves in `dtype`) of the checkpoint's
  weights; checked against `expected` (the model's parameter shapes, e.g. from
  `jax.eval_shape`) if given.

  The tree may lack parameters the checkpoint does not hold (a bare encoder's classification
  head, or with `reset_head` a head that is to be trained anew): `missing_params` lists them.
  """
  tensors = _tensors(checkpoint)
  table = checkpoint.architecture.weight_table(checkpoint.hf_config, checkpoint.fields,
                                               frozenset(tensors.names))
  if reset_head:
    table = [entry for entry in table if entry.path[0] != "head"]
  _check_table(table, tensors, expected, checkpoint)
  try:
    if checkpoint.gguf and gguf_file.holds_quantized(expected):
      params = gguf_file.read_params(tensors, table, checkpoint.shapes(), expected)
    else:
      params = mapping.build_params(table, tensors.__getitem__, checkpoint.shapes(), dtype)
  except ValueError as e:  # a reshape of a tensor of another size
    if isinstance(e, PretrainedError):
      raise
    raise PretrainedError(f"The weights of {checkpoint.folder} do not fit its config.json "
                          f"({e}).") from None
  if expected is not None:
    _check_shapes(params, expected, checkpoint.folder)
  return params


def _check_table(table: list[mapping.Entry], tensors: _Tensors, expected,
                 checkpoint: Checkpoint) -> None:
  """Before any tensor is read: the weights hold every tensor the table names and, given the
  model's `expected` shapes, as many values as each parameter needs. A config.json describing
  a larger model than its weights fails here, with nothing allocated."""
  vocab = checkpoint.vocab
  for entry in table:
    shapes = [tensors.shape(name) for name in entry.hf]
    leaf = _leaf(expected, entry.path) if expected is not None else None
    if leaf is None:
      continue
    held = sum(math.prod(shape) for shape in shapes)
    if entry.kind == "offset_rows":
      held -= entry.offset * math.prod(shapes[0][1:])
    elif entry.kind.startswith("vocab_") and vocab.added_pad:
      held += held // vocab.checkpoint_size  # the added pad's row
    if held != math.prod(leaf.shape):
      raise PretrainedError(
          f"{tensors.path(entry.hf[0])}: tensor {entry.hf[0]!r} (shape {list(shapes[0])}) does "
          f"not fit the model that {os.path.join(checkpoint.folder, 'config.json')} describes "
          f"(its {'/'.join(entry.path)} is {list(leaf.shape)}): the config.json and the "
          "weights are from different models.")


def _leaf(tree, path: tuple[str, ...]):
  """The leaf of nested dicts `tree` at `path`, or None."""
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      return None
    tree = tree[key]
  return tree


def missing_params(params: dict, expected) -> list[tuple]:
  """The key paths of `expected`'s leaves that `params` (from `read_params`) lacks."""
  have = {path for path, _ in jax.tree_util.tree_leaves_with_path(params)}
  return [path for path, _ in jax.tree_util.tree_leaves_with_path(expected)
          if path not in have]


def complete_params(params: dict, fresh: dict) -> dict:
  """`params` with the leaves it lacks taken from `fresh`, a whole initialised tree."""

  def take(path, fresh_leaf):
    node = params
    for key in path:
      if key.key not in node:
        return np.asarray(fresh_leaf)
      node = node[key.key]
    return node

  return jax.tree_util.tree_map_with_path(take, fresh)


def _check_shapes(params: dict, expected, folder: str) -> None:
  # Leaves the checkpoint does not hold start fresh (see `missing_params`); those it holds
  # must be the model's.
  missing = {jax.tree_util.keystr(path) for path in missing_params(params, expected)}
  problems = [line for line in checkpoints.shape_differences(params, expected, "checkpoint")
              if line.partition(": ")[0] not in missing]
  if problems:
    raise PretrainedError(f"The weights of {folder} do not fit the model its config describes "
                          f"({len(problems)} differences, e.g. {'; '.join(problems[:3])}); "
                          "the config.json and model.safetensors may be from different models.")
