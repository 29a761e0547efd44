"""`python -m decode`: translate raw text with a trained run, and score it against a reference.

    python -m decode --workdir runs/default --input test.en --output test.hyp [--reference test.de]
    python -m decode --workdir runs/default --input mono.de --output mono.en --processes 4   # a corpus
    echo "the small dog sees a house." | python -m decode --workdir runs/default --input - --output -

A file --input to a file --output is decoded in shards of --shard_lines lines, each written whole into
OUTPUT.parts/ and joined in input order at the end (docs/bulk_decoding.md): the same command run again
takes up where a killed one stopped, and refuses to mix in other settings; several workers (--processes
K, the same command started K times, or --launcher slurm) share the shards. stdin or stdout: in memory.

Uses the run's config (architecture), vocab.model and its model: the newest checkpoint, or early
stopping's best (or --checkpoint STEP|averaged|latest|best);
a vocabulary that is not the one the checkpoint was trained with is refused. Output lines follow input
lines one to one (an empty input line gives an empty translation); the output file is written whole or
not at all. With --nbest K each input line gives K lines `LINE<TAB>RANK<TAB>SCORE<TAB>TRANSLATION`.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

from data import tasks
from decode import DEFAULTS
from decode import devices as devices_lib
from decode import job as job_lib
from decode import slurm_queue
from decode.progress import Progress
from run import devices as run_devices
from run.console import log_to_console
from run.user_errors import fail, reported

WATCH_SECONDS = 2.0   # how often a launcher polls the job's progress and its workers

def _read_lines(path: str, what: str) -> list[str]:
  if path == "-":
    return [line.rstrip("\r\n") for line in sys.stdin]
  file = pathlib.Path(path)
  if not file.is_file():
    fail(f"{what} {path!r} does not exist")
  try:
    return file.read_text(encoding="utf-8").splitlines()
  except UnicodeDecodeError as e:
    line = file.read_bytes()[:e.start].count(b"\n") + 1
    fail(f"{what} {path}: line {line} is not valid UTF-8; convert the file to UTF-8")


def _write_output(path: str, text: str) -> None:
  if path == "-":
    sys.stdout.write(text)
    sys.stdout.flush()
  else:
    from run.workdir import write_atomically
    write_atomically(path, text)


def use_cpu_devices(count: int) -> None:
  """Before JAX's backends start: one host (CPU) device per core, so that decoding's data parallelism uses
  every core (a decoding step is many small matmuls, which XLA runs on one core each). No effect on
  GPUs/TPUs, nor when XLA_FLAGS already sets the count or JAX has already run something (as in tests)."""
  if count <= 1 or "host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  import jax
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:   # the backends are already up: keep the devices they have
    pass


def main(argv=None) -> None:
  log_to_console()   # what run/ and data/ log while decoding
  with reported():   # user errors: one line `error: ...`, exit status 2
    _main(argv)


def _main(argv) -> None:
  parser = argparse.ArgumentParser(prog="python -m decode", description=__doc__.split("\n")[0],
                                   epilog=__doc__.split("\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="run directory written by `python -m train`")
  parser.add_argument("--checkpoint", default=None,
                      help="a step number, 'averaged', 'latest' or 'best' (default: the run's model, the "
                           "best dev loss's checkpoint for a run trained with early stopping, else the "
                           "latest)")
  parser.add_argument("--input", default=None, help="source text, one sentence per line ('-': stdin)")
  parser.add_argument("--prompt", default=None,
                      help="a language model (arch=decoder_only) run: continue this text instead of "
                           "translating --input; greedy, or sampled with --temperature and its flags")
  parser.add_argument("--output", default="-", help="translations ('-': stdout, the default)")
  parser.add_argument("--beam_size", type=int, default=None,
                      help="beam width (default: the run's config.decode.beam_size; the paper's is 4)")
  parser.add_argument("--alpha", type=float, default=None,
                      help="GNMT length penalty: log-probability / ((5 + length) / 6) ** alpha (Wu et al. "
                           "2016; not fairseq's --lenpen) (default: config.decode.alpha; the paper's is 0.6)")
  parser.add_argument("--max_extra_len", type=int, default=None,
                      help="at most source length + this many tokens (default: config.decode."
                           "max_extra_len; the paper's is 50)")
  parser.add_argument("--min_len", type=int, default=0, help="no eos before this many tokens")
  parser.add_argument("--batch_tokens", type=int, default=None,
                      help="rows * beam * padded source length per device of a batch (default: the run's "
                           "config.decode.batch_tokens; 0: the device's default, 4,096 on a CPU device, "
                           "65,536 on a GPU or TPU chip)")
  parser.add_argument("--nbest", type=int, default=1, help="write this many hypotheses per sentence")
  parser.add_argument("--temperature", type=float, default=None,
                      help="sample one translation per sentence at this temperature instead of beam "
                           "search (0: greedy)")
  parser.add_argument("--top_k", type=int, default=0, help="sampling: keep the k most probable tokens")
  parser.add_argument("--top_p", type=float, default=1.0, help="sampling: nucleus mass")
  parser.add_argument("--repetition_penalty", type=float, default=1.0, help="sampling: CTRL penalty")
  parser.add_argument("--seed", type=int, default=0, help="sampling: random seed")
  parser.add_argument("--cpu_devices", type=int, default=len(devices_lib.cpu_cores()),
                      help="on a CPU, split it into this many devices (default: one per core this process "
                           "may use); translate shares each batch's sentences out over all devices")
  parser.add_argument("--reference", default=None,
                      help="reference translations: print sacreBLEU (and the paper-style BLEU)")
  bulk = parser.add_argument_group("a file to a file, at any size (docs/bulk_decoding.md)")
  bulk.add_argument("--shard_lines", type=int, default=None,
                    help="input lines per part: each is translated, and written to OUTPUT.parts/, whole "
                         "(default: sized from the input's lines and the workers, at most 64 batches of "
                         "the shortest sentences or 10,000 lines: docs/bulk_decoding.md)")
  bulk.add_argument("--processes", type=int, default=1,
                    help="workers that share the parts, each pinned to its own share of this host's "
                         "devices: its GPU(s), its TPU chip, or on a CPU its cores and --cpu_devices / K "
                         "devices (with --launcher slurm: the job's tasks, over --nodes)")
  bulk.add_argument("--launcher", choices=("local", "slurm"), default="local",
                    help="where the --processes workers run: here, or as the tasks of one SLURM job")
  bulk.add_argument("--stale_after", type=float, default=600.0,
                    help="seconds after which a claim by a worker on another host that stopped "
                         "refreshing it is taken over (one on this host: as soon as its process ends)")
  bulk.add_argument("--no_progress", action="store_true", help="no progress bar")
  bulk.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)   # started by a launcher
  slurm = parser.add_argument_group("--launcher slurm (with submitit)")
  slurm.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
  slurm.add_argument("--nodes", type=int, default=1,
                     help="nodes of the job; the --processes tasks are spread evenly over them")
  slurm.add_argument("--time", type=int, default=60, help="time limit of the job in minutes")
  slurm.add_argument("--cpus_per_task", type=int, default=None,
                     help="CPUs per task (default: 4, or 4 per GPU with --gpus_per_task); on a CPU, a task "
                          "decodes on that many devices")
  slurm.add_argument("--gpus_per_task", type=int, default=0,
                     help="GPUs per task: 1 for one worker per GPU (default 0: CPU tasks)")
  slurm.add_argument("--sbatch", action="append", default=[], metavar="KEY[=VALUE]",
                     help="an extra #SBATCH option, e.g. --sbatch account=abc (repeatable)")
  args = parser.parse_args(argv)
  argv = sys.argv[1:] if argv is None else list(argv)
  if (args.input is None) == (args.prompt is None):
    parser.error("give exactly one of --input (translate) and --prompt (continue a text)")
  bulk_job = args.input not in (None, "-") and args.output != "-"
  if (args.shard_lines is not None and args.shard_lines < 1) or args.processes < 1:
    parser.error(f"need --shard_lines >= 1 and --processes >= 1 (got {args.shard_lines}, {args.processes})")
  if not args.worker and (args.nodes < 1 or args.processes % args.nodes):
    parser.error(f"--processes {args.processes} tasks do not spread evenly over --nodes {args.nodes}: give "
                 f"a multiple of --nodes (tasks per node x nodes)")
  if not args.worker and args.nodes > 1 and args.launcher != "slurm":
    parser.error("--nodes is for --launcher slurm; on this host, --processes K starts K workers")
  if not bulk_job and (args.processes > 1 or args.launcher == "slurm"):
    parser.error("--processes and --launcher share a job's parts through files: give a file --input and "
                 "a file --output")
  if bulk_job and not args.worker and (args.processes > 1 or args.launcher == "slurm"):
    _launch(args, argv)
    return
  if args.worker and args.launcher == "slurm":
    devices_lib.pin_slurm_task(args.gpus_per_task)   # before JAX starts: this task's own GPUs
  use_cpu_devices(args.cpu_devices)
  # JAX reads the device count when it starts: import what pulls it in only now.
  import run
  from decode.translate import translate
  try:
    args.checkpoint = run.checkpoint_arg(args.checkpoint)
  except argparse.ArgumentTypeError as error:
    parser.error(str(error))
  run_config = run.load_run_config(args.workdir)   # a wrong run directory: one line, status 2
  task = tasks.task_of(run_config.data)
  if args.input is not None and not tasks.translates(run_config.data):
    fail(f"--input translates, but {args.workdir} was trained with config.data.task={task!r}"
         + (": continue a text with --prompt instead" if task == "lm" else ""))
  run_decode = run_config.decode
  for key, fallback in DEFAULTS.items():
    if getattr(args, key) is None:
      setattr(args, key, type(fallback)(run_decode.get(key, fallback)))
  if args.beam_size < 1 or not 1 <= args.nbest <= args.beam_size:
    parser.error(f"need beam_size >= 1 and 1 <= nbest <= beam_size (got {args.beam_size}, {args.nbest})")
  sampling = None
  if args.temperature is not None:
    if args.nbest != 1:
      parser.error("--temperature samples one translation per sentence: drop --nbest")
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty)

  if args.prompt is not None:
    _continue_prompt(run, args)
    return
  if bulk_job:
    _decode_job(run, args, sampling)
    return
  sources = _read_lines(args.input, "--input")
  references = _read_lines(args.reference, "--reference") if args.reference else None
  if references is not None and len(references) != len(sources):
    fail(f"--reference {args.reference} has {len(references)} lines but --input "
                     f"{args.input} has {len(sources)}; they must be line-aligned")

  opened = run.load_run(args.workdir, args.checkpoint)
  step = opened.step
  batch_tokens = args.batch_tokens
  where = f"{args.workdir} step {step}" + (" (averaged)" if args.checkpoint == "averaged" else "")
  how = (f"beam {args.beam_size}, alpha {args.alpha}" if sampling is None else
         f"sampling {sampling}, seed {args.seed}")
  print(f"[decode] {len(sources)} sentences with {where}, {how}", file=sys.stderr)
  out = translate(opened.model, opened.params, opened.vocab, sources, beam_size=args.beam_size, alpha=args.alpha,
                  max_extra_len=args.max_extra_len, batch_tokens=batch_tokens, nbest=args.nbest,
                  min_len=args.min_len, sampling=sampling, seed=args.seed, progress=True,
                  source_eos=bool(opened.config.data.get("source_eos", False)))
  if args.nbest == 1:
    hyps, text = out, "".join(h + "\n" for h in out)
  else:
    hyps = [h[0][0] for h in out]
    text = "".join(f"{i}\t{rank}\t{score:.4f}\t{hyp}\n" for i, hyp_list in enumerate(out, 1)
                   for rank, (hyp, score) in enumerate(hyp_list, 1))
  _write_output(args.output, text)
  if references is not None:
    _print_scores(hyps, references, run_config.data.tgt_lang)


def _settings(args, sampling, opened) -> dict:
  """translate's keyword arguments: every decoding setting the output depends on (the manifest's)."""
  return dict(beam_size=args.beam_size, alpha=args.alpha, max_extra_len=args.max_extra_len,
              batch_tokens=args.batch_tokens, nbest=args.nbest, min_len=args.min_len, sampling=sampling,
              seed=args.seed if sampling is not None else 0,
              source_eos=bool(opened.config.data.get("source_eos", False)))


def _check_reference(args, lines: int) -> None:
  """Before any work: --reference must have as many lines as --input."""
  if not args.reference:
    return
  references = job_lib.count_lines(args.reference, "--reference")
  if references != lines:
    fail(f"--reference {args.reference} has {references} lines but --input {args.input} has {lines}; "
         f"they must be line-aligned")


def _decode_job(run, args, sampling) -> None:
  """A file to a file, in parts (decode/bulk.py): this process is one worker of the job."""
  import jax

  from decode import bulk, device_batch_tokens
  if args.worker:   # what this worker runs on: its share of the host (decode/devices.py)
    # One write: the workers share the launcher's stderr, and print() writes the text and its newline
    # separately (unbuffered under PYTHONUNBUFFERED), so two workers' lines could run together.
    sys.stderr.write(f"[decode] {devices_lib.worker_report(jax.local_devices())}\n")
    sys.stderr.flush()
  per_device = device_batch_tokens(args.batch_tokens, jax.local_devices()[0].platform)
  shard_lines = args.shard_lines   # a launcher's workers are given the launcher's
  if shard_lines is None:
    lines = job_lib.count_lines(args.input, "--input")
    shard_lines = bulk.shard_lines_for(lines, 1, bulk.default_shard_lines(per_device, args.beam_size))
  scanned = job_lib.scan_input(args.input, shard_lines)
  _check_reference(args, scanned["lines"])
  opened = run.load_run(args.workdir, args.checkpoint)
  settings = _settings(args, sampling, opened)
  job = job_lib.open_job(args.output, bulk.manifest(opened, settings, scanned, pathlib.Path(args.workdir),
                                                    args.checkpoint))
  if not args.worker:
    print(f"{bulk.parts_line(job.lines, job.shard_lines, 1, args.shard_lines is not None)}, with "
          f"{args.workdir} step {opened.step}: {job.num_parts - len(job.parts_left())} parts done before",
          file=sys.stderr)
  progress = Progress(args.output, enabled=not (args.worker or args.no_progress))
  progress.poll()
  mine = bulk.work(job, opened, settings, stale_after=args.stale_after, on_part=lambda _: progress.poll())
  if args.worker:   # in one write, as the report above
    sys.stderr.write(f"[decode] worker pid {os.getpid()} decoded {len(mine)} part{'s' if len(mine) != 1 else ''} "
                     f"{sorted(s['part'] for s in mine)} ({sum(s['lines'] for s in mine)} lines)\n")
    sys.stderr.flush()
  summary = progress.summary()
  if not args.worker:
    print(summary, file=sys.stderr)
    _score(args)


def _launch(args, argv) -> None:
  """--processes K workers here, or the K tasks of a SLURM job; shows the job's progress from its
  directory until they end. One worker's death does not stop the others; the parts it held are taken
  over by those left, or by the next run of the same command. A launch of the same job that is still
  running (OUTPUT.parts/launch.json) is watched instead of launched again."""
  run_config, lines = _check_before_launch(args)
  command = [sys.executable, "-m", "decode", *argv, "--worker", "--processes", "1"]
  shard_lines = args.shard_lines or _shard_lines(args, run_config, lines)
  if args.shard_lines is None:   # every worker must make the same parts
    command += ["--shard_lines", str(shard_lines)]
  from decode import bulk
  print(bulk.parts_line(lines, shard_lines, args.processes, args.shard_lines is not None), file=sys.stderr)
  directory = job_lib.job_dir(args.output)
  directory.mkdir(parents=True, exist_ok=True)
  progress = Progress(args.output, enabled=not args.no_progress)
  with job_lib.launch_lock(directory):
    earlier = _running_launch(args, directory)
    if earlier is None and args.launcher == "local":
      workers = _start_workers(args, command)
      job_lib.record_launch(directory, "local", argv)
    elif earlier is None:
      handle = _submit(args, command)
      job_lib.record_launch(directory, "slurm", argv, job_id=str(handle.job_id))
  if earlier is not None:
    _watch(args, earlier, progress)
    return
  if args.launcher == "local":
    while any(w.poll() is None for w in workers):
      progress.poll()
      time.sleep(WATCH_SECONDS / 4)
    failed = [f"worker {i} (pid {w.pid}): exit status {w.returncode}" for i, w in enumerate(workers)
              if w.returncode != 0]
  else:
    failed = _wait_for_slurm(args, handle, progress)
  summary = progress.summary()
  print(summary, file=sys.stderr)
  if failed and progress.job is not None and progress.job.joined():
    print(f"[decode] {len(failed)} of {args.processes} workers failed ({'; '.join(failed)[:300]}); the "
          f"others took over their parts", file=sys.stderr)
  if progress.job is None or not progress.job.joined():
    fail(f"{len(failed)} of {args.processes} workers failed ({'; '.join(failed)[:300]}) and "
         f"{args.output} is not finished: rerun the same command to translate the parts left")
  _score(args)


def _check_before_launch(args):
  """What can be checked before any worker starts or a job waits in the queue: the run (its config,
  vocabulary and the checkpoint asked for), the input, the reference, that the output's folder is
  writable, and that GPUs asked for are not excluded by JAX_PLATFORMS. A mistake is one line, and nothing
  starts. Returns (the run's config, the input's line count)."""
  import run
  from run import checkpoint as ckpt
  try:
    checkpoint = run.checkpoint_arg(args.checkpoint)
  except argparse.ArgumentTypeError as error:
    fail(str(error))
  directory = ckpt.AVERAGED if checkpoint == "averaged" else ckpt.CHECKPOINTS
  with run.RunDir(args.workdir) as run_dir:
    run_config = run_dir.config()
    if not tasks.translates(run_config.data):
      fail(f"--input translates, but {args.workdir} was trained with config.data.task="
           f"{tasks.task_of(run_config.data)!r}")
    run_dir.vocab()
    ckpt.check_readable(run_dir.path / directory)
    steps = run_dir.steps(directory)
  where = pathlib.Path(args.workdir) / directory
  if not steps:
    fail(f"{where} holds no complete checkpoint: nothing to decode with")
  if type(checkpoint) is int and checkpoint not in steps:
    fail(f"{where} has no checkpoint for step {checkpoint}; it has {steps}: pass one of those to "
         f"--checkpoint, or none for the run's model")
  lines = job_lib.count_lines(args.input, "--input")
  _check_reference(args, lines)
  folder = pathlib.Path(args.output).absolute().parent
  if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
    fail(f"--output {args.output}: its folder {folder} {'is not writable' if folder.is_dir() else 'does not exist'}"
         f"; give an --output in a folder you can write")
  _check_platforms(args)
  return run_config, lines


def _check_platforms(args) -> None:
  """GPUs asked for (--gpus_per_task) while JAX_PLATFORMS, which sbatch passes on to the job, leaves
  them out: the tasks would decode on the CPU (run/devices.py's check, as jobs.submit's)."""
  if args.launcher != "slurm" or not args.gpus_per_task:
    return
  problem = run_devices.gpu_platform_problem(f"--gpus_per_task {args.gpus_per_task} asks for GPUs")
  if problem:
    fail(f"{problem} (sbatch passes this shell's JAX_PLATFORMS on to the tasks)")


def _shard_lines(args, run_config, lines: int) -> int:
  """The launcher's part size (decode/bulk.py's shard_lines_for), from the devices a worker will have:
  a GPU (--gpus_per_task, or this host's for local workers) or a CPU device."""
  from decode import bulk, device_batch_tokens
  beam_size = args.beam_size or int(run_config.decode.get("beam_size", DEFAULTS["beam_size"]))
  batch_tokens = args.batch_tokens
  if batch_tokens is None:
    batch_tokens = int(run_config.decode.get("batch_tokens", DEFAULTS["batch_tokens"]))
  if args.launcher == "slurm":
    platform = "gpu" if args.gpus_per_task else "cpu"
  else:
    platform = devices_lib.host_devices()[0]
  most = bulk.default_shard_lines(device_batch_tokens(batch_tokens, platform), beam_size)
  return bulk.shard_lines_for(lines, args.processes, most)


def _running_launch(args, directory) -> dict | None:
  """The record of an earlier launch of this job that still runs: a SLURM job that squeue lists, or a
  launcher on this host whose process is alive; else None. A squeue that does not answer is not read as
  the job's end: nothing is submitted (one line naming the job)."""
  record = job_lib.read_launch(directory)
  if record is None:
    return None
  if record["launcher"] == "slurm":
    listed = slurm_queue.ask(record["job_id"])
    if listed is None:
      fail(f"SLURM does not answer (squeue --jobs {record['job_id']} fails), and job {record['job_id']}, "
           f"launched {record['time']} for {args.output}, may still be decoding it: nothing submitted; "
           f"rerun once squeue answers")
    return record if listed else None
  # A launcher on another host cannot be asked: workers started here share its parts.
  return record if job_lib.process_alive(record["host"], record["pid"], record.get("start")) else None


def _watch(args, earlier: dict, progress: Progress) -> None:
  """Follows an earlier launch of this job until it ends, instead of launching again."""
  what = (f"SLURM job {earlier['job_id']}" if earlier["launcher"] == "slurm" else
          f"the launcher pid {earlier['pid']} on {earlier['host']}")
  print(f"[decode] {what}, launched {earlier['time']}, is already decoding {args.output}: watching it "
        f"instead of launching again (its command: {' '.join(earlier['command'])[:300]})", file=sys.stderr)
  if earlier["launcher"] == "slurm":
    queue = slurm_queue.Queue(earlier["job_id"])
    running = lambda: not queue.ended()  # noqa: E731
  else:
    running = lambda: job_lib.process_alive(earlier["host"], earlier["pid"], earlier.get("start"))  # noqa: E731
  progress.poll()
  while running() and not (progress.job is not None and progress.job.joined()):
    time.sleep(WATCH_SECONDS)
    progress.poll()
  print(progress.summary(), file=sys.stderr)
  if progress.job is None or not progress.job.joined():
    fail(f"{what} has ended and {args.output} is not finished: rerun the same command to translate the "
         f"parts left")
  _score(args)


def _submit(args, command):
  """Submits the job's tasks (decode/slurm.py); returns submitit's handle."""
  from decode import slurm
  cpus = args.cpus_per_task or slurm.default_cpus_per_task(args.gpus_per_task)
  # One CPU device per core the task is given, not per core of the node.
  command = command + ["--cpu_devices", str(cpus)]
  handle = slurm.submit(command, job_lib.job_dir(args.output), nodes=args.nodes,
                        tasks_per_node=args.processes // args.nodes, partition=args.partition,
                        time_minutes=args.time, cpus_per_task=cpus, gpus_per_task=args.gpus_per_task,
                        sbatch=args.sbatch)
  print(f"[decode] submitted SLURM job {handle.job_id} ({args.processes} tasks on {args.nodes} "
        f"node{'s' if args.nodes > 1 else ''}); its logs: {job_lib.job_dir(args.output) / slurm.FOLDER}",
        file=sys.stderr)
  return handle


def _wait_for_slurm(args, handle, progress: Progress) -> list[str]:
  """Waits until submitit says the job is done (its tasks' results, or sacct) or squeue no longer lists
  it (a cluster without accounting, where sacct never says); returns the tasks' errors."""
  queue = slurm_queue.Queue(handle.job_id)
  while not handle.done() and not queue.ended():
    progress.poll()
    time.sleep(WATCH_SECONDS)
  failed = [error for error in map(lambda t: _task_error(handle, t), range(args.processes)) if error]
  if len(failed) == args.processes and all("wrote no result" in error for error in failed):
    print(f"[decode] SLURM job {handle.job_id} has left the queue and none of its {args.processes} tasks "
          f"wrote its result: they were killed (the time limit, --time {args.time} minutes; memory; a node), "
          f"and sacct gives no state for the job (no accounting on this cluster?); their logs: "
          f"{job_lib.job_dir(args.output) / 'slurm'}", file=sys.stderr)
  return failed


def _start_workers(args, command) -> list[subprocess.Popen]:
  """--processes K on this host: K workers, each pinned to its own share of the host's devices before
  it starts JAX (decode/devices.py): its GPU(s) or TPU chip, seen alone; on a CPU, its cores as its
  affinity and its part of the CPU devices."""
  kind, ids = devices_lib.host_devices()
  try:
    shares = devices_lib.split(kind, ids, args.processes)
  except ValueError as error:
    fail(str(error))
  cpu_devices = devices_lib.cpu_device_count(args.cpu_devices)
  base, extra = divmod(cpu_devices, args.processes)
  per_worker = [max(1, base + (index < extra)) for index in range(args.processes)]
  cores = kind == "cpu" and len(ids) >= args.processes   # else they share the cores
  what = "cores" if kind == "cpu" else kind.upper() + "s"
  print(f"[decode] {args.processes} workers on this host's {len(ids)} {what}: "
        + "; ".join(",".join(share) for share in shares), file=sys.stderr)
  workers = []
  for index, share in enumerate(shares):
    env = devices_lib.share_env(kind, share, os.environ, index=index, cpu_devices=per_worker[index])
    affinity = {int(core) for core in share} if cores else None
    workers.append(subprocess.Popen(
        command + ["--cpu_devices", str(per_worker[index])], env=env,
        preexec_fn=(lambda cpus=affinity: os.sched_setaffinity(0, cpus)) if affinity else None))
  return workers


def _task_error(handle, task: int) -> str | None:
  """What a finished task of the SLURM job failed with, or None. A task without a result file was killed
  (submitit's result() would wait for sacct, which may never answer)."""
  if not handle.task(task).paths.result_pickle.exists():
    return f"task {task}: wrote no result (killed?)"
  try:
    handle.task(task).result()
  except Exception as error:  # noqa: BLE001 - submitit raises what the task raised, or its own errors
    return f"task {task}: {' '.join(str(error).split())[:200]}"
  return None


def _score(args) -> None:
  """--reference: sacreBLEU and paper-style BLEU of the output (of its best hypotheses, with --nbest)."""
  if not args.reference:
    return
  import run
  lines = job_lib.read_shard(args.output, 0, -1)
  hyps = lines if args.nbest == 1 else [line.split("\t", 3)[3] for line in lines[::args.nbest]]
  references = job_lib.read_shard(args.reference, 0, -1)
  _print_scores(hyps, references, run.load_run_config(args.workdir).data.tgt_lang)


def _print_scores(hyps, references, lang: str) -> None:
  """Both BLEUs with their signatures: sacreBLEU (report this) and the paper's tokenized, compound-split
  BLEU (compare this with the paper's tables; decode/bleu.py)."""
  from decode.bleu import paper_bleu_score, sacrebleu_score
  score, signature = sacrebleu_score(hyps, references)
  print(f"sacreBLEU {score:.2f}  {signature}", file=sys.stderr)
  score, signature = paper_bleu_score(hyps, references, lang)
  print(f"paper-style BLEU (Moses-tokenized, compound-split, multi-bleu.perl) {score:.2f}  {signature}",
        file=sys.stderr)


def _continue_prompt(run, args) -> None:
  """--prompt: BOS + the prompt's pieces, a cached prefill, then greedy or sampled continuation."""
  import jax
  import jax.numpy as jnp

  from data.vocab import BOS
  from decode.prompt import prompt_sample
  opened = run.load_run(args.workdir, args.checkpoint)
  if opened.model.cfg.arch != "decoder_only":
    fail(f"--prompt needs a language model (config.model.arch='decoder_only'); {args.workdir} has "
         f"arch={opened.model.cfg.arch!r}: translate with --input instead")
  ids = [BOS] + opened.vocab.encode(args.prompt)
  if len(ids) + args.max_extra_len > opened.model.cfg.max_len and opened.model.cfg.positions == "learned":
    fail(f"--prompt of {len(ids)} pieces + --max_extra_len {args.max_extra_len} exceeds the model's "
         f"learned positions ({opened.model.cfg.max_len})")
  seqs, _ = prompt_sample(opened.model, opened.params, jnp.asarray([ids], jnp.int32),
                          jax.random.key(args.seed), max_len=args.max_extra_len,
                          temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p,
                          repetition_penalty=args.repetition_penalty)
  _write_output(args.output, args.prompt + " " + opened.vocab.decode([int(t) for t in seqs[0]]) + "\n")


if __name__ == "__main__":
  main()
