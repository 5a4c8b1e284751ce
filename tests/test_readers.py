"""Local corpus readers, TFDS reading (mocked: no downloads here) and the shared corpora."""

import gzip
import json
import os

import numpy as np
import pytest

from transformer_jax import default_config
from transformer_jax.data import readers
from transformer_jax.data import sources

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..",
                      "shared", "data")


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


def test_tfds_source_reads_records_and_explains_missing_data(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  config = default_config.get_config()
  config.dataset = "tfds"
  config.tfds.update(name="imdb_reviews", source_key="text", label_key="label")
  config.task = "classification"
  config.tfds_data_dir = str(tmp_path)
  with pytest.raises(FileNotFoundError, match=r"tfds build imdb_reviews --data_dir="):
    sources.load_examples(config, ["test"])
  with tfds.testing.mock_data(num_examples=3):
    examples = sources.load_examples(config, ["test"])["test"]
  assert len(examples) == 3 and all(set(e) == {"source", "label"} for e in examples)


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
