"""What runs many trainings: a multi-process job on one machine (launch), SLURM jobs (slurm, submit), an
experiment's sweep (sweep, sweep_report, sweep_directions) and an Optuna search (search, search_trial,
search_report). Each trial or task is a normal `python -m train` run; this package sits above the
experiments it reads, and nothing below imports it.
"""
