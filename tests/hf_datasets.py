"""Small Hugging Face datasets for the tests, written with the `datasets` library from the tiny
demo corpus (so a run on them can be compared with the same run on the demo data):

  translation/      save_to_disk DatasetDict, one nested column translation = {en, de}
  summarization/    a folder of Parquet files named by split, columns dialogue / summary
  classification/   a folder of Parquet files, sentence / label, label a ClassLabel
                    ("short", "long": more or fewer than 8 words)
"""

import os

from tests.conftest import make_tiny_config
from transformer_jax import default_config
from transformer_jax.data import sources

CLASS_NAMES = ["short", "long"]
TRANSLATION_COLUMNS = {"huggingface.columns.source": "translation.en",
                       "huggingface.columns.target": "translation.de"}


def demo_examples(cache: str) -> dict[str, list[dict]]:
  """The tiny config's demo splits: {split: [{'source', 'target'}, ...]}."""
  return sources.load_examples(make_tiny_config(cache))


def label(text: str) -> int:
  return int(len(text.split()) > 8)


def write(cache: str, folder: str) -> dict[str, str]:
  """Writes the three datasets into `folder`; returns {kind: path}."""
  import datasets  # pylint: disable=import-outside-toplevel
  examples = demo_examples(cache)
  paths = {kind: os.path.join(folder, kind)
           for kind in ("translation", "summarization", "classification")}
  translation = datasets.Features({"translation": datasets.Translation(languages=["de", "en"])})
  datasets.DatasetDict({split: datasets.Dataset.from_dict(
      {"translation": [{"en": e["source"], "de": e["target"]} for e in split_examples]},
      features=translation) for split, split_examples in examples.items()}).save_to_disk(
          paths["translation"])
  classes = datasets.Features({"sentence": datasets.Value("string"),
                               "label": datasets.ClassLabel(names=CLASS_NAMES)})
  for split, split_examples in examples.items():
    os.makedirs(paths["summarization"], exist_ok=True)
    datasets.Dataset.from_dict({
        "id": [str(i) for i in range(len(split_examples))],
        "dialogue": [e["source"] for e in split_examples],
        "summary": [e["target"] for e in split_examples]}).to_parquet(
            os.path.join(paths["summarization"], f"{split}.parquet"))
    os.makedirs(paths["classification"], exist_ok=True)
    datasets.Dataset.from_dict({
        "sentence": [e["source"] for e in split_examples],
        "label": [label(e["source"]) for e in split_examples]}, features=classes).to_parquet(
            os.path.join(paths["classification"], f"{split}.parquet"))
  return paths


def config(name: str, task: str = "translation", **overrides):
  """A default config reading the dataset `name` (for reading tests; no model)."""
  c = default_config.get_config()
  c.task, c.dataset, c.huggingface.name = task, "huggingface", name
  if task == "classification":
    c.model.num_classes = 2
  c.update_from_flattened_dict(overrides)
  return c
