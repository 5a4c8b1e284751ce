"""WMT'17 English -> German training data (as flax examples/wmt), BLEU on WMT'14 newstest2014.

  python -m transformer_jax.main --config configs/wmt17_en_de.py --workdir runs/wmt17_en_de \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/wmt17_en_de --mode evaluate --average_last 5

Prepare the data once on a machine with internet:
  tfds build wmt17_translate/de-en wmt14_translate/de-en --data_dir=gs://BUCKET/tensorflow_datasets
Transformer-base as in wmt14_en_de.py; validation and test come from wmt14_translate/de-en.
Not yet measured by this project (no accelerator was available).
"""

from transformer_jax import default_config


def get_config():
  config = default_config.sibling(__file__, "wmt14_en_de")
  config.tfds.update(name="wmt17_translate/de-en", eval_name="wmt14_translate/de-en")
  return config
