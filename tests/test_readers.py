"""Local corpus readers, TFDS reading (of datasets prepared here: no downloads) and the shared
corpora."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import cli
from transformer_jax import default_config
from transformer_jax.data import readers
from transformer_jax.data import sources

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")


def _write(path, lines, compress=False):
  data = "".join(line + "\n" for line in lines).encode("utf-8")
  if compress:
    with gzip.open(path + ".gz", "wb") as f:
      f.write(data)
  else:
    with open(path, "wb") as f:
      f.write(data)


def test_parallel_reads_plain_and_gzip_files(tmp_path):
  _write(str(tmp_path / "train.en"), ["a cat", "two dogs"])
  _write(str(tmp_path / "train.de"), ["eine Katze", "zwei Hunde\u2028!"], compress=True)
  assert readers.read_parallel(str(tmp_path), "train", "en", "de") == [
      {"source": "a cat", "target": "eine Katze"},
      {"source": "two dogs", "target": "zwei Hunde\u2028!"}]  # \u2028 does not end a line


def test_misaligned_parallel_corpus_is_a_clear_error(tmp_path):
  _write(str(tmp_path / "train.en"), ["one", "two", "three"])
  _write(str(tmp_path / "train.de"), ["eins", "zwei"])
  with pytest.raises(ValueError, match=r"Misaligned corpus: .*train\.en: 3 lines, .*train\.de: "
                                       r"2 lines"):
    readers.read_parallel(str(tmp_path), "train", "en", "de")


def test_missing_file_names_the_folder_contents(tmp_path):
  _write(str(tmp_path / "train.en"), ["one"])
  with pytest.raises(FileNotFoundError, match=r"train\.de\.gz exists.*train\.en"):
    readers.read_parallel(str(tmp_path), "train", "en", "de")


def test_jsonl_tsv_and_label_lines(tmp_path):
  _write(str(tmp_path / "dev.jsonl"), [json.dumps({"dialogue": "hi", "summary": "greeting"}),
                                       ""])
  assert readers.read_jsonl(str(tmp_path), "dev", "dialogue", "summary") == [
      {"source": "hi", "target": "greeting"}]
  _write(str(tmp_path / "bad.jsonl"), ['{"dialogue": "hi"}'])
  with pytest.raises(ValueError, match=r"bad\.jsonl, line 1: .*'summary'"):
    readers.read_jsonl(str(tmp_path), "bad", "dialogue", "summary")
  _write(str(tmp_path / "train.tsv"), ["label\tsentence", "1\tgood \"fun\"", "0\tbad"])
  assert readers.read_tsv(str(tmp_path), "train", "sentence", "label") == [
      {"source": 'good "fun"', "label": 1}, {"source": "bad", "label": 0}]
  os.makedirs(tmp_path / "test")
  _write(str(tmp_path / "test" / "sents.txt"), ["tốt", "tệ"])
  _write(str(tmp_path / "test" / "sentiments.txt"), ["2", "0"])
  assert readers.read_label_lines(str(tmp_path), "test", "sents.txt", "sentiments.txt") == [
      {"source": "tốt", "label": 2}, {"source": "tệ", "label": 0}]


def test_label_files_split_is_seeded_and_disjoint(tmp_path):
  _write(str(tmp_path / "neg"), [f"bad {i}" for i in range(50)])
  _write(str(tmp_path / "pos"), [f"good {i}" for i in range(50)])
  splits = readers.read_label_files(str(tmp_path), ["neg", "pos"], "utf-8", seed=1)
  assert [len(splits[s]) for s in ("train", "validation", "test")] == [80, 10, 10]
  assert splits == readers.read_label_files(str(tmp_path), ["neg", "pos"], "utf-8", seed=1)
  texts = [e["source"] for split in splits.values() for e in split]
  assert len(set(texts)) == 100
  assert all(e["label"] == e["source"].startswith("good") for e in splits["train"])


def _tfds_pairs_config(data_dir):
  config = default_config.get_config()
  config.dataset, config.tfds_data_dir = "tfds", data_dir
  config.tfds.update(name="tiny_pairs", source_key="en", target_key="de")
  config.splits.update(train="train", test="test")
  return config


# Run in a subprocess where TensorFlow cannot be found (as on a machine without it):
# prints shard 1 of 3 of the ArrayRecord training split.
_READ_WITHOUT_TENSORFLOW = """
import importlib.machinery, json, sys
class NoTensorFlow(importlib.machinery.PathFinder):
  @classmethod
  def find_spec(cls, name, path=None, target=None):
    if name.split(".")[0] == "tensorflow":
      return None
    return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path = [NoTensorFlow if f is importlib.machinery.PathFinder else f
                 for f in sys.meta_path]
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import test_readers
from transformer_jax.data import examples
examples_iter, count = examples.stream(test_readers._tfds_pairs_config({data_dir!r}), "train", 1, 3)
print(json.dumps([count, list(examples_iter), "tensorflow" in sys.modules]))
"""


# A TFDS config's training run where TensorFlow Datasets is not installed (the base install).
_TRAIN_WITHOUT_TFDS = """
import importlib.machinery, runpy, sys
class NoTFDS(importlib.machinery.PathFinder):
  @classmethod
  def find_spec(cls, name, path=None, target=None):
    if name.split(".")[0] in ("tensorflow", "tensorflow_datasets"):
      return None
    return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path = [NoTFDS if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
sys.path.insert(0, {root!r})
sys.argv = ["main", "--config", {config!r}, "--workdir", {workdir!r}]
runpy.run_module("transformer_jax.main", run_name="__main__")
"""


def test_a_tfds_config_without_tfds_installed_names_the_install_in_one_line(tmp_path):
  workdir = tmp_path / "run"
  script = _TRAIN_WITHOUT_TFDS.format(root=ROOT, workdir=str(workdir),
                                      config=os.path.join(ROOT, "configs", "wmt14_en_de.py"))
  run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=cli.env())
  assert run.returncode == 1, run.stderr[-2000:]
  lines = [line for line in run.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and "pip install -r requirements-tfds.txt" in lines[0], lines
  assert not workdir.exists()  # refused before anything was written


@pytest.mark.parametrize("file_format", ["array_record", "tfrecord"])
def test_tfds_source_reads_prepared_data_by_shard_and_explains_missing_data(tmp_path,
                                                                            file_format):
  tfds = pytest.importorskip("tensorflow_datasets")
  data_dir = str(tmp_path)
  config = _tfds_pairs_config(data_dir)
  config.tfds.name = "imdb_reviews"
  with pytest.raises(FileNotFoundError, match=r"tfds build imdb_reviews --data_dir="):
    sources.load_examples(config, ["test"])

  tiny_pairs(tfds)(data_dir=data_dir, file_format=file_format).download_and_prepare()
  config = _tfds_pairs_config(data_dir)
  every = sources.load_examples(config, ["train"])["train"]
  assert sorted(e["source"] for e in every) == sorted(f"house {i}" for i in range(20))
  assert all(e["target"] == "Haus" + e["source"][len("house"):] for e in every)
  shards = [sources.stream(config, "train", i, 3) for i in range(3)]
  assert [count for _, count in shards] == [7, 7, 6]
  assert [list(it) for it, _ in shards] == [every[i::3] for i in range(3)]
  with pytest.raises(ValueError, match=r"config.splits.train to one of \['test', 'train'\]"):
    config.splits.train = "training"
    sources.load_examples(config, ["train"])

  if file_format == "array_record":  # read by index, and TensorFlow is not needed for it
    script = _READ_WITHOUT_TENSORFLOW.format(root=ROOT, tests=os.path.dirname(__file__),
                                             data_dir=data_dir)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    count, shard, imported_tensorflow = json.loads(run.stdout.splitlines()[-1])
    assert (count, shard, imported_tensorflow) == (7, every[1::3], False)


_TINY_PAIRS = []


def tiny_pairs(tfds):
  """A TFDS dataset of 20 training and 5 test pairs, made here (TFDS registers a builder
  class once per process, by its name)."""
  if not _TINY_PAIRS:

    class TinyPairs(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")

      def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"en": tfds.features.Text(), "de": tfds.features.Text()}))

      def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(20), "test": self._generate_examples(5)}

      def _generate_examples(self, count):
        for i in range(count):
          yield i, {"en": f"house {i}", "de": f"Haus {i}"}

    _TINY_PAIRS.append(TinyPairs)
  return _TINY_PAIRS[0]


_SHARED_COUNTS = {  # (name, config overrides, train / validation / test sizes from its README)
    "multi30k": (dict(format="parallel", source_lang="en", target_lang="de"),
                 dict(validation="val", test="test_2016_flickr"), (29_000, 1_014, 1_000)),
    "dialogsum": (dict(format="jsonl", source_field="dialogue",
                       target_field="summary|summary1"),
                  dict(validation="dev"), (12_460, 500, 500)),
    "sst2": (dict(format="tsv", text_column="sentence|content"), dict(validation="dev"),
             (67_349, 872, 1_821)),
    "uit_vsfc": (dict(format="label_lines"), dict(validation="dev"), (11_426, 1_583, 3_166)),
}


@pytest.mark.parametrize("name", sorted(_SHARED_COUNTS))
def test_shared_corpora_load_with_their_published_sizes(name):
  if not os.path.isdir(os.path.join(SHARED, name)):
    pytest.skip(f"{SHARED}/{name} is not here")
  local, splits, counts = _SHARED_COUNTS[name]
  config = default_config.get_config()
  config.dataset, config.data_dir = "local", os.path.join(SHARED, name)
  config.local.update(local)
  config.splits.update(splits)
  examples = sources.load_examples(config)
  assert tuple(len(examples[s]) for s in ("train", "validation", "test")) == counts


def test_shared_rt_polarity_loads_all_sentences():
  if not os.path.isdir(os.path.join(SHARED, "rt_polarity")):
    pytest.skip("rt_polarity is not here")
  config = default_config.get_config()
  config.dataset, config.data_dir = "local", os.path.join(SHARED, "rt_polarity")
  config.local.update(format="label_files", encoding="latin-1",
                      label_files=["rt-polarity.neg", "rt-polarity.pos"])
  examples = sources.load_examples(config)
  assert sum(len(v) for v in examples.values()) == 10_662
  assert np.mean([e["label"] for e in examples["train"]]) == pytest.approx(0.5, abs=0.02)


def test_lines_split_only_on_line_feeds_in_any_encoding(tmp_path):
  path = str(tmp_path / "texts")
  for encoding in ("utf-8", "utf-16", "latin-1"):
    with open(path, "w", encoding=encoding, newline="") as f:
      f.write("h\u00e9llo\r\nw\u00f6rld \x85 x\n\nlast")
    assert readers.read_lines(path, encoding) == ["h\u00e9llo", "w\u00f6rld \x85 x", "", "last"]
  assert readers.count_lines(path) == 4  # latin-1, as written last
