"""SST-2 from TFDS (glue/sst2), accuracy and macro-F1 on the validation split (GLUE's test
labels are hidden, so `--mode evaluate` also uses validation here).

  python -m transformer_jax.main --config configs/glue_sst2.py --workdir runs/glue_sst2 \
      --config.tfds_data_dir=gs://BUCKET/tensorflow_datasets

Prepare the data once on a machine with internet:
  tfds build glue/sst2 --data_dir=gs://BUCKET/tensorflow_datasets
The model and schedule of configs/sst2.py (which reads the GLUE TSV files from a folder); that
config's measured accuracy is in the README. The Hugging Face Hub's copy of GLUE SST-2 is read
by `configs/sst2.py:hub` (which validates on a held-out tail of train instead).
"""

from transformer_jax import default_config


def get_config():
  config = default_config.sibling(__file__, "sst2")
  config.dataset = "tfds"
  config.tfds.update(name="glue/sst2", source_key="sentence", label_key="label")
  config.splits.update(train="train", validation="validation", test="validation")
  return config
