"""XLM-RoBERTa-base fine-tuned on UIT-VSFC (Vietnamese student feedback: negative / neutral /
positive), accuracy and macro-F1 on dev and test.

  python -m transformer_jax.main --config configs/xlmr_uit_vsfc.py --workdir runs/xlmr_vsfc \
      --config.data_dir=../shared/data/uit_vsfc
  python -m transformer_jax.main --workdir runs/xlmr_vsfc --mode evaluate

FacebookAI/xlm-roberta-base (278M parameters, a 250k-piece SentencePiece vocabulary that
covers Vietnamese) with a fresh 3-class head. `:phobert` uses vinai/phobert-base instead,
a RoBERTa whose BPE expects word-segmented text (VnCoreNLP's `học_sinh`): segment the corpus
first, or expect lower scores. Add `hub` (`:hub`, `:phobert,hub`) to read the Hugging Face
Hub's uitnlp/vietnamese_students_feedback, as configs/uit_vsfc.py:hub does (the same splits):
  python -m transformer_jax.main --config configs/xlmr_uit_vsfc.py:hub --workdir runs/xlmr_hub
4 epochs of 32 sentences a step, peak learning rate 2e-5, layer-wise decay 0.9.
Expected (literature, not yet measured here): about 93% accuracy on the sentiment test set.
A GPU is advised.
"""

from transformer_jax import default_config

CHECKPOINTS = {"xlmr": "FacebookAI/xlm-roberta-base", "phobert": "vinai/phobert-base"}


def get_config(model: str = "xlmr"):
  """`model`: a key of CHECKPOINTS and/or 'hub', comma-separated (e.g. 'phobert,hub')."""
  model, data = default_config.options(model, model=tuple(CHECKPOINTS), data=("local", "hub"))
  config = default_config.sibling(__file__, "uit_vsfc", data)
  config.pretrained = CHECKPOINTS[model]
  config.num_train_steps = 1_450  # 4 epochs of 11,426 sentences
  config.per_device_batch_size = 32
  config.learning_rate = 2e-5
  config.warmup_steps = 90
  config.layer_decay = 0.9
  config.weight_decay = 0.01
  config.eval_every_steps = 350
  config.checkpoint_every_steps = 350
  config.checkpoint_best_metric = "accuracy"
  return config
