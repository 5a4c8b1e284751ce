"""mBART-50 many-to-many fine-tuned English <-> Vietnamese in one run, as
configs/nllb_iwslt15_en_vi.py (its commands with this file), the codes en_XX and vi_VN.

  python -m transformer_jax.main --config configs/mbart50_iwslt15_en_vi.py:hub \
      --workdir runs/mbart50_en_vi
  python -m transformer_jax.main --workdir runs/mbart50_en_vi --mode evaluate --split test \
      --config configs/mbart50_iwslt15_en_vi.py --config.data_dir=../shared/data/iwslt15_en_vi

facebook/mbart-large-50-many-to-many-mmt (611M parameters): `[code] X </s>` on both sides,
decoding from </s> with the target code forced first. Literature (not measured here): see the
NLLB recipe; mBART-50 was trained with Vietnamese among its 50 languages (Tang et al., 2020).
"""

from transformer_jax import default_config


def get_config(data: str = "local"):
  """`data`: 'local' (the shared tst2012 / tst2013 files) or 'hub' (train on the Hub)."""
  (data,) = default_config.options(data, data=("local", "hub"))
  nllb = default_config.sibling(__file__, "nllb_iwslt15_en_vi", data)
  nllb.pretrained = "facebook/mbart-large-50-many-to-many-mmt"
  nllb.language_codes = "en=en_XX,vi=vi_VN"
  return nllb
