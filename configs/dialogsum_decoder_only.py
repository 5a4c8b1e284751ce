"""DialogSum with one decoder: `DIALOGUE <eos> SUMMARY <eos>` as a prefix LM, loss on the summary.

  python -m transformer_jax.main --config configs/dialogsum_decoder_only.py \
      --workdir runs/dialogsum_lm --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --workdir runs/dialogsum_lm --mode evaluate

The training budget of configs/dialogsum.py: data, tokenizer, 2,000 steps of about 16 dialogues
(14 packed rows of 320 tokens), the same learning rate and decoding (beam 4, GNMT length
penalty 0.6). One 4-layer pre-LN decoder (d 256, rotary positions) reads the dialogue both ways
(a prefix LM, as the encoder-decoder's encoder does) and the summary causally; inference fills
the KV cache with `DIALOGUE <eos>` the same way and generates the summary. The logits are
computed at the summary's positions only. Expected result: see benchmarks/RESULTS.md
("Architectures"), measured with the two commands above.
`:hub` reads knkarthick/dialogsum from the Hugging Face Hub instead, as configs/dialogsum.py:hub.
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' or 'hub' (the Hugging Face Hub's copy), as configs/dialogsum.py."""
  config = default_config.sibling(__file__, "dialogsum", data)
  config.architecture = "decoder_only"
  # A packed row holds 1.15 dialogues on average (209 tokens each): 14 rows see as many
  # as dialogsum.py's 16.
  config.pack_examples = True
  config.per_device_batch_size = 14
  config.model.update(num_layers=4, max_len=320, prefix_lm=True, position_embedding="rope")
  return config
