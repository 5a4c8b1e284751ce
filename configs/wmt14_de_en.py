"""WMT'14 German -> English: configs/wmt14_en_de.py in the other direction, BLEU on
newstest2014.

  python -m transformer_jax.main --config configs/wmt14_de_en.py --workdir runs/wmt14_de_en \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets

Prepare the data once on a machine with internet:
  tfds build wmt14_translate/de-en --data_dir=gs://BUCKET/tensorflow_datasets
Or from the Hugging Face Hub (wmt/wmt14 de-en, as in wmt14_en_de.py):
  python -m transformer_jax.main --config configs/wmt14_de_en.py:hub --workdir runs/wmt14_de_en_hub
Transformer-base as in wmt14_en_de.py; the paper reports no de->en number. Not yet measured by
this project (no accelerator was available).
"""

from transformer_jax import default_config


def get_config(data: str = "tfds"):
  """`data`: 'tfds' or 'hub', as in wmt14_en_de.py."""
  config = default_config.sibling(__file__, "wmt14_en_de", data)
  config.tfds.update(source_key="de", target_key="en")
  if config.dataset == "huggingface":
    config.huggingface.columns.update(source="translation.de", target="translation.en")
  return config
