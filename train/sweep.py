"""`python -m train.sweep` moved to `python -m jobs.sweep` (jobs/sweep.py, same flags); this name only says so."""
import sys

print("error: `python -m train.sweep` is now `python -m jobs.sweep` (same flags)", file=sys.stderr)
sys.exit(2)
