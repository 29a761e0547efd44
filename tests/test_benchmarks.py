"""The benchmark harness: each system in a process of its own, the results' structure, the generated page."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import textwrap

import pytest

from benchmarks import harness, report, throughput
from run import devices

TINY = ["--d_model", "32", "--num_layers", "1", "--num_heads", "2", "--d_ff", "64", "--vocab", "300",
        "--batch", "4", "--src_len", "8", "--tgt_len", "8", "--decode_batch", "4", "--decode_len", "8",
        "--beam_size", "2", "--repeats", "1", "--warmup", "0", "--pause", "0"]
PEERS = ["torch", "torch_bf16", "torch_compile", "torch_compile_bf16", "hf", "hf_compile", "ct2", "ct2_avx2",
         "ct2_int8"]

FAKE_SYSTEM = textwrap.dedent("""
    import os, time
    from benchmarks import worker

    def setup(spec):
      print("a library that prints to stdout")      # must not break the protocol
      if spec.get("absent"):
        import a_module_that_is_not_installed
      if spec.get("fail"):
        raise ValueError("bad setup")
      tasks = {"nap": lambda: time.sleep(0.01)}
      if spec.get("crash"):
        tasks["nap"] = lambda: os._exit(3)
      return tasks, {"greeting": "hi"}

    if __name__ == "__main__":
      worker.serve(setup)
""")


def test_harness_runs_each_system_in_its_own_process(tmp_path, monkeypatch):
  (tmp_path / "fake_system.py").write_text(FAKE_SYSTEM)
  monkeypatch.setenv("PYTHONPATH", str(tmp_path))
  workers = [harness.Worker("a", "fake_system", {}), harness.Worker("b", "fake_system", {}),
             harness.Worker("gone", "fake_system", {"absent": True}),
             harness.Worker("broken", "fake_system", {"fail": True}),
             harness.Worker("crash", "fake_system", {"crash": True})]
  harness.start(workers, tmp_path, timeout=120)
  try:
    times = harness.round_robin(workers, "nap", warmup=1, repeats=3, pause=0)
  finally:
    harness.close(workers)
  assert set(times) == {"a", "b"} and all(len(t) == 3 and min(t) >= 0.01 for t in times.values())
  pids = {w.pid for w in workers[:2]}
  assert len(pids) == 2 and os.getpid() not in pids
  assert workers[0].info == {"greeting": "hi"}
  assert workers[2].status == "absent" and "a_module_that_is_not_installed" in workers[2].reason
  assert workers[3].status == "failed" and workers[3].reason == "ValueError: bad setup"
  assert workers[4].status == "failed" and "exited with code 3" in workers[4].reason
  stats = harness.summary([3.0, 1.0, 2.0])
  assert (stats["median_s"], stats["min_s"], stats["max_s"]) == (2.0, 1.0, 3.0)


def _pids(result: dict) -> list[int]:
  rows = list(result.get("peak", {}).values()) + list(result.get("train", {}).get("systems", {}).values())
  decode = result.get("decode", {})
  seen = {}
  for task in ("greedy", "beam"):
    for name, row in decode.get(task, {}).get("systems", {}).items():
      seen[name] = row                 # one process serves both of a system's decoding tasks
  return [row["pid"] for row in rows + list(seen.values()) if row.get("pid")]


def _run(tmp_path, skip, extra=()) -> dict:
  out = tmp_path / "throughput.json"
  throughput.main(TINY + ["--skip", ",".join(skip), "--out", str(out), *extra])
  result = json.loads(out.read_text())
  for key in ("date", "machine", "versions", "args", "model", "peak", "train", "decode"):
    assert key in result or key in skip, key
  assert "avx512_bf16" in result["machine"] and result["machine"]["cpu"]
  pids = _pids(result)
  assert len(pids) == len(set(pids)) and result["harness_pid"] not in pids
  assert result["harness_pid"] == os.getpid()
  return result


def _peers_installed() -> bool:
  try:
    import ctranslate2, torch, transformers  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
  """(result, the baseline checkout) of one throughput run that three tests read: ours with its peak, the
  peers where the interop extra is installed, and a copy of this checkout as --baseline. One run of each
  system instead of one per test; the bfloat16 systems and hf_compile are left out (--skip)."""
  tmp_path = tmp_path_factory.mktemp("throughput")
  repo = pathlib.Path(__file__).resolve().parents[1]
  baseline = tmp_path / "baseline"
  for package in repo.iterdir():   # the Python packages are what a worker imports
    if (package / "__init__.py").exists():
      shutil.copytree(package, baseline / package.name, ignore=shutil.ignore_patterns("__pycache__"))
  skip = ["ours_bf16", "torch_bf16", "torch_compile", "torch_compile_bf16", "hf_compile"]
  if not _peers_installed():
    skip += [name for name in PEERS if name not in skip]
  return _run(tmp_path, skip, ["--baseline", str(baseline)]), baseline


@pytest.mark.slow
def test_throughput_ours_alone(shared_run):
  result, _ = shared_run
  assert result["peak"]["float32"]["gflops"] > 0 and result["peak"]["bfloat16"]["gflops"] > 0
  ours = result["train"]["systems"]["ours"]
  assert ours["status"] == "ready" and ours["runs"] == 1 and ours["tokens_per_s"] > 0
  assert ours["min_s"] <= ours["median_s"] <= ours["max_s"]
  assert result["train"]["target_tokens"] == 4 * 8
  for task in ("greedy", "beam"):
    row = result["decode"][task]["systems"]["ours"]
    assert row["tokens_per_s"] > 0 and row["info"][task]["devices"] == devices.usable_cpus()
    assert result["decode"][task]["systems"]["ours_bf16"]["status"] == "skipped"
  assert result["train"]["systems"]["ours"]["info"]["devices"] == 1
  page = report.render_run(result)
  assert "ours, float32" in page and "% of f32 peak" in page and "skipped: --skip" in page


@pytest.mark.slow
def test_throughput_peers_each_in_own_process(shared_run):
  for name in ("torch", "transformers", "ctranslate2"):
    pytest.importorskip(name)
  result, _ = shared_run
  systems = result["train"]["systems"]
  assert systems["torch"]["status"] == "ready", systems["torch"]
  assert "ours/torch" in result["train"]["ratios"]
  greedy = result["decode"]["greedy"]
  for name in ("hf", "ct2", "ct2_int8"):
    assert greedy["systems"][name]["status"] == "ready", greedy["systems"][name]
    assert f"ours/{name}" in greedy["ratios"]
  assert greedy["systems"]["ct2_int8"]["info"]["compute_type"] == "int8_float32"
  # CTranslate2 float32 twice: as installed, and with oneDNN capped at AVX2; ct2_best is the faster of the
  # two in each round, and the ratio the targets use.
  assert greedy["systems"]["ct2"]["info"]["onednn_max_cpu_isa"] == "native"
  assert greedy["systems"]["ct2_avx2"]["info"]["onednn_max_cpu_isa"] == "AVX2"
  for task in ("greedy", "beam"):
    part = result["decode"][task]["systems"]
    best = part["ct2_best"]
    assert best["best_of"] == ["ct2", "ct2_avx2"]
    assert best["seconds"] == [min(a, b) for a, b in zip(part["ct2"]["seconds"], part["ct2_avx2"]["seconds"])]
    assert "ours/ct2_best" in result["decode"][task]["ratios"]
  assert "the faster of the two in each round" in report.render_run(result)


def test_isa_option_names_its_results_file_and_caps_xla():
  assert throughput.parse_args([]).out.endswith("results/throughput.json")
  assert throughput.parse_args(["--isa", "avx2"]).out.endswith("results/throughput-avx2.json")
  assert throughput.parse_args(["--preset", "default", "--isa", "avx2"]).out.endswith(
      "results/throughput-default-avx2.json")
  flags = throughput.xla_env(2, "avx2")["XLA_FLAGS"].split()
  assert "--xla_cpu_max_isa=AVX2" in flags and "--xla_force_host_platform_device_count=2" in flags
  assert "xla_cpu_max_isa" not in throughput.xla_env(1)["XLA_FLAGS"]


def test_best_of_takes_the_faster_setting_in_each_round():
  times = {"ours": [1.0, 1.0, 1.0], "ct2": [3.0, 2.0, 4.0], "ct2_avx2": [2.5, 2.2, 3.0]}
  best = throughput.best_of(times)
  assert best["ct2_best"] == [2.5, 2.0, 3.0] and best["ct2"] == times["ct2"]
  assert throughput.ratios(best, [("ours", "ct2_best")])["ours/ct2_best"]["of_medians"] == 2.5
  assert "ct2_best" not in throughput.best_of({"ct2": [3.0]})                  # ct2_avx2 skipped
  assert "ct2_best" not in throughput.best_of({"ct2": [3.0], "ct2_avx2": []})   # ct2_avx2 failed


def test_decode_devices_option_names_its_results_file_and_refuses_zero(capsys):
  assert throughput.parse_args(["--decode_devices", "1"]).out.endswith("results/throughput-1device.json")
  assert throughput.parse_args(["--preset", "default", "--isa", "avx2", "--decode_devices", "2"]).out.endswith(
      "results/throughput-default-avx2-2device.json")
  assert throughput.parse_args([]).decode_devices is None
  with pytest.raises(SystemExit):
    throughput.parse_args(["--decode_devices", "0"])
  assert "--decode_devices 0: give 1 or more devices" in capsys.readouterr().err


@pytest.mark.slow
def test_throughput_isa_avx2_caps_every_system(tmp_path):
  """--isa avx2: each worker reports the cap it ran under (our C++ kernels rebuilt for x86-64-v3, whose
  panels are two 8-float registers wide), the bfloat16 systems are left out, and the page says so."""
  for name in ("torch", "ctranslate2"):
    pytest.importorskip(name)
  out = tmp_path / "throughput.json"
  throughput.main(TINY + ["--isa", "avx2", "--decode_devices", "1", "--out", str(out), "--skip",
                          ",".join(n for n in PEERS + ["peak"] if n not in ("torch", "ct2", "ct2_avx2"))])
  result = json.loads(out.read_text())
  ours = result["decode"]["greedy"]["systems"]["ours"]["info"]
  assert "--xla_cpu_max_isa=AVX2" in ours["xla_flags"] and ours["panel_width"] == 16
  assert ours["devices"] == 1 and "host_platform_device_count" not in ours["xla_flags"]   # --decode_devices 1
  assert "ours decoding on 1 device (--decode_devices 1)" in report.render_run(result)
  assert result["train"]["systems"]["torch"]["info"]["cpu_capability"] == "AVX2"
  assert result["decode"]["greedy"]["systems"]["ct2"]["info"]["isa"] == "AVX2"
  assert result["decode"]["greedy"]["systems"]["ct2"]["status"] == "ready"
  assert result["decode"]["greedy"]["systems"]["ct2_avx2"]["reason"].startswith("--isa caps ct2 itself")
  for part in (result["train"], result["decode"]["greedy"]):   # bfloat16 would keep AVX512-BF16 in XLA
    assert part["systems"]["ours_bf16"]["status"] == "skipped"
    assert part["systems"]["ours_bf16"]["reason"].startswith("--isa")
  assert "capped at AVX2" in report.render_run(result)


@pytest.mark.slow
def test_throughput_baseline_checkout_runs_in_the_same_rounds_from_its_own_code(shared_run, tmp_path):
  result, baseline = shared_run
  repo = pathlib.Path(__file__).resolve().parents[1]
  for part in (result["train"], result["decode"]["greedy"], result["decode"]["beam"]):
    ours, base = part["systems"]["ours"], part["systems"]["ours_baseline"]
    assert ours["info"]["code"] == str(repo) and base["info"]["code"] == str(baseline.resolve())
    assert ours["runs"] == base["runs"] == 1 and ours["pid"] != base["pid"]
    assert "ours/ours_baseline" in part["ratios"]
  assert "--baseline checkout" in report.render_run(result)
  with pytest.raises(SystemExit, match="not a checkout"):
    throughput.main(TINY + ["--baseline", str(tmp_path / "nothing"), "--out", str(tmp_path / "t.json")])


@pytest.mark.slow
def test_decode_anatomy_times_every_variant_in_its_own_process_and_the_pair_at_once(tmp_path):
  from benchmarks import decode_anatomy
  if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("needs 2 CPUs: one process pinned to each of CPUs 0 and 1 at the same moment")
  out = tmp_path / "anatomy.json"
  result = decode_anatomy.main(["--preset", "tiny", "--repeats", "2", "--warmup", "1", "--decode_len", "6",
                                "--pause", "0", "--out", str(out)])
  assert json.loads(out.read_text()) == result
  assert result["model"]["d_model"] == 32   # --preset tiny
  variants = result["variants"]
  assert set(variants) == {"full", "no_self", "no_cross", "output_eighth", "one_device", "one_core",
                           "two_at_once"}
  assert all(v["runs"] == 2 and v["median_s"] > 0 for v in variants.values())
  assert [variants[n]["info"]["ablate"] for n in ("full", "no_self", "no_cross", "output_eighth")] == [
      None, "self", "cross", "output"]
  half = 16 // devices.usable_cpus()
  assert variants["one_core"]["info"]["cpus"] == [0] and variants["one_core"]["info"]["rows"] == half
  assert [i["cpus"] for i in variants["two_at_once"]["info"]] == [[0], [1]]
  assert [variants[n]["info"]["beam"]["devices"] for n in ("full", "one_device", "one_core")] == [
      devices.usable_cpus(), 1, 1]
  assert variants["one_device"]["info"]["rows"] is None and variants["one_device"]["info"]["cpus"] is None
  assert 0 < result["derived"]["two_at_once_over_one_core"] and 0 < result["derived"]["one_device_over_full"]
  assert "shares of the full step" in report.render_anatomy(result)
  assert "one device over full" in report.render_anatomy(result)


def test_performance_page_shows_every_results_file_and_its_ratios():
  """docs/performance.md has a section for each results file, with its date and ratios, no section for
  a file that is gone, and a link to the record of speed changes; it stays short."""
  page = pathlib.Path(report.PAGE).read_text()
  stale = "docs/performance.md is stale: run `python -m benchmarks.report`"
  names = sorted(p.name for p in report.RESULTS.glob("*.json"))
  assert sorted(set(re.findall(r"\]\(\.\./benchmarks/results/([^)]+\.json)\)", page))) == names, stale
  for name in names:
    result = json.loads((report.RESULTS / name).read_text())
    assert result.get("date", "(undated)") in page, (name, stale)
    for task in ("greedy", "beam"):
      ratio = result.get("decode", {}).get(task, {}).get("ratios", {}).get("ours/ct2")
      if ratio:
        assert f"{ratio['of_medians']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" in page, (name, stale)
  assert "[benchmarks/changes.md](../benchmarks/changes.md)" in page, stale
  assert len(page.splitlines()) <= 250


def test_docs_quote_the_tables_generated_from_their_results_files():
  """Every `<!-- table NAME: PATH -->` block of a page in docs/ is what benchmarks.report makes of PATH, and
  every table the generator knows is quoted somewhere."""
  used = set()
  for page in sorted((report.REPO / "docs").rglob("*.md")):
    text = page.read_text()
    used |= set(re.findall(r"<!-- table (\w+): ", text))
    assert report.render_docs_page(text) == text, f"{page.name} is stale: run `python -m benchmarks.report --docs`"
  assert used == set(report.DOC_TABLES)


@pytest.mark.slow
def test_trees_times_each_checkout_in_turn_and_writes_the_ratio(tmp_path, capsys):
  """Two checkouts (here the same one twice) trained round-robin in fresh processes: one speed per run
  and round, the first (compiling) log interval dropped, ratios computed within each round."""
  from benchmarks import trees
  repo = pathlib.Path(__file__).resolve().parents[1]
  out = tmp_path / "trees.json"
  trees.main(["--trees", str(repo), str(repo), "--rounds", "2", "--steps", "6", "--log_every", "2",
              "--out", str(out), "--config=experiments/default.py:smoke"])
  result = json.loads(out.read_text())
  assert [len(t["tokens_per_s"]) for t in result["trees"]] == [2, 2]
  assert all(s > 0 for t in result["trees"] for s in t["tokens_per_s"])
  ratio = result["ratio_after_over_before"]
  assert len(ratio["per_round"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
  assert "after / before" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    trees.main(["--trees", str(repo), str(tmp_path), "--rounds", "1"])   # not a checkout


def test_kv_cache_benchmark_times_each_variant_every_round_and_sizes_the_cache():
  from benchmarks import kv_cache
  results = kv_cache.run(length=4, rows=2, d_model=16, num_heads=8, layers=1, repeats=2)
  assert [(r["attention"], r["num_kv_heads"]) for r in results] == [("MHA", 8), ("GQA", 2), ("MQA", 1)]
  assert all(len(r["runs"]) == 2 and r["slowest"] <= r["tokens_per_s"] <= r["fastest"] for r in results)
  mha, gqa, mqa = (r["cache_mib"] for r in results)
  # K and V grow linearly with the kv heads (8, 2, 1) on top of what does not (positions)
  assert mha > gqa > mqa and (mha - gqa) == pytest.approx(6 * (gqa - mqa))


def test_report_renders_trees_and_kv_cache_results(tmp_path):
  """The performance page has a section for each results file of benchmarks.trees and .kv_cache."""
  trees = dict(date="D1", note="n", command="python -m benchmarks.trees", steps=300, log_every=50,
               trees=[dict(path="/a", commit="aaa", tokens_per_s=[900.0, 1000.0, 1100.0], median=1000.0),
                      dict(path="/b", commit="bbb", tokens_per_s=[1800.0, 2000.0, 2200.0], median=2000.0)],
               ratio_after_over_before=dict(median=2.0, min=1.9, max=2.1, per_round=[1.9, 2.0, 2.1]))
  kv = dict(date="D2", note="", command="python -m benchmarks.kv_cache", length=512, rows=8, repeats=5,
            model=dict(d_model=512, num_heads=8, layers=6, vocab_size=8000, d_ff=2048),
            results=[dict(attention="MHA", num_kv_heads=8, cache_mib=96.0, tokens_per_s=400.0, slowest=390.0,
                          fastest=410.0),
                     dict(attention="MQA", num_kv_heads=1, cache_mib=12.0, tokens_per_s=600.0, slowest=590.0,
                          fastest=610.0)])
  (tmp_path / "trees.json").write_text(json.dumps(trees))
  (tmp_path / "kv_cache.json").write_text(json.dumps(kv))
  page = report.render_page(tmp_path, tmp_path / "changes.md")
  assert "| `bbb` (/b) | 2,000 | 1,800-2,200 |" in page
  assert "After / before: 2.000x" in page and "(1.900-2.100)" in page
  assert "| MQA | 1 | 12.00 | 600 | 590-610 | 1.50x |" in page
  assert "Source: [`benchmarks/results/kv_cache.json`]" in page


def test_anatomy_output_ablation_takes_an_eighth_of_the_table_the_model_reads(monkeypatch):
  """decode_anatomy's "output" variant must cut the product that float32 CPU decoding runs (the panels of
  kernels/output_layer.py), not only the XLA dot it replaced."""
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.systems import ours_parts
  from kernels import cpu_decoding, output_layer
  from model import Compute, TransformerConfig
  from model.ops import decoding_for
  monkeypatch.setattr(output_layer, "logits", output_layer.logits)            # restored afterwards
  monkeypatch.setattr(output_layer, "panel_logits", output_layer.panel_logits)
  cfg = TransformerConfig(vocab_size=1000, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1,
                          num_decoder_layers=1, compute=Compute(kernels="cpu"))
  if cpu_decoding.find_compiler() is None:
    pytest.skip("no C++ compiler ($CXX, c++ or g++): decoding uses XLA ops, and there are no panels to cut")
  assert cpu_decoding.available()
  table = jnp.asarray(np.random.default_rng(0).standard_normal((1000, 16)), jnp.float32)
  y = jnp.ones((3, 16), jnp.float32)
  whole = decoding_for(cfg).decoding_logits(y, decoding_for(cfg).decoding_weights(table))
  ours_parts.ablate("output")
  cut = np.asarray(decoding_for(cfg).decoding_logits(y, decoding_for(cfg).decoding_weights(table)))
  width = cpu_decoding.panel_width() * (-(-1000 // cpu_decoding.panel_width()) // 8)
  assert cut.shape == (3, 1000)
  np.testing.assert_allclose(cut[:, :width], np.asarray(whole)[:, :width], rtol=1e-6)
  np.testing.assert_array_equal(cut[:, width:2 * width], cut[:, :width])    # repeated, not computed


def test_startup_reads_the_time_line_the_trainer_prints():
  """benchmarks/startup.py's parse of `[train] time:` follows train/goodput.py's format (the run's total,
  compile's share, and compile's split), and its table and ratio come from the runs' medians."""
  from benchmarks import startup
  from train import goodput
  timing = goodput.Goodput()
  timing.total.update(step=1.5, input=0.25, eval=0.5, checkpoint=0.25, compile=4.0)
  line = timing.summary()
  parsed = startup.TIME_LINE.search(line)
  assert (float(parsed[1]), float(parsed[2])) == (6.5, 4.0), line
  assert startup.SPLIT.search(line), line
  result = {"command": "python -m train", "runs": 1, "beside": 2, "load_average": {"start": 4.0, "end": 5.0},
            "trees": [{"commit": "old", "medians": {"wall_s": 30.0, "cpu_s": 16.0}},
                      {"commit": "new", "medians": {"wall_s": 10.0, "cpu_s": 4.0, "tracing_s": 2.0}}]}
  table = startup.render(result)
  assert "| new | 10.0 | 4.0 |" in table and "last / first: wall 0.33, CPU 0.25" in table
