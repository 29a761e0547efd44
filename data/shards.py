"""The token cache made in parts: every process of a job, and every core each may use, tokenizes shards of
the split; data/cache.py then assembles them into the one cache a run reads.

    report = make_parts(data_config, reader, vocab, path, split)   # returns when every shard is on disk

The split is cut into shards by a plan that depends on the corpus alone, never on how many processes
read it (`Parts`, data/sources.py): the lines that start in each SHARD_BYTES of one uncompressed file
(read from a seek), every SHARD_LINES lines of gzipped or two line-aligned files (read forward), every
SHARD_RECORDS records of a TFDS split. While the cache is made, its shards live beside it:

    <root>/train-<key>.parts-<plan>/
        00012.lock              fcntl.flock'ed by whoever tokenizes shard 12 ("host pid since" inside)
        00012.tmp-<host>-<pid>/ shard 12 being written
        00012/                  shard 12, whole: meta.json (pairs, lines, tokens, bad lines, ...), src.ids,
                                tgt.ids, src.lengths, tgt.lengths (int32), numbers (within the shard)
        vocab-<fingerprint>.model   the vocabulary, for worker processes

A process starts one worker process per CPU it may use (`os.sched_getaffinity`, or
$AIAYN_TOKENIZE_WORKERS), each pinned to one of them. A worker takes the first shard that is neither
whole nor locked, tokenizes it into its .tmp directory, renames it whole, and goes on to the next. The
lock is the claim: a process that dies (SIGKILL included) releases it, and the next process to look
takes the shard over, removing the dead one's .tmp directory; a whole shard is never made twice. When
its workers find nothing left to take, the process waits on the file system, not in a collective, for
the shards other processes hold, taking over any whose holder died, and says every WAIT_REPORT_S which
shards it waits for and who holds them.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import fcntl
import numpy as np
import tqdm

from data import vocab as vocab_lib
from data.sources import DataError

log = logging.getLogger(__name__)

SHARD_BYTES = 16 << 20     # one uncompressed file: the lines that start in each 16 MiB (~100,000 WMT pairs)
SHARD_LINES = 100_000      # gzipped or two line-aligned files
SHARD_RECORDS = 100_000    # a TFDS split
CHUNK = 20_000             # pairs tokenized at a time (bounds a worker's memory)
POLL_S = 0.5               # how often a waiting process looks at the shards
WAIT_REPORT_S = 60.0       # how often a wait says what it waits for
WORKERS_ENV = "AIAYN_TOKENIZE_WORKERS"
SIDES = ("src", "tgt")
FILES = ("src.ids", "tgt.ids", "src.lengths", "tgt.lengths", "numbers")


def me() -> str:
  return f"{socket.gethostname()}:{os.getpid()}"


def plan(reader):
  """The reader's split cut into shards (data.sources.Parts), by this module's units."""
  if hasattr(reader, "take"):   # a TFDS split: records by index
    return reader.parts(SHARD_RECORDS)
  return reader.parts(SHARD_BYTES, SHARD_LINES)


def parts_dir(path: pathlib.Path, parts) -> pathlib.Path:
  return path.with_name(f"{path.name}.parts-{parts.name}")


def workers_wanted() -> int:
  """$AIAYN_TOKENIZE_WORKERS, else the CPUs this process may use."""
  value = os.environ.get(WORKERS_ENV, "")
  if value:
    if not value.isdigit() or int(value) < 1:
      raise DataError(f"${WORKERS_ENV}={value!r}: give a number of worker processes (1 or more), or unset it "
                      f"to use one per CPU this process may use")
    return int(value)
  return vocab_lib.threads()


def _name(k: int) -> str:
  return f"{k:05d}"


def whole(folder: pathlib.Path, k: int) -> dict | None:
  """Shard k's meta.json where the shard is whole (renamed into place, files of the recorded sizes)."""
  shard = folder / _name(k)
  try:
    meta = json.loads((shard / "meta.json").read_text())
    if all((shard / name).stat().st_size == size for name, size in meta["bytes"].items()):
      return meta
  except (OSError, ValueError, KeyError, TypeError):
    pass
  return None


class _Claim:
  """An exclusive, non-blocking flock on shard k's lock file; `held` is False where another process
  holds it. Writes "host:pid since" into the file for the messages of those who wait."""

  def __init__(self, folder: pathlib.Path, k: int):
    self.handle, self.held = open(folder / f"{_name(k)}.lock", "a+"), False
    try:
      fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.handle.close()
      return
    self.held = True
    self.handle.seek(0)
    self.handle.truncate()
    self.handle.write(f"{me()} {time.time():.0f}\n")
    self.handle.flush()

  def release(self) -> None:
    if self.held:
      fcntl.flock(self.handle, fcntl.LOCK_UN)
      self.handle.close()
      self.held = False


def holder(folder: pathlib.Path, k: int) -> str:
  """Who tokenizes shard k and for how long, as its lock file says."""
  try:
    who, since = (folder / f"{_name(k)}.lock").read_text().split()
    return f"{who} for {time.time() - float(since):.0f} s"
  except (OSError, ValueError):
    return "a process"


def build_shard(reader, vocab, parts, k: int, folder: pathlib.Path, on_chunk=None) -> dict:
  """Tokenizes shard k into folder/<k>.tmp-<host>-<pid>/ and renames it whole to folder/<k>/ (the
  caller holds k's claim). Returns its meta."""
  start = time.perf_counter()
  for stale in folder.glob(f"{_name(k)}.tmp-*"):   # a dead holder's
    shutil.rmtree(stale, ignore_errors=True)
  tmp = folder / f"{_name(k)}.tmp-{me().replace(':', '-')}"
  tmp.mkdir()
  dtype = np.uint16 if vocab.size <= 2 ** 16 else np.int32
  files = {name: open(tmp / name, "wb") for name in FILES}
  tokens, longest, pairs = {"src": 0, "tgt": 0}, {"src": 0, "tgt": 0}, 0
  reading = reader.read_part(parts, k, CHUNK)
  while True:
    try:
      chunk, numbers = next(reading)
    except StopIteration as done:
      lines, bad, ends = done.value
      break
    for side, texts in zip(SIDES, zip(*chunk)):
      ids = vocab.encode_batch(list(texts), "source" if side == "src" else "target")
      lengths = np.fromiter(map(len, ids), np.int64, len(ids))
      np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum())).tofile(files[f"{side}.ids"])
      np.minimum(lengths, 2 ** 31 - 1).astype(np.int32).tofile(files[f"{side}.lengths"])
      tokens[side] += int(lengths.sum())
      longest[side] = max(longest[side], int(lengths.max(initial=0)))
    np.asarray(numbers, np.int64).tofile(files["numbers"])
    pairs += len(chunk)
    if on_chunk:
      on_chunk()
  for handle in files.values():
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
  meta = {"shard": k, "plan": parts.name, "pairs": pairs, "lines": lines, "ends": bool(ends),
          "tokens": tokens, "longest": longest, "bad": bad, "by": me(),
          "seconds": round(time.perf_counter() - start, 3),
          "bytes": {name: (tmp / name).stat().st_size for name in FILES}}
  with open(tmp / "meta.json", "w") as f:
    f.write(json.dumps(meta) + "\n")
    f.flush()
    os.fsync(f.fileno())
  try:
    os.rename(tmp, folder / _name(k))
  except OSError:   # already there: made by a process that did not hold the claim (never, under flock)
    shutil.rmtree(tmp, ignore_errors=True)
  return meta


class _Shards:
  """What is known of the shards on disk: the whole ones' metas, and where the split ends."""

  def __init__(self, parts, folder: pathlib.Path):
    self.parts, self.folder, self.metas = parts, folder, {}

  def scan(self) -> None:
    try:
      entries = list(os.scandir(self.folder))
    except FileNotFoundError:   # removed once the cache was assembled: the caller sees the cache whole
      return
    for entry in entries:
      if entry.name.isdigit() and int(entry.name) not in self.metas:
        meta = whole(self.folder, int(entry.name))
        if meta is not None:
          self.metas[int(entry.name)] = meta

  @property
  def last(self) -> int | None:
    """The index of the split's last shard, where known."""
    if self.parts.count is not None:
      return self.parts.count - 1
    ends = [k for k, meta in self.metas.items() if meta["ends"]]
    return min(ends) if ends else None

  def missing(self) -> list[int]:
    """The shards not yet whole (up to the first not known to exist, where the end is not known)."""
    last = self.last
    if last is None:
      return [next(k for k in itertools.count() if k not in self.metas)]
    return [k for k in range(last + 1) if k not in self.metas]

  def pairs(self) -> int:
    last = self.last
    return sum(m["pairs"] for k, m in self.metas.items() if last is None or k <= last)


def take_shards(reader, vocab, parts, folder: pathlib.Path, cache_whole, on_chunk=None) -> list[int]:
  """Tokenizes every shard that is neither whole nor claimed, first to last (a worker's loop); stops
  early once the cache itself is whole (cache_whole()). Returns the shards it tokenized."""
  shards, built, k = _Shards(parts, folder), [], 0
  try:
    while not cache_whole():
      shards.scan()
      last = shards.last
      if last is not None and k > last:
        break
      if k not in shards.metas:
        try:
          claim = _Claim(folder, k)
        except FileNotFoundError:   # the folder is gone: the cache was assembled meanwhile
          if cache_whole():
            break
          raise
        if claim.held:
          try:
            if whole(folder, k) is None:
              meta = build_shard(reader, vocab, parts, k, folder, on_chunk)
              shards.metas[k] = meta
              built.append(k)
          finally:
            claim.release()
      k += 1
  finally:
    parts.close()
  return built


# ---------------------------------------------------------------------------------------------------
# Worker processes: `python -c "from data.shards import _worker_main; _worker_main()"`, the task on stdin.
# ---------------------------------------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
  """Linux: the kernel SIGKILLs this worker when the process that started it dies (SIGKILL included)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass
  if os.getppid() != parent:   # it died before the line above
    os._exit(1)


def _worker_main() -> None:
  import ml_collections
  from data.sources import open_split
  from data.vocab import open_vocab
  task = json.loads(sys.stdin.read())
  _die_with_parent(task["parent"])
  global SHARD_BYTES, SHARD_LINES, SHARD_RECORDS, CHUNK
  SHARD_BYTES, SHARD_LINES, SHARD_RECORDS, CHUNK = task["units"]   # the parent's, whatever it set
  os.sched_setaffinity(0, {task["cpu"]})   # one CPU: SentencePiece then encodes on one thread
  folder, path = pathlib.Path(task["folder"]), pathlib.Path(task["path"])
  reader = open_split(ml_collections.ConfigDict(task["config"]), task["split"])
  parts = plan(reader)
  if parts.name != task["plan"]:
    raise SystemExit(f"the worker's plan {parts.name} is not its parent's {task['plan']}")
  vocab = open_vocab(pathlib.Path(task["vocab"]).read_bytes(), task["vocab"])
  try:
    built = take_shards(reader, vocab, parts, folder, lambda: (path / "meta.json").exists())
  except DataError as error:
    print(json.dumps({"error": str(error)}), flush=True)
    raise SystemExit(2) from None
  print(json.dumps({"built": built}), flush=True)


def _start_workers(data_config, vocab, split: str, parts, folder: pathlib.Path, path: pathlib.Path,
                   count: int) -> list:
  """`count` worker processes, each pinned to one of this process's CPUs (round robin)."""
  model = folder / f"vocab-{vocab.fingerprint}.model"
  if not model.exists():
    tmp = model.with_name(f"{model.name}.tmp-{me().replace(':', '-')}")
    tmp.write_bytes(vocab.model_bytes)
    os.replace(tmp, model)
  cpus = sorted(os.sched_getaffinity(0))
  root = str(pathlib.Path(__file__).resolve().parent.parent)   # the package this process imported
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
  workers = []
  for i in range(count):
    task = {"config": data_config.to_dict(), "split": split, "plan": parts.name, "folder": str(folder),
            "path": str(path), "vocab": str(model), "cpu": cpus[i % len(cpus)], "parent": os.getpid(),
            "units": [SHARD_BYTES, SHARD_LINES, SHARD_RECORDS, CHUNK]}
    out = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-c", "from data.shards import _worker_main; _worker_main()"],
                               stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                               env=env)
    process.stdin.write(json.dumps(task))
    process.stdin.close()
    workers.append((process, out))
  return workers


def _worker_result(process, out) -> dict:
  """A finished worker's report: {"built": [...]} or {"error": "..."} or {"failed": "its last line"}."""
  out.seek(0)
  lines = out.read().strip().splitlines()
  out.close()
  try:
    return json.loads(lines[-1])
  except (IndexError, ValueError):
    return {"failed": f"exit status {process.returncode}: {lines[-1] if lines else 'no output'}"}


# ---------------------------------------------------------------------------------------------------
# One process's part: its workers, then waiting for (or taking over) what others hold.
# ---------------------------------------------------------------------------------------------------

def make_parts(data_config, reader, vocab, path: pathlib.Path, split: str, progress: bool = True) -> dict:
  """Returns when every shard of `split` is whole on disk (or the cache itself is), this process having
  tokenized its share with its workers. -> {"folder", "parts", "built": shards this process made,
  "workers", "seconds"}. Raises DataError where the corpus is bad (every process that reads it does)."""
  start = time.perf_counter()
  parts = plan(reader)
  folder = parts_dir(path, parts)
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise DataError(f"the data cache {path.parent} cannot be written ({error.strerror or error}): set "
                    f"config.data.cache_dir (or $AIAYN_DATA_CACHE) to a folder you can write") from None
  cache_whole = lambda: (path / "meta.json").exists()
  shards = _Shards(parts, folder)
  shards.scan()
  todo = len(shards.missing()) if parts.count is not None else None
  count = min(workers_wanted(), todo) if todo is not None else workers_wanted()
  bar = tqdm.tqdm(total=parts.count, desc=f"[data] tokenizing {split} into {path.name}", unit=" shards",
                  dynamic_ncols=True, mininterval=1.0, disable=not progress)
  shown = [0.0]

  def show(force=False):
    if progress and (force or time.monotonic() - shown[0] >= 1.0):
      shards.scan()
      bar.n = len([k for k in shards.metas if shards.last is None or k <= shards.last])
      bar.total = None if shards.last is None else shards.last + 1
      bar.set_postfix_str(f"{shards.pairs():,} pairs", refresh=False)
      bar.refresh()
      shown[0] = time.monotonic()

  built, workers, errors = [], [], []
  with bar:
    if count > 1 and not cache_whole():
      workers = _start_workers(data_config, vocab, split, parts, folder, path, count)
    elif not cache_whole():
      built += take_shards(reader, vocab, parts, folder, cache_whole, on_chunk=show)
    waited, reported = time.monotonic(), time.monotonic()

    def reap(wait=False):   # the reports of the workers that ended; -> those still running
      alive = [w for w in workers if not wait and w[0].poll() is None]
      for process, out in [w for w in workers if w not in alive]:
        process.wait()
        result = _worker_result(process, out)
        built.extend(result.get("built", []))
        if "error" in result:
          errors.append(result["error"])
        elif "failed" in result:
          log.warning(f"[data] a tokenizing worker of {me()} ended without its report ({result['failed']})")
      return alive
    while True:
      workers = reap()
      if errors:
        for process, _ in workers:
          process.kill()
        raise DataError(errors[0])
      if cache_whole():
        break
      shards.scan()
      missing = shards.missing()
      if not missing:
        break
      show()
      if not workers:   # ours are done: take over what a dead process held, else wait and say for what
        taken = take_shards(reader, vocab, parts, folder, cache_whole, on_chunk=show)
        built += taken
        if taken:
          continue
        if time.monotonic() - reported >= WAIT_REPORT_S:
          shards.scan()
          missing = shards.missing()
          held = "; ".join(f"shard {k}: {holder(folder, k)}" for k in missing[:5])
          log.info(f"[data] {me()} waiting {time.monotonic() - waited:.0f} s for {len(missing)} shard(s) of "
                   f"{split} that other processes tokenize: {held}{' ...' if len(missing) > 5 else ''}")
          reported = time.monotonic()
      time.sleep(POLL_S)
    workers = reap(wait=True)   # every shard is whole: they are ending, if not ended
    show(force=True)
  built = sorted(set(built))
  seconds = time.perf_counter() - start
  total = shards.last + 1 if shards.last is not None else "?"
  pairs = sum(shards.metas[k]["pairs"] for k in built if k in shards.metas)
  log.info(f"[data] {me()} tokenized shards {spans(built) or 'none'} of {total} of {split} "
           f"({max(count, 1)} worker(s), {pairs:,} pairs) in {seconds:.1f} s")
  return {"folder": folder, "parts": parts, "built": built, "workers": max(count, 1), "seconds": seconds,
          "shards": shards.last + 1 if shards.last is not None else 0}


def spans(numbers) -> str:
  """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
  out = []
  for _, group in itertools.groupby(enumerate(sorted(numbers)), lambda x: x[1] - x[0]):
    group = [n for _, n in group]
    out.append(str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}")
  return ", ".join(out)


def assemble_order(folder: pathlib.Path, parts) -> list[dict]:
  """The whole shards' metas, first to last (DataError naming the first one missing)."""
  shards = _Shards(parts, folder)
  shards.scan()
  missing = shards.missing()
  if missing:
    raise DataError(f"shard {missing[0]} of {folder} is not whole; run again to make it")
  return [shards.metas[k] for k in range(shards.last + 1)]
