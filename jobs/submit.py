"""`python -m jobs.submit`: one training run as a SLURM job (see jobs/slurm.py).

    python -m jobs.submit --partition debug --nodes 1 --tasks_per_node 2 --time 30 --wait \\
        -- --config experiments/default.py:smoke --workdir runs/smoke_slurm
"""
import sys

from jobs.slurm import main

if __name__ == "__main__":
  sys.exit(main())
