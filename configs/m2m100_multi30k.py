"""M2M100-418M fine-tuned on Multi30k English -> German, sacreBLEU / chrF on test_2016_flickr.

  python -m transformer_jax.main --config configs/m2m100_multi30k.py \
      --workdir runs/m2m100_multi30k --config.data_dir=../shared/data/multi30k
  python -m transformer_jax.main --workdir runs/m2m100_multi30k --mode evaluate --split test
  # The checkpoint before fine-tuning, on the same test set:
  python -m transformer_jax.main --pretrained facebook/m2m100_418M --mode evaluate --split test \
      --config configs/m2m100_multi30k.py --config.data_dir=../shared/data/multi30k

facebook/m2m100_418M: the source tagged `__en__ X </s>`, the target code `__de__` forced as
the first output token (config.source_lang / target_lang in M2M100's own codes, 'en', 'de').
Literature (not measured here): Transformers trained on Multi30k alone reach roughly 35-38
BLEU on test_2016_flickr (this project's own from-scratch run: 33.63, README).
`:hub` reads the pairs from the Hugging Face Hub's bentrevett/multi30k, as
configs/multi30k.py:hub does.
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's bentrevett/multi30k)."""
  config = default_config.sibling(__file__, "multi30k", data)
  config.pretrained = "facebook/m2m100_418M"
  config.source_lang, config.target_lang = "en", "de"
  config.max_source_length = 64
  config.max_target_length = 64
  config.num_train_steps = 1_500
  config.per_device_batch_size = 32
  config.learning_rate = 5e-5
  config.warmup_steps = 100
  config.label_smoothing = 0.1
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 500
  config.checkpoint_best_metric = "bleu"
  config.decoding.update(method="beam", beam_size=4, alpha=1.0, length_penalty="hf",
                         max_decode_len=64)
  return config
