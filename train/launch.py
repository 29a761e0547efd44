"""`python -m train.launch` moved to `python -m jobs.launch` (jobs/launch.py, same flags); this name only says so."""
import sys

print("error: `python -m train.launch` is now `python -m jobs.launch` (same flags)", file=sys.stderr)
sys.exit(2)
