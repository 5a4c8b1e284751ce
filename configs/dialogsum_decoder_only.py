"""DialogSum as a decoder-only causal LM: `DIALOGUE <eos> SUMMARY <eos>`, loss on the summary.

  python -m transformer_jax.main --config configs/dialogsum_decoder_only.py \
      --workdir runs/dialogsum_lm --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --workdir runs/dialogsum_lm --mode evaluate

Inference fills the KV cache with `DIALOGUE <eos>` and generates the summary (greedy here).
Data and tokenizer as configs/dialogsum.py, 800 steps; one 4-layer pre-LN decoder (d 256) reads
dialogue and summary as one 320-token sequence. Not yet run to completion on the corpus.
`:hub` reads knkarthick/dialogsum from the Hugging Face Hub instead, as configs/dialogsum.py:hub.
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' or 'hub' (the Hugging Face Hub's copy), as configs/dialogsum.py."""
  config = default_config.sibling(__file__, "dialogsum", data)
  config.architecture = "decoder_only"
  # A shorter schedule than the encoder-decoder's, to fit the 2-core CPU of the README.
  config.update(num_train_steps=800, warmup_steps=200, eval_every_steps=800)
  config.decoding.update(method="greedy")
  config.model.update(num_layers=4, max_len=320)
  return config
