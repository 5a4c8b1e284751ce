"""The CPU's float32 matrix-product ceiling: XLA:CPU (what our steps run) against PyTorch's
GEMM (MKL / oneDNN, what transformers runs), on the shapes of a decoding or training step.

  python benchmarks/gemm_ceiling.py [--rows 1,8,32,256,2048] [--inner 768] [--outer 3072] \
      [--threads 2]

[rows, inner] x [inner, outer] products, each side timed over 30 calls after a warm-up, in
one process (torch with --threads threads; XLA with its own pool, the machine's cores).
Prints GFLOP/s per side and shape. A benchmark, not a test.
"""

import argparse
import time


def _seconds(call, repeats: int = 30) -> float:
  call()
  start = time.perf_counter()
  for _ in range(repeats):
    call()
  return (time.perf_counter() - start) / repeats


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", default="1,8,32,256,2048")
  parser.add_argument("--inner", type=int, default=768)
  parser.add_argument("--outer", type=int, default=3072)
  parser.add_argument("--threads", type=int, default=2)
  args = parser.parse_args()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(args.threads)
  matmul = jax.jit(lambda a, b: a @ b)
  rng = np.random.default_rng(0)
  print(f"{'rows':>6s} {'inner':>6s} {'outer':>6s} {'torch GFLOP/s':>14s} {'XLA GFLOP/s':>12s}"
        f" {'XLA / torch':>12s}")
  for rows in map(int, args.rows.split(",")):
    a = rng.random((rows, args.inner), np.float32)
    b = rng.random((args.inner, args.outer), np.float32)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    ja, jb = jax.device_put(a), jax.device_put(b)
    flop = 2 * rows * args.inner * args.outer
    torch_s = _seconds(lambda: ta @ tb)  # pylint: disable=cell-var-from-loop
    xla_s = _seconds(lambda: matmul(ja, jb).block_until_ready())  # pylint: disable=cell-var-from-loop
    print(f"{rows:6d} {args.inner:6d} {args.outer:6d} {flop / torch_s / 1e9:14.1f} "
          f"{flop / xla_s / 1e9:12.1f} {torch_s / xla_s:11.2f}x")


if __name__ == "__main__":
  main()
