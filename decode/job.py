"""The directory of a bulk decoding job: its manifest, its parts, the workers' claims, and the join.

    OUTPUT.parts/manifest.json      the input's fingerprint and shard offsets, the run, every setting
    OUTPUT.parts/part-00007.txt     the output of input lines [7 * shard_lines, 8 * shard_lines), whole
    OUTPUT.parts/part-00007.json    its statistics (lines, target tokens, seconds), for the progress bar
    OUTPUT.parts/part-00007.claim.2 a worker's claim on part 7 (the 3rd one): host, pid, its start time
    OUTPUT.parts/launch.json        the last launch (--processes K, --launcher slurm): its host, pid, start
                                    time, command and SLURM job id, so that a second launch watches it

Nothing here imports JAX: decode/bulk.py translates the parts, and a launcher (`--processes K`) reads
the progress from this directory without loading a model.

Every file is written whole or not at all (a temporary file, then a rename), so a worker killed at any
moment leaves finished parts, a claim and perhaps a temporary file, never half a part. A part is done
when its .txt exists. A claim is taken by creating the next generation's file exclusively, whole (its
contents written beside it, then hard-linked to its name, which fails if the name exists): of two
workers reaching for a part, one gets it. A claim whose holder is gone (its pid has ended, on
this host; or it has not refreshed the claim's mtime for `stale_after` seconds, on another host) is
taken again with the next generation. Decoding is deterministic, so a part that two workers translate
anyway (a holder on another host that was only slow) is written twice with the same bytes.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import socket
import threading
import time

from run.user_errors import UserError
from run.workdir import write_atomically

MANIFEST = "manifest.json"
DONE = "done.json"           # written after the join: the output's size and lines
JOIN_LOCK = "join.lock"
LAUNCH = "launch.json"       # the last launcher's record (record_launch)
LAUNCH_LOCK = "launch.lock"  # held while a launcher looks for a running launch and starts its own
FORMAT = 1                   # of the manifest and the part files
_HOST = socket.gethostname()
_HAS_PROC = os.path.isdir("/proc/self")


def job_dir(output) -> pathlib.Path:
  """The job directory beside the output file: OUTPUT.parts/."""
  output = pathlib.Path(output)
  return output.with_name(output.name + ".parts")


def scan_input(path, shard_lines: int) -> dict:
  """One streamed pass over the input: its sha256, size, line count and the byte offset of every
  shard's first line. Lines end at "\\n" (a "\\r" before it is dropped when read); a last line without
  one counts.
  A line that is not UTF-8 is a UserError naming the file and line."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise UserError(f"--input {path} does not exist")
  digest, offsets, offset, lines = hashlib.sha256(), [], 0, 0
  with open(path, "rb") as f:
    for line in f:
      if lines % shard_lines == 0:
        offsets.append(offset)
      try:
        line.decode("utf-8")
      except UnicodeDecodeError:
        raise UserError(f"--input {path}: line {lines + 1} is not valid UTF-8; convert the file to "
                        f"UTF-8") from None
      digest.update(line)
      offset += len(line)
      lines += 1
  return dict(path=str(path.resolve()), bytes=offset, sha256=digest.hexdigest(), lines=lines,
              shard_lines=shard_lines, offsets=offsets)


def count_lines(path, what: str) -> int:
  """The number of lines of a file, as scan_input counts them; a missing file is a UserError."""
  if not pathlib.Path(path).is_file():
    raise UserError(f"{what} {path} does not exist")
  with open(path, "rb") as f:
    return sum(1 for _ in f)


def read_shard(path, offset: int, count: int) -> list[str]:
  """`count` lines (-1: all) of a file from byte `offset`, without their line ends."""
  out = []
  with open(path, "rb") as f:
    f.seek(offset)
    for line in f:
      out.append(line.decode("utf-8").rstrip("\r\n"))   # as the in-memory path reads stdin
      if len(out) == count:
        break
  return out


def _flat(manifest: dict) -> dict:
  """{'input': {...}, 'run': {'step': 5}, 'settings': {'beam_size': 4}} -> {'input': {...}, 'step': 5,
  'beam_size': 4}: what a refusal names."""
  flat = {}
  for key, value in manifest.items():
    if key in ("run", "settings") and isinstance(value, dict):
      flat.update(value)
    else:
      flat[key] = value
  return flat


def _describe(key, value) -> str:
  if key == "input" and isinstance(value, dict):
    return (f"input {value['path']} (sha256 {value['sha256'][:12]}, {value['lines']} lines, "
            f"--shard_lines {value['shard_lines']})")
  return f"{key}={value!r}"


class Job:
  """The job directory of one output file (see the module docstring)."""

  def __init__(self, output, manifest: dict):
    self.output = pathlib.Path(output)
    self.dir = job_dir(output)
    self.manifest = manifest

  @property
  def lines(self) -> int:
    return self.manifest["input"]["lines"]

  @property
  def shard_lines(self) -> int:
    return self.manifest["input"]["shard_lines"]

  @property
  def num_parts(self) -> int:
    return len(self.manifest["input"]["offsets"])

  def part_range(self, part: int) -> tuple[int, int]:
    """Input lines [first, end) of a part."""
    first = part * self.shard_lines
    return first, min(first + self.shard_lines, self.lines)

  def read_part_input(self, part: int) -> list[str]:
    first, end = self.part_range(part)
    return read_shard(self.manifest["input"]["path"], self.manifest["input"]["offsets"][part], end - first)

  def part_file(self, part: int) -> pathlib.Path:
    return self.dir / f"part-{part:05d}.txt"

  def stats_file(self, part: int) -> pathlib.Path:
    return self.dir / f"part-{part:05d}.json"

  def is_done(self, part: int) -> bool:
    return self.part_file(part).exists()

  def parts_left(self) -> list[int]:
    return [p for p in range(self.num_parts) if not self.is_done(p)]

  def joined(self) -> bool:
    """The output was joined from this job's parts and still has the size the join gave it."""
    done = self.dir / DONE
    if not done.exists() or not self.output.exists():
      return False
    return json.loads(done.read_text())["bytes"] == self.output.stat().st_size

  def write_part(self, part: int, text: str, stats: dict) -> None:
    """The part's statistics, then its text: a part whose .txt exists is whole and has its .json."""
    _write_whole(self.stats_file(part), json.dumps(stats) + "\n")
    _write_whole(self.part_file(part), text)

  def done_stats(self) -> list[dict]:
    """The statistics of every finished part (missing ones, of parts finished by now: skipped)."""
    out = []
    for p in range(self.num_parts):
      if self.is_done(p):
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
          out.append(json.loads(self.stats_file(p).read_text()))
    return out

  # -- claims ------------------------------------------------------------------------------------------

  def _claims(self, part: int) -> list[pathlib.Path]:
    prefix = f"part-{part:05d}.claim."
    found = [self.dir / name for name in os.listdir(self.dir)   # not a claim being written beside its name
             if name.startswith(prefix) and name[len(prefix):].isdigit()]
    return sorted(found, key=lambda p: int(p.name.rsplit(".", 1)[1]))

  def claim(self, stale_after: float) -> Claim | None:
    """Claims the first part that is neither done nor held by a live worker; None when there is none."""
    for part in range(self.num_parts):
      if self.is_done(part):
        continue
      claims = self._claims(part)
      if claims and holder_alive(claims[-1], stale_after):
        continue
      generation = int(claims[-1].name.rsplit(".", 1)[1]) + 1 if claims else 0
      path = self.dir / f"part-{part:05d}.claim.{generation}"
      # The claim appears whole: written beside it, then hard-linked to its name, which fails if another
      # worker took this generation first. Created empty and then written, a worker killed in between
      # left an empty claim that held the part for stale_after seconds.
      tmp = _unique_tmp(path)
      tmp.write_text(json.dumps(dict(host=_HOST, pid=os.getpid(), start=_start_time(os.getpid()))))
      try:
        os.link(tmp, path)
      except FileExistsError:
        continue
      finally:
        _remove(tmp)
      if self.is_done(part) or self.joined():   # finished while we looked (joined: its part is gone)
        _remove(path)
        if self.joined():
          return None
        continue
      return Claim(self, part, path, stale_after)
    return None

  def release(self, part: int) -> None:
    for path in self._claims(part):
      _remove(path)

  # -- the join ----------------------------------------------------------------------------------------

  def join(self) -> bool:
    """Concatenates the parts in input order into the output, atomically, then removes the parts.
    Under a lock (flock: released if the holder dies), so that one worker joins and the others find it
    joined. Returns whether this call joined."""
    with open(self.dir / JOIN_LOCK, "a") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if self.joined():
        return False
      missing = self.parts_left()
      if missing:
        raise RuntimeError(f"join: parts {missing[:5]} of {self.dir} are not done")
      tmp = _unique_tmp(self.output)
      size = 0
      with open(tmp, "wb") as out:
        for p in range(self.num_parts):
          with open(self.part_file(p), "rb") as part:
            while chunk := part.read(1 << 20):
              out.write(chunk)
              size += len(chunk)
        out.flush()
        os.fsync(out.fileno())
      totals = summed(self.done_stats())
      os.replace(tmp, self.output)
      _write_whole(self.dir / DONE, json.dumps(dict(bytes=size, **totals)) + "\n")
      for p in range(self.num_parts):
        _remove(self.part_file(p))
        _remove(self.stats_file(p))
        self.release(p)
      for tmp in self.dir.glob(f"*.{_HOST}.*.tmp"):   # what killed workers on this host were writing
        pid = tmp.name.split(f".{_HOST}.", 1)[1].split(".")[0]
        if pid.isdigit() and not _pid_exists(int(pid)):
          _remove(tmp)
      return True


class Claim:
  """A worker's hold on one part; a thread refreshes the claim file's mtime (the heartbeat that workers
  on other hosts read) until `release`."""

  def __init__(self, job: Job, part: int, path: pathlib.Path, stale_after: float):
    self.job, self.part, self.path = job, part, path
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, args=(max(stale_after / 4, 0.05),), daemon=True)
    self._thread.start()

  def _beat(self, every: float) -> None:
    while not self._stop.wait(every):
      with contextlib.suppress(FileNotFoundError):
        os.utime(self.path)

  def release(self) -> None:
    self._stop.set()
    self._thread.join()
    self.job.release(self.part)


def open_job(output, manifest: dict) -> Job:
  """Creates the job directory with this manifest, or opens the one there if it was made with the
  same one. An unfinished job made with another input, run, checkpoint or setting is a UserError naming
  what changed: its parts are never mixed with this command's. A finished one (joined; its parts are
  gone) is replaced by a new job with this manifest."""
  directory = job_dir(output)
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / MANIFEST
  manifest = {**manifest, "format": FORMAT}
  if not path.exists():
    tmp = _unique_tmp(path)
    write_atomically(tmp, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    try:
      os.link(tmp, path)      # fails if another worker made it first: then theirs is compared below
    except FileExistsError:
      pass
    finally:
      _remove(tmp)
  try:
    existing = json.loads(path.read_text())
  except json.JSONDecodeError:
    raise UserError(f"{path} is not JSON: it was edited or damaged; delete {directory} to start this "
                    f"job again") from None
  mine = json.loads(json.dumps(manifest))   # tuples as lists, as the file has them
  was, now = _flat(existing), _flat(mine)
  changed = [key for key in sorted(set(was) | set(now)) if was.get(key) != now.get(key)]
  if changed and (directory / DONE).exists():
    # A finished job has no parts left to mix with: another setting starts a new job, and its join
    # replaces the output, as the in-memory path's write would.
    _write_whole(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    _remove(directory / DONE)
    return Job(output, mine)
  if changed:
    key = changed[0]
    raise UserError(
        f"{directory} holds a job for the same --output made with {_describe(key, was.get(key))}, but "
        f"this command has {_describe(key, now.get(key))}"
        + (f" (and {len(changed) - 1} more: {', '.join(changed[1:])})" if len(changed) > 1 else "")
        + f": rerun it with the same settings to finish it, or give another --output, or delete "
          f"{directory} to start over")
  return Job(output, existing)


@contextlib.contextmanager
def launch_lock(directory):
  """Held (flock) while a launcher reads the last launch and starts or submits its own: of two launches
  of one job at once, the second finds the first's record."""
  with open(pathlib.Path(directory) / LAUNCH_LOCK, "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    yield


def record_launch(directory, launcher: str, command: list[str], job_id: str | None = None) -> dict:
  """Writes OUTPUT.parts/launch.json: this launcher process, its command and SLURM job id."""
  record = dict(launcher=launcher, job_id=job_id, host=_HOST, pid=os.getpid(), start=_start_time(os.getpid()),
                command=command, time=time.strftime("%Y-%m-%d %H:%M:%S"))
  _write_whole(pathlib.Path(directory) / LAUNCH, json.dumps(record) + "\n")
  return record


def read_launch(directory) -> dict | None:
  """The last launch's record, or None (none yet, or damaged)."""
  try:
    return json.loads((pathlib.Path(directory) / LAUNCH).read_text())
  except (FileNotFoundError, json.JSONDecodeError):
    return None


def process_alive(host: str, pid: int, start) -> bool | None:
  """Whether process `pid` (started at `start`, clock ticks since boot) still runs; None for a process
  on another host, which cannot be asked."""
  if host != _HOST:
    return None
  if _HAS_PROC:
    return start is not None and _start_time(pid) == start
  return _pid_exists(pid)


def holder_alive(claim: pathlib.Path, stale_after: float) -> bool:
  """Whether the worker that wrote this claim may still be working on it."""
  try:
    mtime = claim.stat().st_mtime
    holder = json.loads(claim.read_text())
  except FileNotFoundError:   # released just now
    return True
  except json.JSONDecodeError:   # being written this instant, or its writer died before it wrote
    return time.time() - mtime < stale_after
  if holder.get("host") != _HOST:
    return time.time() - mtime < stale_after
  if _HAS_PROC:
    return holder.get("start") is not None and _start_time(holder["pid"]) == holder["start"]
  return _pid_exists(holder["pid"])


def summed(stats: list[dict]) -> dict:
  return dict(lines=sum(s["lines"] for s in stats), tgt_tokens=sum(s["tgt_tokens"] for s in stats),
              seconds=sum(s["seconds"] for s in stats))


def _start_time(pid: int) -> int | None:
  """The start time of process `pid` in clock ticks since boot (None if it has ended or is a zombie):
  with the pid, it names a process even after the pid is reused."""
  try:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
  except (FileNotFoundError, ProcessLookupError, IndexError):
    return None
  if fields[0] in ("Z", "X"):   # killed, not yet reaped by its parent: gone all the same
    return None
  return int(fields[19])


def _pid_exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _write_whole(path: pathlib.Path, text: str) -> None:
  """write_atomically, through a temporary name of this worker's own: workers that write the same file
  at once (the same bytes) do not write into one temporary file."""
  tmp = _unique_tmp(path)
  write_atomically(tmp, text)
  os.replace(tmp, path)


def _unique_tmp(path: pathlib.Path) -> pathlib.Path:
  """A temporary name beside `path` that no other worker uses."""
  return path.with_name(f"{path.name}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp")


def _remove(path) -> None:
  with contextlib.suppress(FileNotFoundError):
    os.remove(path)
