"""`python -m train.submit` moved to `python -m jobs.submit` (jobs/submit.py, same flags); this name only says so."""
import sys

print("error: `python -m train.submit` is now `python -m jobs.submit` (same flags)", file=sys.stderr)
sys.exit(2)
