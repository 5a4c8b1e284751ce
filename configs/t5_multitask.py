"""t5-small fine-tuned on the text-to-text mixture of configs/multitask.py: Multi30k en->de
("translate English to German: "), DialogSum ("summarize: ") and SST-2 ("sentiment: "), the
prefixes T5 was pretrained with (the first two verbatim).

  python -m transformer_jax.main --config configs/t5_multitask.py \
      --workdir runs/t5_multitask --config.data_dir=../shared/data
  python -m transformer_jax.main --workdir runs/t5_multitask --mode evaluate

Expected (literature, not yet measured here): t5-small reaches ~27 BLEU on WMT14 en-de and
~41 ROUGE-1 on CNN/DM after full fine-tuning; on this mixture expect Multi30k BLEU in the
mid 30s, DialogSum ROUGE-L in the low 30s and SST-2 accuracy near 90% (GPU advised).
"""

from transformer_jax import default_config


def get_config():
  config = default_config.sibling(__file__, "multitask")
  config.pretrained = "google-t5/t5-small"
  config.max_source_length = 512
  config.max_target_length = 96
  config.num_train_steps = 4_000
  config.learning_rate = 3e-4
  config.warmup_steps = 100
  config.label_smoothing = 0.0
  return config
