"""CNN / DailyMail news summarization (TFDS cnn_dailymail), encoder-decoder, ROUGE on test.

  python -m transformer_jax.main --config configs/cnn_dailymail.py --workdir runs/cnn_dailymail \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/cnn_dailymail --mode evaluate

Prepare the data once on a machine with internet:
  tfds build cnn_dailymail --data_dir=gs://BUCKET/tensorflow_datasets
Or read it from the Hugging Face Hub (abisee/cnn_dailymail 3.0.0: the same non-anonymized
287k / 13k / 11k article -> highlights splits), cached by the datasets library on the first run:
  python -m transformer_jax.main --config configs/cnn_dailymail.py:hub --workdir runs/cnn_dm_hub
287k articles cut to 512 tokens, highlights up to 128; Transformer-base, beam 4. Expected
about 36-38 ROUGE-1 for a Transformer trained from scratch (literature; a TPU v4-8 or one
H100 needs several hours). Not yet measured by this project (no accelerator was available).
"""

from transformer_jax import default_config


def get_config(data: str = "tfds"):
  """`data`: 'tfds' (TFDS cnn_dailymail) or 'hub' (the Hugging Face Hub's abisee/cnn_dailymail)."""
  (data,) = default_config.options(data, data=("tfds", "hub"))
  config = default_config.get_config()
  config.task = "summarization"
  config.architecture = "encoder_decoder"
  config.dataset = "tfds"
  config.tfds.update(name="cnn_dailymail", source_key="article", target_key="highlights")
  config.splits.update(train="train", validation="validation", test="test")
  if data == "hub":  # the same fields and split names
    config.dataset = "huggingface"
    config.huggingface.update(name="abisee/cnn_dailymail", subset="3.0.0")
    config.huggingface.columns.update(source="article", target="highlights")
  config.tokenizer.update(model_type="unigram", num_sentences=2_000_000)
  config.model.vocab_size = 32_000
  config.max_source_length = 512
  config.max_target_length = 128
  config.num_train_steps = 100_000
  config.per_device_batch_size = 16
  config.learning_rate = 1e-3
  config.warmup_steps = 4_000
  config.eval_every_steps = 5_000
  config.checkpoint_every_steps = 5_000
  config.num_generate_examples = 1_000
  config.decoding.update(method="beam", beam_size=4, alpha=0.6, max_decode_len=128)
  config.model.update(emb_dim=512, num_heads=8, num_layers=6, qkv_dim=512, mlp_dim=2048,
                      max_len=512, dropout_rate=0.1, pre_ln=True, share_embeddings=True,
                      dtype="bfloat16", attention_implementation="auto")
  return config
