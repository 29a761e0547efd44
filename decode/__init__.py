"""Decoding: beam search and sampling over a tokens-to-logits callback, translation of raw text, BLEU,
and translation of a corpus in resumable parts shared by workers (job.py, bulk.py, progress.py, slurm.py).

DEFAULTS are the paper's decoding settings (Section 6.1: beam 4, length penalty 0.6, at most source
length + 50 tokens) plus our batch size; `translate`, `python -m decode` and experiments/default.py all
take them from here.
"""
DEFAULTS = dict(beam_size=4, alpha=0.6, max_extra_len=50, batch_tokens=4096)
