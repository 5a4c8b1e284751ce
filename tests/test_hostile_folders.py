"""Damaged and hostile model folders (issue #43): each one is refused in one line that names the
file, before anything large is allocated, and nothing in it is ever executed or unpickled.

Every folder is a copy of one tiny BART checkpoint with one thing broken. The command-line runs
check what a user sees (exit status, one error line, no traceback); `Predictor.from_pretrained`
must raise the project's error type with the same message. Files that would run code (a
pickle, a module named by auto_map, a chat template) write a marker file if they ever do.
"""

import json
import os
import pickle
import shutil
import struct
import sys

import pytest

from tests import cli
from tests import hf_fixtures
from tests.conftest import ROOT
from transformer_jax.pretrained import checkpoint as checkpoint_lib
from transformer_jax.pretrained import files
from transformer_jax.pretrained import tokenizer as tokenizer_lib

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
  return hf_fixtures.tiny_model("bart", str(tmp_path_factory.mktemp("bart")))


# ---- Ways to break a folder: each edits the copy in `folder`; `marker` must never appear ----

def _header(folder):
  """(header dict, data bytes) of the folder's model.safetensors."""
  with open(os.path.join(folder, WEIGHTS), "rb") as f:
    raw = f.read()
  length = struct.unpack("<Q", raw[:8])[0]
  return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_weights(folder, header, data, length=None):
  text = json.dumps(header).encode()
  with open(os.path.join(folder, WEIGHTS), "wb") as f:
    f.write(struct.pack("<Q", len(text) if length is None else length) + text + data)


def _tensor(header, index=-1):
  """The name of the header's tensor at `index` in file order."""
  names = sorted((k for k in header if k != "__metadata__"),
                 key=lambda k: header[k]["data_offsets"][0])
  return names[index]


def _edit_tensor(folder, change, index=-1):
  header, data = _header(folder)
  change(header[_tensor(header, index)], header)
  _write_weights(folder, header, data)


def _truncate(name, keep):
  def edit(folder, marker):
    del marker
    path = os.path.join(folder, name)
    with open(path, "rb") as f:
      raw = f.read()
    with open(path, "wb") as f:
      f.write(raw[:keep(len(raw))])
  return edit


def _overwrite(name, content: str | bytes):
  def edit(folder, marker):
    del marker
    with open(os.path.join(folder, name), "wb") as f:
      f.write(content if isinstance(content, bytes) else content.encode())
  return edit


def _edit_config(name="config.json", **changes):
  def edit(folder, marker):
    del marker
    path = os.path.join(folder, name)
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
    config.update(changes)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(config, f)
  return edit


def _header_length_lie(folder, marker):
  header, data = _header(folder)
  _write_weights(folder, header, data, length=10 * len(data))


def _header_not_json(folder, marker):
  header, data = _header(folder)
  text = json.dumps(header).encode()
  with open(os.path.join(folder, WEIGHTS), "wb") as f:
    f.write(struct.pack("<Q", len(text)) + b"\xff" * len(text) + data)


def _offsets_past_the_end(folder, marker):
  """The 931 GiB case: one tensor's shape and byte range claim far more than the file has."""
  def change(entry, header):
    entry["shape"] = [1_000_000, 100_000]
    entry["data_offsets"][1] = entry["data_offsets"][0] + 4 * 1_000_000 * 100_000
  _edit_tensor(folder, change)


def _overlapping(folder, marker):
  def change(entry, header):
    previous = header[_tensor(header, -2)]
    size = entry["data_offsets"][1] - entry["data_offsets"][0]
    entry["data_offsets"] = [previous["data_offsets"][0], previous["data_offsets"][0] + size]
  _edit_tensor(folder, change)


def _unknown_dtype(folder, marker):
  _edit_tensor(folder, lambda entry, header: entry.update(dtype="Q4_K"))


def _shape_against_bytes(folder, marker):
  _edit_tensor(folder, lambda entry, header: entry.update(shape=[2, 2]))


def _lfs_pointer(folder, marker):
  _overwrite(WEIGHTS, "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 9\n")(
      folder, marker)


def _sharded(folder, edit_index):
  """Splits model.safetensors into two shards and an index, then `edit_index(weight_map)`."""
  header, data = _header(folder)
  names = sorted((k for k in header if k != "__metadata__"),
                 key=lambda k: header[k]["data_offsets"][0])
  weight_map = {}
  for shard, part in (("model-00001-of-00002.safetensors", names[:10]),
                      ("model-00002-of-00002.safetensors", names[10:])):
    own, position, chunks = {}, 0, []
    for name in part:
      begin, end = header[name]["data_offsets"]
      own[name] = dict(header[name], data_offsets=[position, position + end - begin])
      chunks.append(data[begin:end])
      position += end - begin
      weight_map[name] = shard
    text = json.dumps(own).encode()
    with open(os.path.join(folder, shard), "wb") as f:
      f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))
  os.remove(os.path.join(folder, WEIGHTS))
  edit_index(weight_map)
  with open(os.path.join(folder, checkpoint_lib.WEIGHTS_INDEX), "w", encoding="utf-8") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _missing_shard(folder, marker):
  _sharded(folder, lambda m: None)
  os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))


def _shard_outside_the_folder(folder, marker):
  _sharded(folder, lambda m: m.update({k: "../model.safetensors" for k in list(m)[:1]}))


def _index_names_other_tensors(folder, marker):
  _sharded(folder, lambda m: m.update({"model.decoder.extra.weight": next(iter(m.values()))}))


class _WritesMarker:
  """Unpickled, it writes the marker file: the payload of a hostile pytorch_model.bin."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, "w"))


def _pickle_only(folder, marker):
  os.remove(os.path.join(folder, WEIGHTS))
  with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
    pickle.dump(_WritesMarker(marker), f)


_CODE = "open({marker!r}, 'w').write('imported')\n"


def _custom_code(folder, marker):
  """An architecture of the folder's own, in Python that writes the marker when imported."""
  for module in ("configuration_evil", "modeling_evil"):
    with open(os.path.join(folder, f"{module}.py"), "w", encoding="utf-8") as f:
      f.write(_CODE.format(marker=marker))
  _edit_config(model_type="evil_lm", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                               "AutoModel": "modeling_evil.EvilModel"})(
                                                   folder, marker)


def _template_escape(folder, marker):
  escape = ("{{ cycler.__init__.__globals__.os.popen('touch " + marker + "').read() }}"
            "{% for m in messages %}{{ m.content }}{% endfor %}")
  _edit_config("tokenizer_config.json", chat_template=escape)(folder, marker)


def _template_syntax(folder, marker):
  _edit_config("tokenizer_config.json", chat_template="{% for m in messages %}{{ m.content }")(
      folder, marker)


# name -> (how to break the folder, the file the error must name, a phrase it must hold)
CASES = {
    "empty_weights": (_truncate(WEIGHTS, lambda n: 0), WEIGHTS, "is empty"),
    "truncated_weights": (_truncate(WEIGHTS, lambda n: n - 1000), WEIGHTS, "cut short"),
    "header_length_lie": (_header_length_lie, WEIGHTS, "header claims"),
    "header_not_json": (_header_not_json, WEIGHTS, "not valid JSON"),
    "offsets_past_the_end": (_offsets_past_the_end, WEIGHTS, "cut short"),
    "overlapping_tensors": (_overlapping, WEIGHTS, "overlaps"),
    "unknown_dtype": (_unknown_dtype, WEIGHTS, "'Q4_K'"),
    "shape_against_bytes": (_shape_against_bytes, WEIGHTS, "byte range holds"),
    "lfs_pointer": (_lfs_pointer, WEIGHTS, "git lfs pull"),
    "config_cut_short": (_truncate("config.json", lambda n: n // 2), "config.json",
                         "not valid JSON"),
    "config_not_an_object": (_overwrite("config.json", "[1, 2]"), "config.json",
                             "not an object"),
    "generation_config_broken": (_overwrite("generation_config.json", "{'num_beams': 4}"),
                                 "generation_config.json", "not valid JSON"),
    "tokenizer_config_broken": (_truncate("tokenizer_config.json", lambda n: n - 3),
                                "tokenizer_config.json", "not valid JSON"),
    "tokenizer_json_broken": (_truncate("tokenizer.json", lambda n: n // 3), "tokenizer.json",
                              "not valid JSON"),
    "tokenizer_json_without_model": (_overwrite("tokenizer.json", '{"version": "1.0"}'),
                                     "tokenizer.json", "has no 'model'"),
    "special_tokens_map_broken": (_overwrite("special_tokens_map.json", "{"),
                                  "special_tokens_map.json", "not valid JSON"),
    "vocab_json_not_utf8": (_overwrite("vocab.json", b'{"\xff": 0}'), "vocab.json", "UTF-8"),
    "zero_heads": (_edit_config(encoder_attention_heads=0, decoder_attention_heads=0),
                   "config.json", "positive count"),
    "heads_not_dividing_width": (_edit_config(encoder_attention_heads=3,
                                              decoder_attention_heads=3),
                                 "config.json", "do not divide"),
    "huge_vocabulary": (_edit_config(vocab_size=10 ** 12), "config.json", "vocab_size"),
    "negative_width": (_edit_config(d_model=-16), "config.json", "positive count"),
    "config_larger_than_weights": (_edit_config(encoder_layers=40, decoder_layers=40),
                                   "", "have no tensor"),
    "config_wider_than_weights": (_edit_config(encoder_ffn_dim=4096, decoder_ffn_dim=4096),
                                  WEIGHTS, "does not fit the model"),
    "missing_shard": (_missing_shard, checkpoint_lib.WEIGHTS_INDEX, "missing"),
    "shard_outside_the_folder": (_shard_outside_the_folder, checkpoint_lib.WEIGHTS_INDEX,
                                 "not a file name"),
    "index_names_other_tensors": (_index_names_other_tensors, checkpoint_lib.WEIGHTS_INDEX,
                                  "does not hold it"),
    "pickle_weights": (_pickle_only, "pytorch_model.bin", "never loaded"),
    "custom_code": (_custom_code, "config.json", "'evil_lm' is not supported"),
    "template_escapes_the_sandbox": (_template_escape, "tokenizer_config.json", "sandbox"),
    "template_does_not_parse": (_template_syntax, "tokenizer_config.json", "does not parse"),
}


@pytest.fixture(scope="module")
def folders(base, tmp_path_factory) -> dict[str, tuple[str, str]]:
  """name -> (the broken folder, its marker path)."""
  root = tmp_path_factory.mktemp("hostile")
  made = {}
  for name, (edit, _, _) in CASES.items():
    folder, marker = str(root / name), str(root / f"{name}.marker")
    shutil.copytree(base, folder)
    edit(folder, marker)
    made[name] = folder, marker
  return made


def _check_message(message: str, name: str, folder: str) -> None:
  _, file_name, phrase = CASES[name]
  assert "\n" not in message.strip(), message
  assert os.path.join(folder, file_name).rstrip("/") in message, message
  assert phrase in message, message


@pytest.mark.parametrize("name", sorted(CASES))
def test_predictor_raises_the_projects_error_naming_the_file(folders, name):
  folder, marker = folders[name]
  from transformer_jax import predict  # pylint: disable=g-import-not-at-top
  with pytest.raises(files.PretrainedError) as error:
    predict.Predictor.from_pretrained(folder)
  _check_message(str(error.value), name, folder)
  assert not os.path.exists(marker)


# One folder per file the command line reads before it builds a model: the weights, config.json,
# the tokenizer, the chat template (every folder's message is the Python API's, checked above;
# a process each for all of them cost two minutes of the suite).
_COMMAND_LINE_CASES = ("truncated_weights", "config_larger_than_weights",
                       "tokenizer_json_broken", "template_escapes_the_sandbox")


def test_the_command_line_refuses_each_folder_in_one_line(folders, tmp_path):
  """What a user sees: exit status 1, one 'error:' line naming the file, no traceback, fast
  (the runs at once; each ends before any model is built or weights are read)."""
  source = tmp_path / "input.txt"
  source.write_text("A small test.\n")
  runs = {name: cli.Run([sys.executable, "-m", "transformer_jax.main", "--mode", "predict",
                         "--pretrained", folders[name][0], "--input", str(source)],
                        cwd=ROOT, env=cli.env())
          for name in _COMMAND_LINE_CASES}
  results = {name: (run.wait(timeout=120), *run.output()) for name, run in runs.items()}
  from transformer_jax import predict  # pylint: disable=g-import-not-at-top
  for name, (code, stdout, stderr) in results.items():
    folder, marker = folders[name]
    assert code == 1 and not stdout, (name, code, stdout, stderr)
    assert "Traceback" not in stderr, (name, stderr)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, (name, stderr)
    _check_message(errors[0], name, folder)
    with pytest.raises(files.PretrainedError) as error:  # the Python API's message is the same
      predict.Predictor.from_pretrained(folder)
    assert errors[0] == "error: " + str(error.value), name
    assert not os.path.exists(marker), name


def test_code_beside_good_weights_is_never_run(base, tmp_path):
  """A usable folder that also holds a hostile pickle, tokenizer code named by auto_map and a
  chat template that reaches for os: it loads and predicts, and none of them runs."""
  folder, marker = str(tmp_path / "mixed"), str(tmp_path / "marker")
  shutil.copytree(base, folder)
  with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
    pickle.dump(_WritesMarker(marker), f)
  with open(os.path.join(folder, "tokenization_evil.py"), "w", encoding="utf-8") as f:
    f.write(_CODE.format(marker=marker))
  _edit_config("tokenizer_config.json", auto_map={
      "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})(folder, marker)
  from transformer_jax import predict  # pylint: disable=g-import-not-at-top
  outputs = predict.Predictor.from_pretrained(folder).predict(["A small test."])
  assert len(outputs) == 1 and not os.path.exists(marker)
  _template_escape(folder, marker)
  with pytest.raises(files.PretrainedError, match="sandbox"):
    tokenizer_lib.PretrainedTokenizer(folder)
  assert not os.path.exists(marker)


def test_a_sandboxed_template_renders_a_conversation():
  from transformer_jax.pretrained import chat_template  # pylint: disable=g-import-not-at-top
  template = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}"
              "{% if loop.last and add_generation_prompt %}<assistant>{% endif %}{% endfor %}"
              "{{ {'k': '<é>'} | tojson }}")
  text = chat_template.render(template, [{"role": "user", "content": " Hi "}], bos_token="<s>")
  assert text == '<s><user>Hi<assistant>{"k": "<é>"}'


def test_a_safetensors_file_written_by_the_library_passes_the_checks(tmp_path):
  """The checks accept what safetensors writes: padded headers, every dtype read here, empty
  tensors and metadata."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  from safetensors import numpy as st  # pylint: disable=g-import-not-at-top
  arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros((0, 4), np.int64),
            "c": np.ones(5, ml_dtypes.bfloat16), "d": np.array([True, False]),
            "e": np.arange(3, dtype=np.float16)}
  path = str(tmp_path / "x.safetensors")
  st.save_file(arrays, path, metadata={"format": "np"})
  tensors = files.read_header(path)
  assert sorted(tensors) == sorted(arrays)
  for name, array in arrays.items():
    np.testing.assert_array_equal(tensors[name].read(), array)
