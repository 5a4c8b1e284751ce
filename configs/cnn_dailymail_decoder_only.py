"""CNN / DailyMail as a decoder-only causal LM: `ARTICLE <eos> SUMMARY <eos>`, loss on the
summary only; inference fills the cache with `ARTICLE <eos>` and generates the summary.

  python -m transformer_jax.main --config configs/cnn_dailymail_decoder_only.py \
      --workdir runs/cnn_dailymail_lm --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/cnn_dailymail_lm --mode evaluate

Prepare the data once on a machine with internet:
  tfds build cnn_dailymail --data_dir=gs://BUCKET/tensorflow_datasets
Data and schedule as configs/cnn_dailymail.py; a 12-layer pre-LN decoder (d 512), greedy.
Not yet measured by this project (no accelerator was available).
"""

from transformer_jax import default_config


def get_config():
  config = default_config.sibling(__file__, "cnn_dailymail")
  config.architecture = "decoder_only"
  config.decoding.update(method="greedy")
  config.model.update(num_layers=12, max_len=640)
  return config
