"""`python -m train.search` moved to `python -m jobs.search` (jobs/search.py, same flags); this name only says so."""
import sys

print("error: `python -m train.search` is now `python -m jobs.search` (same flags)", file=sys.stderr)
sys.exit(2)
