"""Corpus-scale translation: a file of any size, in shards, each written whole as one part; resumable,
shared by any number of workers, joined in input order (the job directory: decode/job.py).

    job = job_lib.open_job(output, manifest(opened, settings, job_lib.scan_input(path, shard_lines)))
    work(job, opened, settings)     # claims and translates parts until none is left, then joins

Each shard goes through `translate` as the in-memory path's whole input does (sorted into the same
length buckets, batches shared by this process's devices), with the shard's first line number as
`first_index`, so that sampling draws line i with the seed and i folded in wherever the line falls.
Output lines are byte for byte what the in-memory path writes (tests/test_bulk_decode.py).
"""
from __future__ import annotations

import time

from decode import job as job_lib
from decode.translate import bucket_length, pow2_floor, translate

POLL_SECONDS = 1.0   # how often a worker with nothing to claim looks again (a holder may die)
MIN_SHARD_LINES = 10_000
BATCHES_PER_SHARD = 64


def default_shard_lines(batch_tokens: int, beam_size: int) -> int:
  """Lines per part when --shard_lines is not given: at least BATCHES_PER_SHARD batches of the shortest
  bucket. Each part ends every length bucket with a batch that is only partly full; in a shard of 64
  batches or more these cost about 2% (docs/bulk_decoding.md)."""
  rows = pow2_floor(batch_tokens // (bucket_length(1) * beam_size))
  return max(MIN_SHARD_LINES, BATCHES_PER_SHARD * rows)


def shard_lines_for(lines: int, workers: int, most: int) -> int:
  """Lines per part for an input of `lines` lines shared by `workers` workers, when --shard_lines is not
  given. `most` (default_shard_lines) is the part size at which partial batches cost little; an input
  that gives fewer parts than workers at that size is cut finer, down to one line a part, so that every
  worker gets parts wherever the input has enough lines: idle devices cost more than partial batches.
  The part count is rounded up to a multiple of the workers, so that the last round keeps all of them
  busy. E.g. 16 workers, beam 4 on GPUs (most 131,072): 100,000 lines -> 16 parts of 6,250; 2.1M lines
  -> 32 parts of 65,625."""
  if lines < 1:
    return most
  rounds = -(-(-(-lines // most)) // workers)             # ceil(ceil(lines / most) / workers)
  parts = min(lines, rounds * workers)
  shard_lines = -(-lines // parts)                          # <= most, since parts >= lines / most
  if -(-lines // shard_lines) < min(parts, workers):        # e.g. 9 lines, 4 workers: 3 parts of 3
    shard_lines = lines // parts                            # 5 parts of 2
  return shard_lines


def parts_line(lines: int, shard_lines: int, workers: int, given: bool) -> str:
  """The log line that states a job's part size and count, and what each worker gets."""
  parts = -(-lines // shard_lines) if lines else 0
  why = "--shard_lines" if given else "sized for the input and the workers"
  line = (f"[decode] {lines} lines in {parts} part{'s' if parts != 1 else ''} of {shard_lines} lines "
          f"({why}) for {workers} worker{'s' if workers != 1 else ''}")
  if parts < workers:
    line += f": {workers - parts} worker{'s' if workers - parts != 1 else ''} will have no part to decode"
  return line


def manifest(opened, settings: dict, scanned: dict, workdir, checkpoint) -> dict:
  """What a job's output depends on: the input (decode/job.py's scan_input), the run and its
  checkpoint, and every decoding setting (settings: translate's keyword arguments)."""
  return dict(
      input=scanned,
      run=dict(workdir=str(workdir.resolve()), checkpoint="averaged" if checkpoint == "averaged" else
               "training", step=int(opened.step), vocab_fingerprint=opened.vocab.fingerprint),
      settings=dict(sorted(settings.items())))


def format_lines(out, first_index: int, nbest: int) -> str:
  """translate's result for input lines first_index, ... -> the output file's text for them: one line
  each, or with nbest K, K lines `LINE<TAB>RANK<TAB>SCORE<TAB>TRANSLATION` (LINE counts from 1)."""
  if nbest == 1:
    return "".join(h + "\n" for h in out)
  return "".join(f"{first_index + i}\t{rank}\t{score:.4f}\t{hyp}\n" for i, hyp_list in enumerate(out, 1)
                 for rank, (hyp, score) in enumerate(hyp_list, 1))


def translate_part(job: job_lib.Job, part: int, opened, settings: dict) -> dict:
  """Translates one part and writes it (whole); returns its statistics."""
  first, _ = job.part_range(part)
  sources = job.read_part_input(part)
  start = time.perf_counter()
  # With several parts, one program per bucket: see translate's full_batches.
  out, lengths = translate(opened.model, opened.params, opened.vocab, sources, first_index=first,
                           return_lengths=True, full_batches=job.num_parts > 1, **settings)
  seconds = time.perf_counter() - start
  stats = dict(part=part, lines=len(sources), tgt_tokens=sum(lengths), seconds=round(seconds, 3))
  job.write_part(part, format_lines(out, first, settings["nbest"]), stats)
  return stats


def work(job: job_lib.Job, opened, settings: dict, *, stale_after: float, on_part=None) -> list[dict]:
  """Claims parts and translates them until every part is done, then joins them (if no other worker
  has). While other live workers hold the last parts, waits, and takes a part over when its holder is
  gone. on_part(stats) is called after each part this worker writes. Returns those parts' stats."""
  mine = []
  while not job.joined():   # a finished job's parts are gone: nothing to claim
    claim = job.claim(stale_after)
    if claim is None:
      if not job.parts_left():
        job.join()
        break
      time.sleep(POLL_SECONDS)
      continue
    try:
      stats = translate_part(job, claim.part, opened, settings)
    finally:
      claim.release()
    mine.append(stats)
    if on_part is not None:
      on_part(stats)
  return mine
