"""DialogSum: dialogue -> summary with an encoder-decoder, ROUGE on the test split.

  python -m transformer_jax.main --config configs/dialogsum.py --workdir runs/dialogsum \
      --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --workdir runs/dialogsum --mode evaluate

12,460 training dialogues (cut to 256 tokens), summaries of up to 64 tokens, a joint
8,000-piece BPE, a 3+3-layer pre-LN Transformer (d 256), 2,000 steps of 16 dialogues.
Decoding: beam 4. On the README's 2-core CPU about 50 minutes of the whole machine;
validation ROUGE-L 24.4 (first 100 dialogues); the test ROUGE is in the README's results table.

`:hub` reads the Hugging Face Hub's copy, knkarthick/dialogsum (cached by the datasets library
on the first run), instead of the folder:
  python -m transformer_jax.main --config configs/dialogsum.py:hub --workdir runs/dialogsum_hub
Its train and validation splits are the corpus's train and dev (12,460 / 500 dialogues), so
expect the validation ROUGE-L above. Its test split has 1,500 rows, the 500 test dialogues once
per human summary: its test ROUGE averages over the three references, so it is not the README's
figure, which scores the first one (not yet measured on the Hub copy).
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's knkarthick/dialogsum)."""
  (data,) = default_config.options(data, data=("local", "hub"))
  config = default_config.get_config()
  config.task = "summarization"
  config.architecture = "encoder_decoder"
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/dialogsum
  # The test split has three human summaries (summary1..3); the first is the reference.
  config.local.update(format="jsonl", source_field="dialogue", target_field="summary|summary1")
  config.splits.update(train="train", validation="dev", test="test")
  if data == "hub":
    config.dataset = "huggingface"
    config.huggingface.name = "knkarthick/dialogsum"
    config.huggingface.columns.update(source="dialogue", target="summary")
    config.splits.update(train="train", validation="validation", test="test")
  config.model.vocab_size = 8000
  config.max_source_length = 256
  config.max_target_length = 64
  config.num_train_steps = 2_000
  config.per_device_batch_size = 16
  config.learning_rate = 1e-3
  config.warmup_steps = 300
  config.log_every_steps = 50
  config.eval_every_steps = 2_000
  config.checkpoint_every_steps = 400
  config.num_generate_examples = 100
  config.decoding.update(method="beam", beam_size=4, alpha=0.6, max_decode_len=64)
  config.model.update(emb_dim=256, num_heads=4, num_layers=3, qkv_dim=256, mlp_dim=1024,
                      max_len=256, dropout_rate=0.1, pre_ln=True, share_embeddings=True)
  return config
