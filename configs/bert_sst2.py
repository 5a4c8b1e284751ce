"""BERT-base or RoBERTa-base fine-tuned on SST-2 (GLUE TSV files), accuracy and macro-F1.

  python -m transformer_jax.main --config configs/bert_sst2.py:bert --workdir runs/bert_sst2 \
      --config.data_dir=../shared/data/sst2
  python -m transformer_jax.main --workdir runs/bert_sst2 --mode evaluate   # labelled test split
  python -m transformer_jax.main --workdir runs/bert_sst2 --mode export --output hf_out

Variants: `:bert` (google-bert/bert-base-uncased, 110M parameters: its pooler kept, a fresh
2-class head) or `:roberta` (FacebookAI/roberta-base, 125M: a fresh RoBERTa head); add `hub`
(`:bert,hub`, `:roberta,hub`, or `:hub` for BERT) to read the Hugging Face Hub's
stanfordnlp/sst2 with the splits of configs/sst2.py:hub (validation: the last 872 training
phrases; test: GLUE's dev split, as GLUE hides its test labels):
  python -m transformer_jax.main --config configs/bert_sst2.py:roberta,hub \
      --workdir runs/roberta_sst2_hub
The checkpoint fixes the model and tokenizer; `--config.pretrained=FOLDER` reads a downloaded
copy. 3 epochs of 32 sentences a step, peak learning rate 2e-5 after a 6% warmup with
layer-wise decay 0.9 (the head at the full rate), weight decay 0.01, dropout 0.1.
Expected (literature, not yet measured here): about 92-93% dev accuracy (BERT-base) and 94-95%
(RoBERTa-base); with `hub` these are the test accuracies, GLUE's dev split being the test split
there. A GPU is advised: on the 2-core CPU a BERT-base step of 32 x 64 tokens takes seconds
(benchmarks/RESULTS.md).
"""

from transformer_jax import default_config

CHECKPOINTS = {"bert": "google-bert/bert-base-uncased", "roberta": "FacebookAI/roberta-base"}


def get_config(model: str = "bert"):
  """`model`: a key of CHECKPOINTS and/or 'hub', comma-separated (e.g. 'roberta,hub')."""
  model, data = default_config.options(model, model=tuple(CHECKPOINTS), data=("local", "hub"))
  config = default_config.sibling(__file__, "sst2", data)
  config.pretrained = CHECKPOINTS[model]
  config.num_train_steps = 6_300  # 3 epochs of 67,349 phrases
  config.per_device_batch_size = 32
  config.learning_rate = 2e-5
  config.warmup_steps = 380
  config.layer_decay = 0.9
  config.weight_decay = 0.01
  config.eval_every_steps = 1_000
  config.checkpoint_every_steps = 1_000
  config.checkpoint_best_metric = "accuracy"
  return config
