"""WMT'14 English -> German, the paper's benchmark: Transformer-base, BLEU on newstest2014.

  python -m transformer_jax.main --config configs/wmt14_en_de.py --workdir runs/wmt14_en_de \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/wmt14_en_de --mode evaluate --average_last 5

Prepare the data once on a machine with internet:
  tfds build wmt14_translate/de-en --data_dir=gs://BUCKET/tensorflow_datasets
Or read the same corpus from the Hugging Face Hub (wmt/wmt14, subset de-en: the same train
split, newstest2013 as validation and newstest2014 as test), cached by the datasets library on
the first run:
  python -m transformer_jax.main --config configs/wmt14_en_de.py:hub --workdir runs/wmt14_hub
Transformer-base (63M parameters with a 32k vocabulary), packed rows of 256 tokens, global
batch 256 rows (about 50k tokens) on 8 devices, 100k steps; decoding beam 4, alpha 0.6.
Expected: the paper's base reaches 27.3 BLEU en->de on newstest2014 after 100k steps on 8 P100
GPUs (12 hours); a TPU v4-8 or 8 x H100 should take a few hours. Not yet measured by this
project (no accelerator was available): the README's results table says what was.
"""

from transformer_jax import default_config


def get_config(data: str = "tfds"):
  """`data`: 'tfds' (TFDS wmt14_translate) or 'hub' (the Hugging Face Hub's wmt/wmt14)."""
  (data,) = default_config.options(data, data=("tfds", "hub"))
  config = default_config.get_config()
  config.task = "translation"
  config.dataset = "tfds"
  config.tfds.update(name="wmt14_translate/de-en", source_key="en", target_key="de")
  # newstest2013 (validation) and newstest2014 (test) in wmt14_translate/de-en.
  config.splits.update(train="train", validation="validation", test="test")
  if data == "hub":  # the same splits under the same names; the pair is one 'translation' dict
    config.dataset = "huggingface"
    config.huggingface.update(name="wmt/wmt14", subset="de-en")
    config.huggingface.columns.update(source="translation.en", target="translation.de")
  config.tokenizer.update(model_type="unigram", num_sentences=10_000_000)
  config.model.vocab_size = 32_000
  config.max_source_length = 256
  config.max_target_length = 256
  config.overlong = "drop"
  config.pack_examples = True
  config.num_train_steps = 100_000
  config.per_device_batch_size = 32
  config.learning_rate = 1e-3
  config.warmup_steps = 4_000
  config.log_every_steps = 100
  config.eval_every_steps = 5_000
  config.checkpoint_every_steps = 5_000
  config.keep_checkpoints = 5
  config.num_generate_examples = -1
  config.decoding.update(method="beam", beam_size=4, alpha=0.6)
  config.model.update(emb_dim=512, num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048,
                      max_len=256, dropout_rate=0.1, share_embeddings=True, dtype="bfloat16",
                      attention_implementation="auto")
  return config
