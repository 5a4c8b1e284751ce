"""Flan-T5 fine-tuned on DialogSum (dialogue -> summary), ROUGE on the test split.

  python -m transformer_jax.main --config configs/flan_t5_dialogsum.py:small \
      --workdir runs/flan_t5_dialogsum --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --workdir runs/flan_t5_dialogsum --mode evaluate
  python -m transformer_jax.main --workdir runs/flan_t5_dialogsum --mode export --output hf_out

Variants: `:small` (google/flan-t5-small, 77M parameters) or `:base` (flan-t5-base, 248M);
add `hub` (`:small,hub`, `:base,hub`, or `:hub` for small) to read the Hugging Face Hub's
knkarthick/dialogsum instead of the folder, as configs/dialogsum.py:hub does:
  python -m transformer_jax.main --config configs/flan_t5_dialogsum.py:small,hub \
      --workdir runs/flan_t5_dialogsum_hub
The checkpoint fixes the model's architecture and its SentencePiece tokenizer (this file sets
only dropout); `--config.pretrained=FOLDER` reads a downloaded copy instead of the hub. 3 epochs-worth
of 16 dialogues a step at a constant-ish low learning rate, beam 4.
Expected (literature, not yet measured here): ROUGE-L about 36 (small) / 40 (base) on the
DialogSum test set; a GPU is advised (on the 2-core CPU a step of `small` takes seconds). The
Hub's test split scores every one of the three references (see configs/dialogsum.py).
"""

from transformer_jax import default_config


def get_config(size: str = "small"):
  """`size`: a Flan-T5 size and/or 'hub', comma-separated (e.g. 'base,hub')."""
  size, data = default_config.options(size, size=("small", "base", "large", "xl", "xxl"),
                                      data=("local", "hub"))
  config = default_config.sibling(__file__, "dialogsum", data)
  config.pretrained = f"google/flan-t5-{size}"
  config.max_source_length = 512
  config.max_target_length = 96
  config.num_train_steps = 2_400
  config.per_device_batch_size = 16
  # Fine-tuning: a small peak with a short warmup (Adam; the rsqrt decay after it).
  config.learning_rate = 3e-4
  config.warmup_steps = 100
  config.label_smoothing = 0.0
  config.eval_every_steps = 800
  config.checkpoint_every_steps = 400
  config.checkpoint_best_metric = "rougeL"
  config.decoding.update(method="beam", beam_size=4, alpha=0.6, max_decode_len=96)
  # config.model's sizes, norms and positions come from the checkpoint; dropout and max_len
  # (T5's relative positions have no table: any length up to what the run reads) are the run's.
  config.model.update(dropout_rate=0.1, max_len=512)
  return config
