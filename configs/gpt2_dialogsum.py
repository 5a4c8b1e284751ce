"""GPT-2 fine-tuned on DialogSum as the decoder-only family: `<|endoftext|> DIALOGUE
<|endoftext|> SUMMARY <|endoftext|>`, loss on the summary, ROUGE on the test split.

  python -m transformer_jax.main --config configs/gpt2_dialogsum.py --workdir runs/gpt2_dsum \
      --config.data_dir=../shared/data/dialogsum
  python -m transformer_jax.main --workdir runs/gpt2_dsum --mode evaluate
  python -m transformer_jax.main --workdir runs/gpt2_dsum --mode export --output hf_out

openai-community/gpt2 (124M parameters, 1,024 positions, byte-level BPE; the import adds a pad
id that the model never predicts). Dialogues up to 512 tokens and summaries up to 96, 3 epochs
of 16 dialogues a step at a peak learning rate of 1e-4, beam 4. `--config.pretrained=
openai-community/gpt2-medium` (355M) is the larger variant.
Expected: not yet measured here, and no published GPT-2 DialogSum figure is quoted; compare
with configs/flan_t5_dialogsum.py on the same split. A GPU is advised.
`:hub` reads the Hugging Face Hub's knkarthick/dialogsum instead of the folder, as
configs/dialogsum.py:hub does (its test split scores every one of the three references):
  python -m transformer_jax.main --config configs/gpt2_dialogsum.py:hub --workdir runs/gpt2_hub
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (config.data_dir) or 'hub' (the Hugging Face Hub's knkarthick/dialogsum)."""
  config = default_config.sibling(__file__, "dialogsum", data)
  config.architecture = "decoder_only"
  config.pretrained = "openai-community/gpt2"
  config.max_source_length = 512
  config.max_target_length = 96
  # The checkpoint fixes the model (its 1,024 positions too); this file alone must still
  # hold the 608-token sequences to validate.
  config.model.max_len = 1024
  config.num_train_steps = 2_400
  config.per_device_batch_size = 16
  config.learning_rate = 1e-4
  config.warmup_steps = 100
  config.label_smoothing = 0.0
  config.eval_every_steps = 800
  config.checkpoint_every_steps = 400
  config.checkpoint_best_metric = "rougeL"
  config.decoding.update(method="beam", beam_size=4, alpha=0.6, max_decode_len=96)
  return config
