"""Hugging Face datasets (config.dataset='huggingface'), offline: datasets written here with
the `datasets` library from the tiny demo corpus (tests/hf_datasets.py), read in every form
and from a GCS emulator, trained on (the same run as on the demo data, through a kill -9),
evaluated and served; bad settings refused in one line before a workdir is made."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests import cli
from tests import hf_datasets
from tests.conftest import ROOT
from tests.conftest import make_tiny_config

datasets = pytest.importorskip("datasets")

from transformer_jax import commands  # noqa: E402
from transformer_jax import train  # noqa: E402
from transformer_jax.data import hf_source  # noqa: E402
from transformer_jax.data import sources  # noqa: E402


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, data_cache):
  folder = str(tmp_path_factory.mktemp("hf_datasets"))
  return hf_datasets.write(data_cache, folder), hf_datasets.demo_examples(data_cache)


def _read(config, split="train", shard=0, count=1):
  examples, total = hf_source.stream(config, split, shard, count)
  return list(examples), total


def test_each_form_reads_the_examples_in_order_and_in_shards(corpora, tmp_path):
  paths, demo = corpora
  pairs = [{"source": e["source"], "target": e["target"]} for e in demo["train"]]
  # save_to_disk with a nested translation dict; the summary columns found by their names.
  translation = hf_datasets.config(paths["translation"], **hf_datasets.TRANSLATION_COLUMNS)
  summarization = hf_datasets.config(paths["summarization"], "summarization")
  streamed = hf_datasets.config(paths["summarization"], "summarization",
                                **{"huggingface.streaming": True})
  for config in (translation, summarization, streamed):
    assert _read(config) == (pairs, len(pairs))  # a stream's count from the file metadata
    for shard in range(3):  # example i in shard i % 3, as for every source
      assert _read(config, "train", shard, 3) == (pairs[shard::3], len(pairs[shard::3]))
  assert sources.load_examples(translation, ["test"])["test"] == demo["test"]
  # Slices of a saved dataset's splits, in the syntax load_dataset reads from the Hub.
  translation.splits.train = "train[:100]+test[-8:]"
  assert _read(translation, "train", 1, 2) == ((pairs[:100] + demo["test"][-8:])[1::2], 54)

  # A builder over files given per split: JSON lines with string labels, mapped by name.
  for split in ("train", "test"):
    with open(tmp_path / f"{split}.jsonl", "w", encoding="utf-8") as f:
      for e in demo[split][:40]:
        f.write(json.dumps({"text": e["source"], "label": hf_datasets.CLASS_NAMES[
            hf_datasets.label(e["source"])]}) + "\n")
  builder = hf_datasets.config("json", "classification", **{
      "huggingface.data_files.train": str(tmp_path / "train.jsonl"),
      "huggingface.data_files.test": str(tmp_path / "test.jsonl"),
      "label_names": hf_datasets.CLASS_NAMES})
  examples, _ = _read(builder, "test")
  assert examples == [{"source": e["source"], "label": hf_datasets.label(e["source"])}
                      for e in demo["test"][:40]]
  assert hf_source.class_names(builder) is None  # strings: named by config.label_names


def test_class_names_come_from_the_class_label_column(corpora):
  paths, demo = corpora
  config = hf_datasets.config(paths["classification"], "classification")
  assert list(config.label_names) == ["negative", "positive"]
  sources.check_dataset(config, ("train", "validation"))
  assert list(config.label_names) == hf_datasets.CLASS_NAMES
  examples, _ = _read(config, "validation")
  assert [e["label"] for e in examples] == [hf_datasets.label(e["source"])
                                            for e in demo["validation"]]
  config.model.num_classes = 3
  with pytest.raises(ValueError, match="has 2 classes .short, long. but config.model.num_"
                                       "classes=3; set --config.model.num_classes=2"):
    hf_source.apply_label_names(config)


_READ_FROM_BUCKET = """
import json, sys
sys.path.insert(0, {root!r})
import fsspec
from tests import hf_datasets
from transformer_jax.data import hf_source
fs = fsspec.filesystem("gs")
for kind in ("translation", "summarization"):
  fs.put({paths!r}[kind], "gs://test-bucket/data/" + kind, recursive=True)
translation = hf_datasets.config("gs://test-bucket/data/translation",
                                 **hf_datasets.TRANSLATION_COLUMNS)
summarization = hf_datasets.config("gs://test-bucket/data/summarization", "summarization")
read = lambda config, *shard: list(hf_source.stream(config, "train", *shard)[0])
print("RESULT", json.dumps([read(translation, 1, 2), read(summarization, 0, 2)]))
"""


def test_a_bucket_holds_a_saved_dataset_and_a_parquet_folder(corpora, gcs_emulator):
  paths, demo = corpora
  script = _READ_FROM_BUCKET.format(root=ROOT, paths=paths)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        env=cli.env(STORAGE_EMULATOR_HOST=gcs_emulator), timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  translation, summarization = json.loads(done.stdout.split("RESULT", 1)[1])
  assert translation == demo["train"][1::2]
  assert summarization == demo["train"][0::2]


def _hf_args(path, *extra):
  return ("--config.dataset=huggingface", f"--config.huggingface.name={path}", *extra)


def test_a_saved_dataset_trains_like_the_demo_data_through_a_kill_and_serves(
    corpora, data_cache, tmp_path):
  paths, _ = corpora
  args = _hf_args(paths["translation"], *[f"--config.{k}={v}" for k, v in
                                          hf_datasets.TRANSLATION_COLUMNS.items()])
  workdir = tmp_path / "hf"
  first = cli.start(workdir, *args, "--config.num_train_steps=100000", cache=data_cache)
  steps = lambda: sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
  cli.wait_for(lambda: (workdir / "checkpoints").is_dir() and steps(), first)
  first.kill()  # SIGKILL: nothing runs after it
  first.communicate()
  last = steps()[-1] + 10
  resumed = cli.run(workdir, *args, f"--config.num_train_steps={last}", cache=data_cache)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "from the token cache" in resumed.stderr and "Resumed from checkpoint" in resumed.stderr

  # The same examples as the demo source, in the same order: the same tokenizer, batches and
  # training, so the killed and resumed run ends where an uninterrupted demo run does.
  demo_workdir, demo = str(tmp_path / "demo"), make_tiny_config(data_cache)
  demo.update(num_train_steps=last, eval_every_steps=last)
  train.train_and_evaluate(demo, demo_workdir)
  on_hf = commands.run_evaluate(str(workdir), split="validation")
  on_demo = commands.run_evaluate(demo_workdir, split="validation")
  assert on_hf["step"] == on_demo["step"] == last
  np.testing.assert_allclose(on_hf["loss"], on_demo["loss"], rtol=1e-5)
  assert on_hf["bleu"] == on_demo["bleu"]
  source, output = tmp_path / "in.txt", tmp_path / "out.txt"
  source.write_text("The dog sees the cat.\n", encoding="utf-8")
  commands.run_predict(str(workdir), str(source), str(output))
  assert output.read_text(encoding="utf-8").count("\n") == 1


def test_class_label_parquet_in_a_bucket_trains_evaluates_and_serves_its_names(
    corpora, data_cache, gcs_emulator, tmp_path):
  paths, _ = corpora
  bucket = cli.Bucket(gcs_emulator, "test-bucket")
  for name in os.listdir(paths["classification"]):
    with open(os.path.join(paths["classification"], name), "rb") as f:
      bucket.write(f"classes/{name}", f.read())
  environ = cli.env(STORAGE_EMULATOR_HOST=gcs_emulator)
  workdir = tmp_path / "classes"
  trained = cli.run(workdir, "--config.task=classification", "--config.num_train_steps=10",
                    "--config.eval_every_steps=10", *_hf_args("gs://test-bucket/classes"),
                    cache=data_cache, environ=environ)
  assert trained.returncode == 0, trained.stderr[-3000:]
  evaluated = cli.run(workdir, "--mode", "evaluate", environ=environ)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  result = json.loads(evaluated.stdout.strip().splitlines()[-1])
  assert result["step"] == 10 and 0 <= result["accuracy"] <= 1
  (tmp_path / "in.txt").write_text("a dog\n", encoding="utf-8")
  predicted = cli.run(workdir, "--mode", "predict", "--input", str(tmp_path / "in.txt"),
                      "--output_format", "jsonl", environ=environ)
  assert predicted.returncode == 0, predicted.stderr[-3000:]
  line = json.loads(predicted.stdout.strip().splitlines()[-1])
  assert list(line["probabilities"]) == hf_datasets.CLASS_NAMES


@pytest.mark.parametrize("override, message", [
    ("--config.huggingface.columns.target=translation.fr",
     "columns.target='translation.fr' is not a field of .* its columns are .'translation'."),
    ("--config.splits.validation=dev",
     "has no split 'dev'; set --config.splits.validation to one of .'test', 'train', "
     "'validation'."),
])
def test_a_wrong_column_or_split_is_one_line_and_no_workdir(corpora, data_cache, tmp_path,
                                                            override, message):
  paths, _ = corpora
  workdir = tmp_path / "never"
  args = [f"--config.{k}={v}" for k, v in hf_datasets.TRANSLATION_COLUMNS.items()]
  failed = cli.run(workdir, *_hf_args(paths["translation"], *args), override,
                   cache=data_cache)
  assert failed.returncode == 1
  assert re.search(message, cli.user_error(failed.stderr))
  assert not workdir.exists()


_OFFLINE = """
import json, os, shutil, sys
sys.path.insert(0, {root!r})
import datasets
from tests import hf_datasets
from transformer_jax.data import hf_source
# What a first load with network leaves in the library's cache, under a Hub id's name.
datasets.load_dataset({folder!r})
cache = datasets.config.HF_DATASETS_CACHE
prepared = os.path.join(cache, os.path.basename({folder!r}))
shutil.copytree(prepared, os.path.join(cache, "someone___tiny"))
for root, _, names in os.walk(os.path.join(cache, "someone___tiny")):
  for name in names:
    if name.endswith(".arrow"):
      os.rename(os.path.join(root, name), os.path.join(root, name.replace(
          os.path.basename({folder!r}), "tiny")))
config = hf_datasets.config("someone/tiny", "summarization")
examples, total = hf_source.stream(config, "test", 0, 1)
errors = []
for name in ("someone/other", "./not_here"):
  try:
    hf_source.stream(hf_datasets.config(name, "summarization"), "test")
  except (ValueError, OSError) as e:
    errors.append(str(e))
print("RESULT", json.dumps([list(examples), total, errors]))
"""


def test_offline_a_cached_hub_dataset_loads_and_an_uncached_one_is_one_line(corpora,
                                                                             tmp_path):
  paths, demo = corpora
  script = _OFFLINE.format(root=ROOT, folder=paths["summarization"])
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        cwd=tmp_path, timeout=300, env=cli.env(
                            HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                            HF_DATASETS_CACHE=str(tmp_path / "cache")))
  assert done.returncode == 0, done.stderr[-3000:]
  examples, total, errors = json.loads(done.stdout.split("RESULT", 1)[1])
  assert examples == demo["test"] and total == len(demo["test"])
  assert errors[0].startswith("Dataset 'someone/other' is not in the local datasets cache "
                              "and the Hub cannot be reached")
  assert errors[1].startswith("config.huggingface.name='./not_here' is not a folder")
