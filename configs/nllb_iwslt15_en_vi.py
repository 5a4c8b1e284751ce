"""NLLB-200-distilled-600M fine-tuned English <-> Vietnamese in one run (both directions),
IWSLT'15 TED talks; sacreBLEU, chrF and chrF++ per direction and their mean.

Training reads IWSLT'15's 133k pairs from the Hugging Face Hub (`:hub`, IWSLT/mt_eng_vietnamese,
subset iwslt2015-en-vi, a `translation` dict column that serves both directions); evaluation
reads the shared tst2012 / tst2013 files (../shared/data/iwslt15_en_vi, `tst2012.en` ...):

  python -m transformer_jax.main --config configs/nllb_iwslt15_en_vi.py:hub \
      --workdir runs/nllb_en_vi
  python -m transformer_jax.main --workdir runs/nllb_en_vi --mode evaluate --split test \
      --config configs/nllb_iwslt15_en_vi.py --config.data_dir=../shared/data/iwslt15_en_vi
  # The checkpoint before fine-tuning, on tst2013 (both directions):
  python -m transformer_jax.main --pretrained facebook/nllb-200-distilled-600M --mode evaluate \
      --split test --config configs/nllb_iwslt15_en_vi.py \
      --config.data_dir=../shared/data/iwslt15_en_vi
  # One direction of the fine-tuned model:
  echo "Tôi yêu bạn." | python -m transformer_jax.main --workdir runs/nllb_en_vi \
      --mode predict --config.source_lang=vie_Latn --config.target_lang=eng_Latn

Each example is tagged `[code] X </s>` with its own languages (eng_Latn, vie_Latn) and every
row of a batch forces its own target code, so batches mix the two directions.
Literature (not measured here): attention-based NMT trained on IWSLT'15 alone reaches 23.3
BLEU on tst2013 en->vi (Luong & Manning, 2015); a fine-tuned massively multilingual model is
expected above it. GPU advised (600M parameters); `:size=1.3b` names the 1.3B distilled model.
"""

from transformer_jax import default_config

CHECKPOINTS = {"600m": "facebook/nllb-200-distilled-600M",
               "1.3b": "facebook/nllb-200-distilled-1.3B"}


def get_config(arg: str = ""):
  """`arg`: 'hub' (train on the Hub's IWSLT'15; default: the shared tst2012 / tst2013 files,
  for evaluation) and the size, '600m' or '1.3b', comma-separated."""
  data, size = default_config.options(arg, data=("local", "hub"), size=("600m", "1.3b"))
  return multilingual_config(data, CHECKPOINTS[size], "en=eng_Latn,vi=vie_Latn")


def multilingual_config(data: str, checkpoint: str, language_codes: str):
  """IWSLT'15 en <-> vi from `checkpoint`, whose codes for 'en' and 'vi' `language_codes`
  gives (the mBART-50 recipe shares it)."""
  config = default_config.get_config()
  config.task = "translation"
  config.pretrained = checkpoint
  # Both directions from one corpus: the files tst2012.en / tst2012.vi, or the Hub's dict.
  config.directions = "en-vi,vi-en"
  config.language_codes = language_codes
  config.dataset = "local"
  config.data_dir = ""  # --config.data_dir=../shared/data/iwslt15_en_vi
  config.local.update(format="parallel", source_lang="en", target_lang="vi")
  config.splits.update(train="train", validation="tst2012", test="tst2013")
  if data == "hub":
    config.dataset = "huggingface"
    config.huggingface.update(name="IWSLT/mt_eng_vietnamese", subset="iwslt2015-en-vi")
    config.huggingface.columns.update(source="translation.en", target="translation.vi")
    config.splits.update(train="train", validation="validation", test="test")
  config.max_source_length = 128
  config.max_target_length = 128
  config.num_train_steps = 6_000
  config.per_device_batch_size = 16
  config.learning_rate = 5e-5
  config.warmup_steps = 500
  config.label_smoothing = 0.1
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 1_000
  config.num_generate_examples = 500
  config.checkpoint_best_metric = "chrf"
  config.decoding.update(method="beam", beam_size=4, alpha=1.0, length_penalty="hf",
                         max_decode_len=128)
  return config
