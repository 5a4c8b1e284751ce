"""The workdir on a local disk or in a bucket: paths, the saved config and the tokenizer file.

Every workdir path goes through `etils.epath` (the file-system layer Orbax uses too), so
`--workdir gs://BUCKET/run` (or any fsspec URL) works like a local folder. Buckets are reached
through fsspec (gcsfs) and TensorStore, never TensorFlow's own GCS client, so one variable
points everything at a GCS emulator: `STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from typing import IO, Iterator

# Set before etils, gcsfs or TensorStore read them (they do at import or first use).
os.environ.setdefault("EPATH_USE_TF", "false")  # gs:// through gcsfs, not tf.io.gfile


def _point_clients_at_emulator() -> None:
  """Maps the standard emulator variable to what TensorStore and gcsfs need as well."""
  emulator = os.environ.get("STORAGE_EMULATOR_HOST")
  if not emulator:
    return
  if "://" not in emulator:
    emulator = f"http://{emulator}"
  os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
  os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
  # The emulator has no zonal / hierarchical buckets; gcsfs's probe for them only warns.
  os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


_point_clients_at_emulator()

import ml_collections  # noqa: E402  (after the environment above)
from etils import epath  # noqa: E402

from transformer_jax import default_config  # noqa: E402

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"


class WorkdirError(RuntimeError):
  """The workdir lacks what a command needs; the message says what to do."""


def is_url(path: str | os.PathLike) -> bool:
  return "://" in os.fspath(path)


def path(location: str | os.PathLike) -> epath.Path:
  """An epath.Path for a local path (made absolute) or a URL such as gs://bucket/run."""
  location = os.fspath(location)
  return epath.Path(location if is_url(location) else os.path.abspath(location))


def write_atomic(target: epath.Path, data: bytes) -> None:
  """Writes `data` so that readers see the old file or the new one, never half of it: a local
  file through a temporary file and a rename; an object-store write is atomic already."""
  if is_url(target):
    target.write_bytes(data)
    return
  tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
  tmp.write_bytes(data)
  os.replace(tmp, target)


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  write_atomic(path(workdir) / CONFIG_FILE, config.to_json(indent=2).encode())


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config a workdir was trained with; keys added to the project since keep defaults."""
  config_path = path(workdir) / CONFIG_FILE
  if not config_path.exists():
    raise WorkdirError(
        f"{config_path} not found: {workdir} is not a training workdir. Train first with "
        "python -m transformer_jax.main --config configs/demo.py --workdir DIR.")
  saved = json.loads(config_path.read_text())
  return ml_collections.ConfigDict(_merged(default_config.get_config().to_dict(), saved))


def _merged(defaults: dict, saved: dict) -> dict:
  merged = dict(defaults)
  for key, value in saved.items():
    if isinstance(value, dict) and isinstance(merged.get(key), dict):
      value = _merged(merged[key], value)
    merged[key] = value
  return merged


def tokenizer_path(workdir: str) -> epath.Path:
  return path(workdir) / TOKENIZER_FILE


@contextlib.contextmanager
def open_text(location: str, mode: str) -> Iterator[IO[str]]:
  """A text stream on a local file, a URL, or '-' (stdin / stdout). Invalid UTF-8 is
  replaced, never fatal; lines end at '\\n' or '\\r\\n' only (a lone '\\r' stays in the line)."""
  if location == "-":
    stream = sys.stdin if "r" in mode else sys.stdout
    stream.reconfigure(encoding="utf-8", errors="replace", newline="\n" if "r" in mode else None)
    yield stream
    return
  with path(location).open(mode.replace("t", "") + "b") as raw:
    # newline='\n' keeps a lone '\r' inside its line; readers strip the '\r\n' themselves.
    with io.TextIOWrapper(raw, encoding="utf-8", errors="replace",
                          newline="\n" if "r" in mode else None) as text:
      yield text
