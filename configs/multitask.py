"""Text-to-text multitask (T5 style): one encoder-decoder for Multi30k en->de translation,
DialogSum summarization and SST-2 sentiment, each selected by a text prefix and evaluated by
its own metric (translate_bleu, summarize_rouge1/2/L, sentiment_accuracy).

  python -m transformer_jax.main --config configs/multitask.py --workdir runs/multitask \
      --config.data_dir=../shared/data
  python -m transformer_jax.main --workdir runs/multitask --mode evaluate

`data_dir` is the folder holding multi30k/, dialogsum/ and sst2/. Sentiment targets are the
words 'negative' / 'positive'. Training mixes the parts in proportion to their sizes, SST-2
capped at 20k examples; evaluation takes 200 examples of each part. Time and metrics measured
on the README's 2-core CPU are in its results table.
"""

import ml_collections

from transformer_jax import default_config


def get_config():
  config = default_config.get_config()
  config.task = "multitask"
  config.architecture = "encoder_decoder"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data
  config.mixture = ml_collections.ConfigDict(dict(
      translate=dict(prefix="translate English to German: ", task="translation",
                     data_dir="multi30k",
                     local=dict(format="parallel", source_lang="en", target_lang="de"),
                     splits=dict(train="train", validation="val", test="test_2016_flickr"),
                     max_train_examples=-1, max_eval_examples=200),
      summarize=dict(prefix="summarize: ", task="summarization", data_dir="dialogsum",
                     local=dict(format="jsonl", source_field="dialogue",
                                target_field="summary|summary1"),
                     splits=dict(train="train", validation="dev", test="test"),
                     max_train_examples=-1, max_eval_examples=200),
      sentiment=dict(prefix="sentiment: ", task="classification", data_dir="sst2",
                     local=dict(format="tsv", text_column="sentence|content",
                                label_column="label"),
                     splits=dict(train="train", validation="dev", test="test"),
                     label_names=["negative", "positive"],
                     max_train_examples=20_000, max_eval_examples=200),
  ))
  config.model.vocab_size = 16_000
  config.max_source_length = 256
  config.max_target_length = 64
  config.pack_examples = True
  config.num_train_steps = 4_000
  config.per_device_batch_size = 16
  config.learning_rate = 1e-3
  config.warmup_steps = 500
  config.log_every_steps = 50
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 500
  config.num_generate_examples = -1  # every part's capped evaluation examples
  config.decoding.update(method="greedy", max_decode_len=64)
  config.model.update(emb_dim=256, num_heads=4, num_layers=3, qkv_dim=256, mlp_dim=1024,
                      max_len=256, dropout_rate=0.1, pre_ln=True, share_embeddings=True)
  return config
