"""CNN / DailyMail as a decoder-only prefix LM: `ARTICLE <eos> SUMMARY <eos>`, loss on the
summary only; inference fills the cache with `ARTICLE <eos>` and generates the summary.

  python -m transformer_jax.main --config configs/cnn_dailymail_decoder_only.py \
      --workdir runs/cnn_dailymail_lm --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets
  python -m transformer_jax.main --workdir runs/cnn_dailymail_lm --mode evaluate

Prepare the data once on a machine with internet:
  tfds build cnn_dailymail --data_dir=gs://BUCKET/tensorflow_datasets
Articles cut to 512 tokens, highlights up to 128, a 12-layer pre-LN decoder (d 512), greedy.
Not yet measured by this project (no accelerator was available).
"""

from transformer_jax import default_config


def get_config():
  config = default_config.get_config()
  config.task = "summarization"
  config.architecture = "decoder_only"
  config.dataset = "tfds"
  config.tfds.update(name="cnn_dailymail", source_key="article", target_key="highlights")
  config.splits.update(train="train", validation="validation", test="test")
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
  config.decoding.update(method="greedy", max_decode_len=128)
  config.model.update(emb_dim=512, num_heads=8, num_layers=12, qkv_dim=512, mlp_dim=2048,
                      max_len=640, dropout_rate=0.1, pre_ln=True, dtype="bfloat16",
                      attention_implementation="auto")
  return config
