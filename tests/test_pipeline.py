import numpy as np

from transformer_jax.data import demo
from transformer_jax.data import pipeline


def test_prefix_lm_example_literal():
  tokens, weights = pipeline.prefix_lm_example([7, 8, 9], [5, 6], max_len=9)
  np.testing.assert_array_equal(tokens, [7, 8, 9, 1, 5, 6, 1, 0, 0])
  np.testing.assert_array_equal(weights, [0, 0, 0, 0, 1, 1, 1, 0, 0])


def test_prefix_lm_example_cuts_the_source_first():
  tokens, weights = pipeline.prefix_lm_example([7, 8, 9, 10], [5, 6], max_len=6)
  np.testing.assert_array_equal(tokens, [7, 8, 1, 5, 6, 1])
  np.testing.assert_array_equal(weights, [0, 0, 0, 1, 1, 1])


def test_train_batches_are_a_function_of_the_step():
  data = pipeline.EncodedPairs(np.arange(10)[:, None], np.arange(10)[:, None] + 100, 0)
  batches = pipeline.TrainBatches(data, global_batch_size=4, seed=3)
  first_epoch = np.concatenate([batches.batch(s)["inputs"][:, 0] for s in range(2)] +
                               [batches.batch(2)["inputs"][:2, 0]])
  assert sorted(first_epoch) == list(range(10))  # an epoch sees every example once
  resumed = pipeline.TrainBatches(data, global_batch_size=4, seed=3)
  for step in (7, 2, 5):
    np.testing.assert_array_equal(resumed.batch(step)["inputs"], batches.batch(step)["inputs"])
  # Two processes split each global batch between them.
  halves = [pipeline.TrainBatches(data, 4, 3, process_index=i, process_count=2).batch(5)
            for i in range(2)]
  np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]),
                                batches.batch(5)["inputs"])


def test_demo_grammar_agreement_and_word_order():
  assert demo._german_np({"noun": demo.NOUNS[0], "plural": False, "det": ("the", None),
                          "adj": ("old", "alt")}, "acc") == "den alten Hund"
  assert demo._german_np({"noun": demo.NOUNS[4], "plural": False, "det": ("a", "ein"),
                          "adj": ("tired", "müd")}, "dat") == "einer müden Frau"
  assert demo._german_np({"noun": demo.NOUNS[2], "plural": True, "det": ("", None),
                          "adj": ("small", "klein")}, "dat") == "kleinen Kindern"


def test_demo_splits_are_deterministic_and_disjoint():
  a = demo.generate_splits(300, 50, 50, seed=4)
  assert a == demo.generate_splits(300, 50, 50, seed=4)
  sources = [{s for s, _ in a[split]} for split in ("train", "validation", "test")]
  assert sum(map(len, sources)) == len(set.union(*sources)) == 400
