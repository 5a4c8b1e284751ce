"""A model folder's files read as untrusted input: every byte is checked before it is used.

Folders come from the Hub, colleagues' buckets and half-finished downloads. Each file the
importer reads goes through here, and any problem is one `PretrainedError` line that names the
file (and the tensor) and says what to do:

- JSON files (config.json, generation_config.json, the weights index, the tokenizer's JSON
  files): valid UTF-8 JSON whose top level is an object, with the keys the caller requires.
- safetensors files: the header is checked against the file before any tensor is read, as the
  safetensors library itself validates it: a header length that fits the file, a JSON object
  of {name: {dtype, shape, data_offsets}}, known dtypes, byte ranges that match their shapes
  and tile the data section exactly (no overlap, no gap, nothing past the end). Reading a
  tensor then allocates exactly the bytes the file holds for it.
- an index's shards: plain file names inside the folder, present, and holding exactly the
  tensors the index names.

Nothing here unpickles or imports anything: PyTorch pickles (.bin, .pt, .pth, .ckpt, .pkl) are
never opened, and custom code in a folder is never imported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import ml_dtypes
import numpy as np


class PretrainedError(ValueError):
  """A checkpoint that cannot be used; the message says what to do."""


REDOWNLOAD = ("re-download it (in a git clone of the repository: `git lfs pull`), or re-save "
              "the model with transformers' save_pretrained")
# Pickled PyTorch files: loading one can run arbitrary code, so they are never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# What the safetensors library accepts as a header (its MAX_HEADER_SIZE): 100 MB.
MAX_HEADER_BYTES = 100_000_000
# safetensors dtype names -> numpy (bfloat16 from ml_dtypes, which JAX depends on).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}


def read_json(path: str, required: bool = False, keys: tuple[str, ...] = ()) -> dict:
  """The JSON object in `path` ({} when the file is absent and not `required`), with `keys`."""
  name = os.path.basename(path)
  if not os.path.isfile(path):
    if required:
      raise PretrainedError(f"{path} is missing; pass a complete Hugging Face model folder.")
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except json.JSONDecodeError as e:
    raise PretrainedError(f"{path} is not valid JSON ({e.msg} at line {e.lineno} column "
                          f"{e.colno}): the file is damaged or cut short; re-download {name} "
                          "from the model's repository.") from None
  except UnicodeDecodeError:
    raise PretrainedError(f"{path} is not UTF-8 text: the file is damaged; re-download {name} "
                          "from the model's repository.") from None
  if not isinstance(value, dict):
    raise PretrainedError(f"{path} holds a JSON {type(value).__name__}, not an object: it is "
                          f"not a {name}; re-download it from the model's repository.")
  missing = [key for key in keys if key not in value]
  if missing:
    raise PretrainedError(f"{path} has no {missing[0]!r}: it is not a complete {name}; "
                          "re-download it from the model's repository.")
  return value


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lies in a safetensors file: absolute byte offsets [begin, end)."""
  path: str
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int
  end: int

  def read(self) -> np.ndarray:
    with open(self.path, "rb") as f:
      f.seek(self.begin)
      array = np.fromfile(f, self.dtype, math.prod(self.shape))
    if array.size != math.prod(self.shape):  # the file changed since its header was checked
      raise PretrainedError(f"{self.path} is shorter than its header says; {REDOWNLOAD}.")
    return array.reshape(self.shape)


def read_header(path: str) -> dict[str, TensorInfo]:
  """The tensors of safetensors file `path`, after checking its header against the file."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    start = f.read(max(0, min(size, 64)))
    if start.startswith(b"version https://git-lfs"):
      raise PretrainedError(f"{path} is a Git LFS pointer, not the weights: run `git lfs pull` "
                            "in the checkpoint's repository (or download the folder again).")
    if size < 8:
      raise PretrainedError(f"{path} is {'empty' if size == 0 else f'{size} bytes'}, not a "
                            f"safetensors file (an interrupted download?); {REDOWNLOAD}.")
    length = int.from_bytes(start[:8], "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
      raise PretrainedError(f"{path}: its header claims {length} bytes but the file has "
                            f"{size - 8} after the length: the file is cut short or is not a "
                            f"safetensors file; {REDOWNLOAD}.")
    f.seek(8)
    raw = f.read(length)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError):
    raise PretrainedError(f"{path}: its header is not valid JSON: the file is damaged or not "
                          f"a safetensors file; {REDOWNLOAD}.") from None
  if not isinstance(header, dict):
    raise PretrainedError(f"{path}: its header is not a JSON object; {REDOWNLOAD}.")
  metadata = header.pop("__metadata__", {})
  if not isinstance(metadata, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
    raise PretrainedError(f"{path}: its __metadata__ is not a map of strings; {REDOWNLOAD}.")
  data_start = 8 + length
  tensors = {name: _tensor_info(path, name, entry, data_start)
             for name, entry in header.items()}
  _check_tiling(path, tensors, data_start, size)
  return tensors


def _tensor_info(path: str, name: str, entry, data_start: int) -> TensorInfo:
  """One header entry, checked on its own: its fields, dtype, shape and byte count."""
  where = f"{path}: tensor {name!r}"
  if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
    raise PretrainedError(f"{where} lacks dtype, shape or data_offsets in the header; "
                          f"{REDOWNLOAD}.")
  dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
  if dtype not in DTYPES:
    raise PretrainedError(f"{where} has dtype {dtype!r}, which this importer does not read "
                          f"(it reads {', '.join(DTYPES)}); re-save the model in float32, "
                          "float16 or bfloat16 with transformers' save_pretrained.")
  if not (isinstance(shape, list) and all(natural(n) for n in shape)):
    raise PretrainedError(f"{where} has shape {shape!r}, not a list of sizes; {REDOWNLOAD}.")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(natural, offsets))
          and offsets[0] <= offsets[1]):
    raise PretrainedError(f"{where} has data_offsets {offsets!r}, not a byte range; "
                          f"{REDOWNLOAD}.")
  numpy_dtype = np.dtype(DTYPES[dtype]).newbyteorder("<")
  expected = math.prod(shape) * numpy_dtype.itemsize
  if offsets[1] - offsets[0] != expected:
    raise PretrainedError(f"{where} has shape {shape} of {dtype} ({expected} bytes) but its "
                          f"byte range holds {offsets[1] - offsets[0]}; {REDOWNLOAD}.")
  return TensorInfo(path, numpy_dtype, tuple(shape), data_start + offsets[0],
                    data_start + offsets[1])


def natural(n) -> bool:
  """Whether `n` is a count: an int (not a bool) of at least 0."""
  return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _check_tiling(path: str, tensors: dict[str, TensorInfo], data_start: int,
                  size: int) -> None:
  """The byte ranges follow one another from the data section's start to the file's end."""
  position = data_start
  for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
    if info.begin != position:
      problem = "overlaps the tensor before it" if info.begin < position else (
          f"starts {info.begin - position} bytes after the tensor before it ends")
      raise PretrainedError(f"{path}: tensor {name!r} {problem}: the header is damaged; "
                            f"{REDOWNLOAD}.")
    position = info.end
  if position != size:
    what = (f"is cut short: its tensors need {position - data_start} bytes of data but it "
            f"holds {size - data_start}" if position > size else
            f"has {size - position} bytes after its last tensor")
    raise PretrainedError(f"{path} {what}; {REDOWNLOAD}.")


def read_index(folder: str, index_name: str) -> dict[str, TensorInfo]:
  """The tensors of a sharded checkpoint: its index checked against its shards' headers."""
  index_path = os.path.join(folder, index_name)
  weight_map = read_json(index_path, required=True, keys=("weight_map",))["weight_map"]
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise PretrainedError(f"{index_path}: weight_map is not a map of tensor names to file "
                          f"names; {REDOWNLOAD}.")
  tensors: dict[str, TensorInfo] = {}
  for shard in sorted(set(weight_map.values())):
    if os.path.basename(shard) != shard or shard in ("", ".", ".."):
      raise PretrainedError(f"{index_path} names the shard {shard!r}, which is not a file "
                            "name in the checkpoint's folder; the index is damaged or not "
                            "this checkpoint's: re-download it.")
    path = os.path.join(folder, shard)
    if not os.path.isfile(path):
      raise PretrainedError(f"{index_path} names the shard {shard}, which is missing: the "
                            "download is incomplete; download the folder again.")
    for name, info in read_header(path).items():
      if name in tensors:
        raise PretrainedError(f"{path}: tensor {name!r} is also in {tensors[name].path}; "
                              f"{REDOWNLOAD}.")
      tensors[name] = info
  unlisted = sorted(set(tensors) - set(weight_map))
  misplaced = sorted(name for name, shard in weight_map.items()
                     if name not in tensors or tensors[name].path != os.path.join(folder, shard))
  if misplaced:
    name = misplaced[0]
    raise PretrainedError(f"{index_path} puts tensor {name!r} in {weight_map[name]}, which does "
                          f"not hold it ({len(misplaced)} such tensors): the index and its "
                          "shards are from different downloads; download the folder again.")
  if unlisted:
    raise PretrainedError(f"{tensors[unlisted[0]].path} holds tensor {unlisted[0]!r}, which "
                          f"{index_path} does not name ({len(unlisted)} such tensors): the index "
                          "and its shards are from different downloads; download the folder "
                          "again.")
  return tensors
