"""`python -m train.submit`: one training run as a SLURM job (see train/slurm.py).

    python -m train.submit --partition debug --nodes 1 --tasks_per_node 2 --time 30 --wait \\
        -- --config experiments/default.py:smoke --workdir runs/smoke_slurm
"""
import sys

from train.slurm import main

if __name__ == "__main__":
  sys.exit(main())
