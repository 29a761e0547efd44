"""Bulk decoding (`python -m decode` from a file to a file): parts, claims, resume, workers.

The model and run directory are test_translate's (a tiny random Transformer saved as a run).
"""
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
# Imported here, at collection: a first import of submitit reconfigures logging (dictConfig), which closes
# absl's handler's stream; inside a test whose stderr is captured, that stream is pytest's own.
import submitit  # noqa: F401

from decode import job as job_lib
from decode.__main__ import main as decode_main
from files_config import clean_env
from test_translate import corpus, model_and_params, run, vocab  # noqa: F401 - module fixtures

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):  # noqa: F811
  """30 lines of several lengths, two of them empty, one with a UTF-8 letter, the last without "\\n"."""
  lines = [s for s, _ in corpus["dev"][:28]]
  lines[5] = ""
  lines[17] = ""
  lines[9] = lines[9] + " é"
  lines += [corpus["test"][0][0], corpus["test"][1][0]]
  path = tmp_path_factory.mktemp("src") / "src.txt"
  path.write_text("\n".join(lines), encoding="utf-8")
  return path


MODES = {
    "beam": ["--beam_size", "3"],
    "greedy": ["--temperature", "0"],
    "sampling": ["--temperature", "2.0", "--top_k", "20", "--seed", "7"],
    "nbest": ["--beam_size", "3", "--nbest", "2"],
}


def _decode(run, source, output, *flags):  # noqa: F811
  """36 tokens per device: one row per device in every bucket, in the parts' full batches as in the
  in-memory path's small ones, so that --nbest's scores round alike (on the tests' 8 CPU devices)."""
  decode_main(["--workdir", str(run), "--input", str(source), "--output", str(output),
               "--max_extra_len", "6", "--batch_tokens", "36", "--no_progress", *flags])


def _in_memory(run, source, capsys, *flags):  # noqa: F811
  """Today's in-memory path: the whole input from stdin, the whole output to stdout."""
  capsys.readouterr()
  stdin = sys.stdin
  try:
    sys.stdin = open(source, encoding="utf-8")
    _decode(run, "-", "-", *flags)
  finally:
    sys.stdin.close()
    sys.stdin = stdin
  return capsys.readouterr().out


@pytest.mark.parametrize("mode", sorted(MODES))
def test_parts_joined_equal_the_in_memory_path_byte_for_byte(run, source, tmp_path, capsys, mode):  # noqa: F811
  expected = _in_memory(run, source, capsys, *MODES[mode])
  assert expected.count("\n") == 30 * (2 if mode == "nbest" else 1)
  out = tmp_path / "hyp.txt"
  _decode(run, source, out, "--shard_lines", "7", *MODES[mode])
  assert out.read_text(encoding="utf-8") == expected
  err = capsys.readouterr().err
  assert "30 lines in 5 parts of 7" in err and "30 lines translated" in err
  # The parts are joined and gone; the manifest stays, and a rerun has nothing to do.
  parts = job_lib.job_dir(out)
  assert sorted(p.name for p in parts.iterdir()) == ["done.json", "join.lock", "manifest.json"]
  _decode(run, source, out, "--shard_lines", "7", *MODES[mode])
  assert out.read_text(encoding="utf-8") == expected
  assert "0 lines translated" in capsys.readouterr().err
  assert sorted(p.name for p in parts.iterdir()) == ["done.json", "join.lock", "manifest.json"]


def test_a_rerun_translates_only_the_parts_left(run, source, tmp_path, capsys):  # noqa: F811
  out = tmp_path / "hyp.txt"
  _decode(run, source, out, "--shard_lines", "7")
  whole = out.read_text()
  out.unlink()
  (job_lib.job_dir(out) / job_lib.DONE).unlink()
  job = job_lib.Job(out, json.loads((job_lib.job_dir(out) / job_lib.MANIFEST).read_text()))
  # As if a killed job had finished parts 0, 1 and 3: write them back with marked text.
  for part in (0, 1, 3):
    first, end = job.part_range(part)
    job.write_part(part, "".join(f"kept {i}\n" for i in range(first, end)),
                   dict(part=part, lines=end - first, tgt_tokens=0, seconds=0.0))
  capsys.readouterr()
  _decode(run, source, out, "--shard_lines", "7")
  text = out.read_text().splitlines()
  assert "3 parts done before" in capsys.readouterr().err
  kept = [i for i, line in enumerate(text) if line.startswith("kept ")]
  assert kept == list(range(0, 14)) + list(range(21, 28))
  assert [line for i, line in enumerate(text) if i not in kept] == \
      [line for i, line in enumerate(whole.splitlines()) if i not in kept]


@pytest.mark.parametrize("change, step, named", [
    (["--beam_size", "2"], 5, "made with beam_size=3, but this command has beam_size=2:"),
    (["--shard_lines", "8"], 5, "--shard_lines 7), but this command has input"),
    (["--checkpoint", "latest", "--alpha", "0.7"], 5, "made with alpha=0.6, but this command has alpha=0.7:"),
    ([], 4, "made with step=4, but this command has step=5:"),   # a newer checkpoint since
])
def test_a_changed_setting_is_refused_naming_it(run, source, tmp_path, capsys, change, step, named):  # noqa: F811
  out = tmp_path / "hyp.txt"
  directory = job_lib.job_dir(out)
  directory.mkdir()
  scanned = job_lib.scan_input(source, 7)
  settings = dict(beam_size=3, alpha=0.6, max_extra_len=6, batch_tokens=36, nbest=1, min_len=0,
                  sampling=None, seed=0, source_eos=False)
  from decode import bulk
  import run as run_lib
  opened = run_lib.load_run(run)
  manifest = bulk.manifest(opened, settings, scanned, pathlib.Path(run), None)
  assert manifest["run"]["step"] == 5
  manifest["run"]["step"] = step
  job_lib.open_job(out, manifest)
  before = (directory / job_lib.MANIFEST).read_bytes()
  with pytest.raises(SystemExit) as exit_info:
    _decode(run, source, out, "--beam_size", "3", "--shard_lines", "7", *change)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and f"error: {directory} holds a job" in err and named in err
  assert "delete" in err and not out.exists()
  assert (directory / job_lib.MANIFEST).read_bytes() == before
  assert sorted(p.name for p in directory.iterdir()) == [job_lib.MANIFEST]


def test_bad_input_is_refused_naming_the_line(run, tmp_path, capsys):  # noqa: F811
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"fine\nalso fine\n\xff\xfe broken\n")
  with pytest.raises(SystemExit) as exit_info:
    _decode(run, bad, tmp_path / "hyp.txt")
  assert exit_info.value.code == 2 and f"--input {bad}: line 3 is not valid UTF-8" in capsys.readouterr().err
  assert not (tmp_path / "hyp.txt").exists()
  with pytest.raises(SystemExit):
    _decode(run, tmp_path / "missing.txt", tmp_path / "hyp.txt")
  assert "missing.txt does not exist" in capsys.readouterr().err
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  _decode(run, empty, tmp_path / "hyp.txt")
  assert (tmp_path / "hyp.txt").read_bytes() == b""


# ------------------------------------------------------------------------------------------------------
# Claims, without a model.
# ------------------------------------------------------------------------------------------------------

def _job(tmp_path, lines=10, shard_lines=3):
  source = tmp_path / "in.txt"
  source.write_text("".join(f"line {i}\n" for i in range(lines)))
  return job_lib.open_job(tmp_path / "out.txt", dict(input=job_lib.scan_input(source, shard_lines)))


def test_scan_counts_lines_and_shard_offsets_as_read_back(tmp_path):
  source = tmp_path / "in.txt"
  source.write_bytes(b"a\r\n\nb c\n\xc3\xa9\nlast")
  scanned = job_lib.scan_input(source, 2)
  assert scanned["lines"] == 5 and len(scanned["offsets"]) == 3
  job = job_lib.Job(tmp_path / "o.txt", dict(input=scanned))
  assert [job.read_part_input(p) for p in range(3)] == [["a", ""], ["b c", "é"], ["last"]]


def test_each_part_is_claimed_once_and_a_dead_holders_part_again(tmp_path):
  job = _job(tmp_path)
  assert job.num_parts == 4
  claims = [job.claim(stale_after=60) for _ in range(4)]
  assert [c.part for c in claims] == [0, 1, 2, 3]
  # A claim is whole from the moment its name exists (a worker killed while writing one left an empty
  # claim, which held the part for stale_after seconds), and its temporary file is gone.
  assert all(json.loads(c.path.read_text())["pid"] == os.getpid() for c in claims)
  assert not list(job.dir.glob("*.tmp"))
  assert job.claim(stale_after=60) is None          # all held by a live worker (this one)
  claims[1].release()
  assert job.claim(stale_after=60).part == 1        # released, not done: claimed again
  # A holder whose process has ended (here: a child that exited) loses its claim at once.
  child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                         text=True, check=True)
  dead = json.loads(claims[2].path.read_text())
  claims[2]._stop.set()
  claims[2].path.write_text(json.dumps(dict(dead, pid=int(child.stdout), start=1)))
  again = job.claim(stale_after=60)
  assert again.part == 2 and again.path.name == "part-00002.claim.1"
  # A holder on another host is alive while it refreshes its claim, and gone once it stops.
  claims[3]._stop.set()
  claims[3].path.write_text(json.dumps(dict(host="elsewhere", pid=1, start=1)))
  assert job.claim(stale_after=60) is None
  old = time.time() - 120
  os.utime(claims[3].path, (old, old))
  assert job.claim(stale_after=60).part == 3


def test_a_claim_being_written_beside_its_name_is_not_a_claim(tmp_path):
  """Another worker's claim between its write and its link: part-N.claim.G.<host>.<pid>.tmp. Read as a
  claim, its name broke the part's list of claims (a fresh-clone CI run failed so)."""
  job = _job(tmp_path)
  (job.dir / "part-00000.claim.0.somehost.123.tmp").write_text("{}")
  assert job.claim(stale_after=60).part == 0


def test_a_launcher_counts_what_its_workers_did_before_its_first_look(tmp_path):
  """The job is made, and all of it translated, by workers faster than the launcher's first poll: all of
  it is this command's work, none of it 'done before'."""
  from decode.progress import Progress
  progress = Progress(tmp_path / "out.txt", enabled=False)
  job = _job(tmp_path)
  for part in range(job.num_parts):
    job.write_part(part, "x\n", dict(part=part, lines=3 if part < 3 else 1, tgt_tokens=2))
  assert "10 lines translated" in progress.summary() and "0 lines were done before" in progress.summary()
  again = Progress(tmp_path / "out.txt", enabled=False)   # a later command over the same finished parts
  assert "0 lines translated" in again.summary() and "10 lines were done before" in again.summary()


def test_a_claim_taken_by_another_worker_first_is_left_to_it(tmp_path, monkeypatch):
  job = _job(tmp_path)
  link, raced = os.link, []

  def another_worker_first(source, name):
    if not raced:   # the first name this worker reaches for is taken between its look and its link
      raced.append(pathlib.Path(name).name)
      link(source, name)
      raise FileExistsError(name)
    link(source, name)
  monkeypatch.setattr(os, "link", another_worker_first)
  assert job.claim(stale_after=60).part == 1 and raced == ["part-00000.claim.0"]
  assert not list(job.dir.glob("*.tmp"))


def test_a_finished_job_gives_way_to_another_setting_an_unfinished_one_does_not(tmp_path):
  job = _job(tmp_path)
  other = dict(job.manifest, settings=dict(beam_size=2))
  with pytest.raises(job_lib.UserError, match="made with beam_size=None, but this command has beam_size=2"):
    job_lib.open_job(job.output, other)
  (job.dir / job_lib.DONE).write_text(json.dumps(dict(bytes=0, lines=10, tgt_tokens=0, seconds=0)))
  again = job_lib.open_job(job.output, other)
  assert again.manifest["settings"] == dict(beam_size=2) and not (job.dir / job_lib.DONE).exists()
  assert json.loads((job.dir / job_lib.MANIFEST).read_text())["settings"] == dict(beam_size=2)


def test_join_writes_the_parts_in_input_order_only_when_all_are_done(tmp_path):
  job = _job(tmp_path)
  for part in (3, 1, 0):
    first, end = job.part_range(part)
    job.write_part(part, "".join(f"out {i}\n" for i in range(first, end)),
                   dict(part=part, lines=end - first, tgt_tokens=2, seconds=0.1))
  with pytest.raises(RuntimeError, match=r"parts \[2\]"):
    job.join()
  assert not job.output.exists() and job.parts_left() == [2]
  job.write_part(2, "out 6\nout 7\nout 8\n", dict(part=2, lines=3, tgt_tokens=2, seconds=0.1))
  assert job.join() and not job.join()
  assert job.output.read_text() == "".join(f"out {i}\n" for i in range(10))
  assert job.joined() and json.loads((job.dir / job_lib.DONE).read_text())["lines"] == 10
  assert not list(job.dir.glob("part-*"))


# ------------------------------------------------------------------------------------------------------
# Worker processes.
# ------------------------------------------------------------------------------------------------------

def _env():
  """The suite's environment (its compilation cache included, tests/conftest.py) without its 8 fake devices:
  a worker sees the devices --cpu_devices gives it, under the suite's instruction-set cap."""
  return clean_env(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


def _command(run, source, out, *flags):  # noqa: F811
  return [sys.executable, "-m", "decode", "--workdir", str(run), "--input", str(source), "--output",
          str(out), "--max_extra_len", "6", "--batch_tokens", "288", "--beam_size", "2", "--no_progress",
          "--cpu_devices", "1", *flags]


@pytest.fixture(scope="module")
def long_source(tmp_path_factory, corpus):  # noqa: F811
  lines = [s for s, _ in corpus["test"][:60]]
  lines[10] = ""
  path = tmp_path_factory.mktemp("long") / "src.txt"
  path.write_text("".join(line + "\n" for line in lines))
  return path


@pytest.fixture(scope="module")
def uninterrupted(run, long_source, tmp_path_factory):  # noqa: F811
  out = tmp_path_factory.mktemp("one") / "hyp.txt"
  subprocess.run(_command(run, long_source, out, "--shard_lines", "4"), env=_env(), check=True, cwd=ROOT)
  return out.read_bytes()


@pytest.mark.slow
def test_a_worker_killed_mid_job_then_a_rerun_gives_the_uninterrupted_output(run, long_source, tmp_path,  # noqa: F811
                                                                             uninterrupted):
  out = tmp_path / "hyp.txt"
  worker = subprocess.Popen(_command(run, long_source, out, "--shard_lines", "4"), env=_env(), cwd=ROOT)
  parts = job_lib.job_dir(out)
  while True:   # stopped (SIGSTOP) where it holds a claim, then killed: no race with a part's end
    assert worker.poll() is None, "the worker ended before it could be killed"
    if list(parts.glob("part-0000[2-9].txt")):
      worker.send_signal(signal.SIGSTOP)
      if list(parts.glob("part-*.claim.*")):
        break
      worker.send_signal(signal.SIGCONT)
    time.sleep(0.02)
  worker.send_signal(signal.SIGKILL)
  worker.wait()
  done = len(list(parts.glob("part-*.txt")))
  assert 3 <= done < 15 and not out.exists()
  assert list(parts.glob("part-*.claim.*"))    # the killed worker's claim is left behind
  subprocess.run(_command(run, long_source, out, "--shard_lines", "4"), env=_env(), check=True, cwd=ROOT)
  assert out.read_bytes() == uninterrupted
  assert len(out.read_text().splitlines()) == 60
  assert sorted(p.name for p in parts.iterdir()) == ["done.json", "join.lock", "manifest.json"]


def _follow(stream, lines: list) -> threading.Thread:
  """Collects a stream's lines in a thread, as they come."""
  thread = threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True)
  thread.start()
  return thread


@pytest.mark.slow
def test_two_workers_on_their_own_devices_give_the_output_of_one_and_take_over_a_killed_ones_part(
    run, long_source, tmp_path, uninterrupted):  # noqa: F811
  """--processes 2 on 8 CPU devices: each worker gets 4 devices and its own cores; one is SIGKILLed
  while it holds a part, the other translates that part too, and the output is one worker's."""
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 cores to give each worker its own (this process may use 1)")
  out = tmp_path / "hyp.txt"
  launcher = subprocess.Popen(_command(run, long_source, out, "--shard_lines", "4", "--processes", "2",
                                       "--cpu_devices", "8"),
                              env=_env(), cwd=ROOT, stderr=subprocess.PIPE, text=True)
  lines: list[str] = []
  reader = _follow(launcher.stderr, lines)
  parts, reports, held = job_lib.job_dir(out), {}, None
  deadline = time.time() + 600
  while held is None:
    assert launcher.poll() is None and time.time() < deadline, "".join(lines)
    reports = {int(m.group(1)): m for m in map(WORKER.search, list(lines)) if m}
    if len(reports) == 2:
      victim = min(reports)
      for claim in parts.glob("part-*.claim.*"):
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
          if json.loads(claim.read_text())["pid"] == victim:
            held = claim
    time.sleep(0.02)
  os.kill(victim, signal.SIGKILL)
  part = held.name.split(".")[0]
  time.sleep(0.5)
  # Its claim is left behind (its part not done), until the other worker takes the part over.
  assert held.exists() or (parts / f"{part}.txt").exists() or out.exists()
  assert launcher.wait(timeout=600) == 0, "".join(lines)
  reader.join(timeout=10)
  text = "".join(lines)
  assert out.read_bytes() == uninterrupted
  assert "60 lines translated" in text and "1 of 2 workers failed" in text, text
  # Each worker on 4 CPU devices of its own and its own cores.
  assert [m.group(2) for m in reports.values()] == ["4 cpu devices", "4 cpu devices"], text
  cores = [set(m.group(3).split(",")) for m in reports.values()]
  assert cores[0] and cores[1] and not cores[0] & cores[1], text


WORKER = re.compile(r"\[decode\] worker pid (\d+) on \S+: (\d+ \w+ devices?) \[[^]]*\]; its share: cores (\S+)")


@pytest.mark.slow
def test_the_benchmark_compares_both_paths_and_checks_their_outputs(tmp_path, capsys):
  from benchmarks import bulk_decode
  result = bulk_decode.main(["--small", "300", "--large", "900", "--repeats", "1", "--shard_lines", "100",
                             "--dir", str(tmp_path), "--out", str(tmp_path / "r.json")])
  assert result["outputs_identical_at_small"] and result["large_output_lines"] == 900
  assert len(result["runs"]["bulk"]) == len(result["runs"]["in_memory"]) == 1
  assert result["speed_ratio_bulk_over_in_memory"] > 0 and result["peak_rss_mib"]["bulk_large"] > 100
  assert json.loads((tmp_path / "r.json").read_text())["small_lines"] == 300
  assert "need >= 0.95" in capsys.readouterr().out


def test_translate_counts_the_target_tokens_of_each_best_hypothesis(model_and_params, vocab, corpus):  # noqa: F811
  from decode.translate import translate
  model, params = model_and_params
  sources = [s for s, _ in corpus["dev"][:6]] + [""]
  hyps, lengths = translate(model, params, vocab, sources, beam_size=2, max_extra_len=4, return_lengths=True)
  assert hyps == translate(model, params, vocab, sources, beam_size=2, max_extra_len=4)
  assert lengths[-1] == 0 and all(0 <= n <= len(vocab.encode(s)) + 3 for n, s in zip(lengths, sources))
  assert sum(lengths) > 0 and all(n > 0 for n, h in zip(lengths, hyps) if h)
  # Detokenizing and tokenizing again mostly gives the same pieces.
  assert sum(n == len(vocab.encode(h)) for n, h in zip(lengths, hyps)) >= 4


# ------------------------------------------------------------------------------------------------------
# Device shares of the workers, and the SLURM job over nodes (no GPU, no SLURM needed).
# ------------------------------------------------------------------------------------------------------

def test_each_worker_sees_only_its_own_gpus_and_too_many_workers_are_refused(monkeypatch):
  from decode import devices
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
  kind, ids = devices.host_devices()
  assert (kind, ids) == ("gpu", [str(i) for i in range(8)])
  shares = devices.split(kind, ids, 8)
  envs = [devices.share_env(kind, s, os.environ, index=i, cpu_devices=1) for i, s in enumerate(shares)]
  assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == [str(i) for i in range(8)]
  assert devices.split(kind, ids, 3) == [["0", "1", "2"], ["3", "4", "5"], ["6", "7"]]
  with pytest.raises(ValueError, match=r"^--processes 9 but this host has 8 GPUs \(0,1,2,3,4,5,6,7\): one "
                                       r"worker per device at most; give --processes 8 or fewer$"):
    devices.split(kind, ids, 9)
  # CUDA stops at the first entry that names no device: the GPUs after a -1 are not this host's to give.
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,-1,2")
  assert devices.host_devices() == ("gpu", ["3", "1"])
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")   # the CPU, whatever the host has
  assert devices.host_devices()[0] == "cpu"


def test_cpu_workers_split_the_cores_and_the_forced_device_count():
  from decode import devices
  assert devices.split("cpu", ["0", "1", "2", "3", "4"], 2) == [["0", "1", "2"], ["3", "4"]]
  assert devices.split("cpu", ["0"], 2) == [["0"], ["0"]]    # fewer cores than workers: shared
  environ = {"XLA_FLAGS": "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"}
  assert devices.cpu_device_count(2, environ) == 8
  env = devices.share_env("cpu", ["1"], environ, index=1, cpu_devices=4)
  assert env["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=4"


def test_a_slurm_task_that_sees_its_whole_node_keeps_its_own_gpus(monkeypatch):
  from decode import devices
  monkeypatch.setenv("SLURM_LOCALID", "2")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
  devices.pin_slurm_task(2)
  assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
  devices.pin_slurm_task(2)                       # bound already (SLURM's own binding): unchanged
  assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_the_slurm_launcher_spreads_one_task_per_gpu_over_the_nodes(tmp_path, monkeypatch):
  import submitit

  from decode import slurm
  seen = {}
  monkeypatch.setattr(submitit.SlurmExecutor, "submit",
                      lambda self, task: seen.update(sbatch=self._make_submission_file_text("CMD", "0")))
  slurm.submit(["python", "-m", "decode"], tmp_path, nodes=2, tasks_per_node=8, partition="gpu",
               time_minutes=30, gpus_per_task=1, sbatch=["account=abc"])
  for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-task=1", "--cpus-per-task=4",
               "--account=abc"):
    assert f"#SBATCH {line}\n" in seen["sbatch"], seen["sbatch"]


@pytest.mark.parametrize("flags, named", [
    (["--launcher", "slurm", "--processes", "3", "--nodes", "2"], "--processes 3 tasks do not spread evenly "
                                                                   "over --nodes 2"),
    (["--processes", "2", "--nodes", "2"], "--nodes is for --launcher slurm"),
])
def test_bad_worker_layouts_are_refused_in_one_line(tmp_path, capsys, flags, named):
  with pytest.raises(SystemExit) as exit_info:
    decode_main(["--workdir", str(tmp_path), "--input", str(tmp_path / "in.txt"), "--output",
                 str(tmp_path / "out.txt"), *flags])
  assert exit_info.value.code == 2 and named in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------
# Parts sized for the workers, a second launch, and SLURM without accounting.
# ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lines, workers, most, expected", [
    (10_000, 4, 10_000, (2_500, 4)),          # the default part would leave 3 of 4 workers idle
    (100_000, 16, 131_072, (6_250, 16)),      # 16 GPUs, beam 4: one part each
    (2_100_000, 16, 131_072, (65_625, 32)),   # rounded up to a multiple of the workers: 2 each
    (9, 4, 10_000, (2, 5)),                   # 3 parts of 3 would leave a worker idle
    (3, 4, 10_000, (1, 3)),                   # fewer lines than workers: one line a part
    (250_000, 1, 131_072, (125_000, 2)),      # one worker: parts no larger than `most`, evened out
    (30, 1, 10_000, (30, 1)),
])
def test_parts_are_sized_so_that_every_worker_gets_parts(lines, workers, most, expected):
  from decode import bulk
  shard_lines = bulk.shard_lines_for(lines, workers, most)
  assert (shard_lines, -(-lines // shard_lines)) == expected
  assert shard_lines <= most and -(-lines // shard_lines) >= min(lines, workers)


def test_every_size_gives_each_worker_parts_and_none_larger_than_the_default():
  from decode import bulk
  for lines in range(1, 400, 7):
    for workers in (1, 2, 3, 4, 8, 16):
      for most in (5, 64, 10_000):
        shard_lines = bulk.shard_lines_for(lines, workers, most)
        parts = -(-lines // shard_lines)
        assert shard_lines <= most and parts >= min(lines, workers), (lines, workers, most)


def test_the_log_states_the_part_size_and_idle_workers():
  from decode import bulk
  assert bulk.parts_line(10_000, 2_500, 4, False) == ("[decode] 10000 lines in 4 parts of 2500 lines (sized "
                                                      "for the input and the workers) for 4 workers")
  assert bulk.parts_line(30, 7, 8, True).endswith("(--shard_lines) for 8 workers: 3 workers will have no part "
                                                  "to decode")


@pytest.fixture(scope="module")
def two_thousand(tmp_path_factory, corpus):  # noqa: F811
  """2,000 short lines: under the CPU's default part (bulk.MIN_SHARD_LINES, 10,000 lines), which would
  make one part and leave three of four workers idle. (10,000 lines decoded five times as many for the
  same assertions.)"""
  short = [s for s, _ in corpus["test"] + corpus["dev"] if len(s.split()) <= 6]
  path = tmp_path_factory.mktemp("twok") / "src.txt"
  path.write_text("".join(short[i % len(short)] + "\n" for i in range(2_000)))
  return path


@pytest.mark.slow
def test_four_workers_on_two_thousand_lines_each_decode_parts_and_write_one_workers_output(
    run, two_thousand, tmp_path):  # noqa: F811
  from decode import bulk
  assert bulk.MIN_SHARD_LINES > 2_000
  one, four = tmp_path / "one.txt", tmp_path / "four.txt"
  single = subprocess.run(_command(run, two_thousand, one), env=_env(), cwd=ROOT, capture_output=True,
                          text=True, check=True)
  assert "2000 lines in 1 part of 2000 lines (sized for the input and the workers) for 1 worker" in \
      single.stderr, single.stderr
  done = subprocess.run(_command(run, two_thousand, four, "--processes", "4", "--cpu_devices", "4"),
                        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr
  assert "2000 lines in 4 parts of 500 lines (sized for the input and the workers) for 4 workers" in \
      done.stderr, done.stderr
  decoded = re.findall(r"\[decode\] worker pid (\d+) decoded (\d+) parts? \[([\d, ]*)\]", done.stderr)
  assert len(decoded) == 4 and all(int(count) >= 1 for _, count, _ in decoded), done.stderr
  assert sorted(int(p) for *_, parts in decoded for p in parts.split(",")) == [0, 1, 2, 3]
  assert four.read_bytes() == one.read_bytes()
  assert len(one.read_text().splitlines()) == 2_000


def _fake_slurm(tmp_path, monkeypatch, listed: bool) -> pathlib.Path:
  """sbatch, squeue and sacct first on PATH: sbatch logs its calls and answers job 4242; squeue lists
  job 4242 while tmp_path/running exists; sacct fails, as on a cluster without accounting."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  scripts = {
      "sbatch": f'echo "$@" >> {tmp_path}/sbatch.log\necho "Submitted batch job 4242"',
      "squeue": f'if [ -e {tmp_path}/running ]; then echo 4242; fi',
      "sacct": 'echo "sacct: error: Slurm accounting storage is disabled" >&2\nexit 1',
  }
  for name, body in scripts.items():
    (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / name).chmod(0o755)
  if listed:
    (tmp_path / "running").touch()
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  from decode import __main__ as decode_cli, slurm_queue
  monkeypatch.setattr(slurm_queue, "EVERY", 0.0)
  monkeypatch.setattr(slurm_queue, "RETRIES", ())
  monkeypatch.setattr(decode_cli, "WATCH_SECONDS", 0.05)
  return tmp_path / "sbatch.log"


def _slurm_flags(run, source, out):  # noqa: F811
  return ["--workdir", str(run), "--input", str(source), "--output", str(out), "--no_progress",
          "--launcher", "slurm", "--processes", "2", "--time", "3"]


def test_the_slurm_launcher_ends_when_its_tasks_end_without_accounting(run, source, tmp_path, monkeypatch,  # noqa: F811
                                                                       capsys):
  sbatch = _fake_slurm(tmp_path, monkeypatch, listed=False)   # killed at the time limit: gone, no result
  out = tmp_path / "hyp.txt"
  with pytest.raises(SystemExit) as exit_info:
    decode_main(_slurm_flags(run, source, out))
  err = capsys.readouterr().err
  assert exit_info.value.code == 2, err
  assert len(sbatch.read_text().splitlines()) == 1
  assert "[decode] SLURM job 4242 has left the queue and none of its 2 tasks wrote its result" in err, err
  assert "no accounting on this cluster?" in err and "--time 3 minutes" in err
  assert f"{out} is not finished: rerun the same command" in err
  assert json.loads((job_lib.job_dir(out) / job_lib.LAUNCH).read_text())["job_id"] == "4242"


def test_a_second_slurm_launch_watches_the_running_job_instead_of_submitting(run, source, tmp_path,  # noqa: F811
                                                                             monkeypatch, capsys):
  sbatch = _fake_slurm(tmp_path, monkeypatch, listed=True)
  out = tmp_path / "hyp.txt"
  first = threading.Thread(target=lambda: pytest.raises(SystemExit, decode_main, _slurm_flags(run, source, out)))
  first.start()
  launch = job_lib.job_dir(out) / job_lib.LAUNCH
  deadline = time.time() + 60
  while not launch.exists():
    assert time.time() < deadline and first.is_alive()
    time.sleep(0.05)
  second = threading.Thread(target=lambda: pytest.raises(SystemExit, decode_main, _slurm_flags(run, source, out)))
  second.start()
  while "is already decoding" not in (err := capsys.readouterr().err):
    assert time.time() < deadline and second.is_alive(), err
    time.sleep(0.05)
  assert "SLURM job 4242, launched" in err and "watching it instead of launching again" in err
  assert first.is_alive() and second.is_alive()
  (tmp_path / "running").unlink()          # the job ends (its tasks killed): both launchers end
  first.join(timeout=60)
  second.join(timeout=60)
  assert not first.is_alive() and not second.is_alive()
  assert len(sbatch.read_text().splitlines()) == 1      # submitted once
  assert "SLURM job 4242 has ended and" in capsys.readouterr().err


def test_a_slurm_launch_is_refused_before_the_queue(run, source, tmp_path, monkeypatch, capsys):  # noqa: F811
  sbatch = _fake_slurm(tmp_path, monkeypatch, listed=False)
  out = tmp_path / "hyp.txt"
  cases = [
      (["--input", str(tmp_path / "missing.txt")], "missing.txt does not exist"),
      (["--workdir", str(tmp_path)], "config.json"),
      (["--checkpoint", "7"], "has no checkpoint for step 7; it has [5]"),
      (["--output", str(tmp_path / "nowhere" / "hyp.txt")], "does not exist; give an --output in a folder"),
      (["--gpus_per_task", "1"], "--gpus_per_task 1 asks for GPUs, but JAX_PLATFORMS=cpu leaves GPUs out"),
  ]
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  for flags, named in cases:
    with pytest.raises(SystemExit) as exit_info:
      decode_main(_slurm_flags(run, source, out) + flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in err and err.count("\n") == 1, err
  assert not sbatch.exists()


def test_a_second_local_launch_watches_the_running_launcher_and_starts_no_workers(run, source, tmp_path,  # noqa: F811
                                                                                  monkeypatch, capsys):
  from decode import __main__ as decode_cli
  monkeypatch.setattr(decode_cli, "WATCH_SECONDS", 0.05)
  out = tmp_path / "hyp.txt"
  directory = job_lib.job_dir(out)
  directory.mkdir()
  # A first launcher, still running on this host: a process that recorded its launch and sleeps.
  first = subprocess.Popen([sys.executable, "-c", "import sys, time; from decode import job; "
                            "job.record_launch(sys.argv[1], 'local', ['--processes', '2']); time.sleep(60)",
                            str(directory)], env=clean_env(PYTHONPATH=str(ROOT)), cwd=ROOT)
  while not (directory / job_lib.LAUNCH).exists():
    assert first.poll() is None
    time.sleep(0.05)
  threading.Timer(2.0, first.kill).start()
  with pytest.raises(SystemExit) as exit_info:
    decode_main(["--workdir", str(run), "--input", str(source), "--output", str(out), "--no_progress",
                 "--processes", "2"])
  first.wait()
  err = capsys.readouterr().err
  assert f"the launcher pid {first.pid} on" in err and "is already decoding" in err, err
  assert exit_info.value.code == 2 and f"has ended and {out} is not finished" in err
  assert not (directory / job_lib.MANIFEST).exists()     # no worker of its own started
