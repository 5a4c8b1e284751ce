"""CNN / DailyMail with one decoder: `ARTICLE <eos> SUMMARY <eos>` as a prefix LM (the article
read both ways, the summary causally), loss on the summary only; inference fills the cache with
`ARTICLE <eos>` the same way and generates the summary.

  python -m transformer_jax.main --config configs/cnn_dailymail_decoder_only.py \
      --workdir runs/cnn_dailymail_lm --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/cnn_dailymail_lm --mode evaluate

Prepare the data once on a machine with internet:
  tfds build cnn_dailymail --data_dir=gs://BUCKET/tensorflow_datasets
Data and schedule as configs/cnn_dailymail.py; a 12-layer pre-LN decoder (d 512, rotary
positions) on packed rows of 640 tokens, greedy: the recipe measured best on DialogSum
(configs/dialogsum_decoder_only.py, where beam search cut many summaries short).
Not yet measured by this project (no accelerator was available).
`:hub` reads abisee/cnn_dailymail (3.0.0) from the Hugging Face Hub instead of TFDS, as
configs/cnn_dailymail.py:hub.
"""

from transformer_jax import default_config


def get_config(data: str = "tfds"):
  """`data`: 'tfds' or 'hub' (the Hugging Face Hub's copy), as configs/cnn_dailymail.py."""
  config = default_config.sibling(__file__, "cnn_dailymail", data)
  config.architecture = "decoder_only"
  config.pack_examples = True
  config.model.update(num_layers=12, max_len=640, prefix_lm=True, position_embedding="rope")
  config.decoding.update(method="greedy")
  return config
