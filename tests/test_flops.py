from transformer_jax import flops
from transformer_jax.model import models


def test_flop_count_matches_a_hand_count():
  # emb 4, qkv 4, ffn 8, vocab 10, 1 encoder + 1 decoder layer, source 3, target 2, batch 2.
  config = models.TransformerConfig(vocab_size=10, emb_dim=4, num_heads=2, num_layers=1,
                                    qkv_dim=4, mlp_dim=8)
  encoder = 3 * (2 * 4 * 16        # q, k, v, out projections: 4 matmuls of 4x4
                 + 2 * 3 * 4 * 2   # scores (3 keys) and weighted values, 4 dims
                 + 2 * 2 * 32)     # ffn: 4x8 and 8x4
  decoder = (2 * (2 * 4 * 16 + 2 * 2 * 4 * 2)  # self-attention over 2 target positions
             + 2 * 2 * 2 * 16                    # cross: query and out projections (targets)
             + 3 * 2 * 2 * 16                    # cross: key and value projections (sources)
             + 2 * 2 * 3 * 4 * 2                 # cross scores and values over 3 sources
             + 2 * 2 * 2 * 32)                   # ffn
  logits = 2 * 2 * 4 * 10
  forward = 2 * (encoder + decoder + logits)
  assert forward == 2 * (912 + 992 + 160)
  assert flops.forward_flops(config, batch_size=2, source_len=3, target_len=2) == forward
  assert flops.train_step_flops(config, 2, 3, 2) == 3 * forward


def test_gated_ffn_counts_three_matrices():
  config = models.TransformerConfig(vocab_size=10, emb_dim=4, num_heads=2, num_layers=1,
                                    qkv_dim=4, mlp_dim=8)
  gated = config.replace(ffn_activation="geglu")
  extra = flops.forward_flops(gated, 1, 3, 2) - flops.forward_flops(config, 1, 3, 2)
  assert extra == (3 + 2) * 2 * 4 * 8  # one more 4x8 matmul per source and target token
