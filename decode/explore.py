"""Look inside a trained model in the browser: type a sentence, see its output and every head's attention.

A local page that translates what you type and shows every head's attention, the beam's n-best and each
output piece's probability, for every model of the family.

    python -m decode.explore --workdir RUN [--checkpoint STEP|averaged] [--port 8080] [--host 127.0.0.1]
    python -m decode.explore --workdir RUN --html FILE --input TEXT [--input TEXT ...]

The first serves the page at http://HOST:PORT/ (127.0.0.1 unless --host says otherwise: only this
machine can reach it). The second writes the same view for the given sentences as one self-contained
HTML file that opens offline (no server, no network), to share or to put in a supplement.

What the page shows for a sentence (the model's task picks the kind of input):
  - an encoder-decoder or a decoder-only translation run: the translation by `decode.translate.translate`
    (what `python -m decode` gives), the beam's n-best with their scores, or one sample (a temperature);
  - a decoder-only language model (data.task=lm): the prompt's continuation by `decode.prompt`;
  - an encoder-only masked LM: the sentence with each [MASK] filled by the model's best piece;
  - every output token's probability and its top alternatives, and the attention of every layer and
    head (encoder self, decoder self and cross-attention) from one teacher-forced pass over the input and
    the output, as `decode.attention_maps` computes them (Flax `sow`): small multiples, one head enlarged
    with the pieces on its axes; hovering a piece or a row highlights what that position attends to.

Bad input (an empty sentence, one longer than the model reads, characters the vocabulary cannot encode,
a decoding setting out of range, a run directory without a checkpoint) is a one-line message on the page.
The server keeps no state between requests beyond the opened run: every browser gets its own answers.
The page is stdlib `http.server` and one HTML file with its own script (decode/explore_page.html);
no JavaScript library, so the written file needs no network.
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import json
import math
import pathlib
import sys
import threading
import traceback
import warnings

import numpy as np

MASK_TEXT = "[MASK]"              # what a masked-LM sentence writes where the model should fill in a piece
TOP = 5                           # alternatives shown per output token
DIGITS = 4                        # decimals of the attention weights and probabilities sent to the page
PAGE = pathlib.Path(__file__).with_name("explore_page.html")
KIND_TITLES = {"enc_self": "encoder self-attention", "dec_self": "decoder self-attention",
               "cross": "cross-attention (decoder -> encoder)"}
MAX_BODY = 1 << 20                # bytes of one request


class InputError(ValueError):
  """What the user typed or chose cannot be answered; the message (one line) says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """The decoding settings of one request: beam search (temperature None) or sampling."""
  beam_size: int
  alpha: float
  max_extra_len: int
  temperature: float | None = None      # None: beam search; 0: greedy; > 0: one sample
  repetition_penalty: float = 1.0       # sampling only (as `python -m decode --repetition_penalty`)
  seed: int = 0                         # sampling only
  truncate: bool = False                # a sentence longer than the model reads: cut it (else a message)


def _number(raw, name, kind, *, low=None, allow_empty=False):
  """A form field -> int/float, or InputError naming the field."""
  if raw is None or (isinstance(raw, str) and not raw.strip()):
    if allow_empty:
      return None
    raise InputError(f"{name}: give a number")
  try:
    value = kind(raw) if not isinstance(raw, str) else kind(raw.strip())
  except (TypeError, ValueError):
    raise InputError(f"{name}: {raw!r} is not {'a whole number' if kind is int else 'a number'}") from None
  if isinstance(value, float) and not math.isfinite(value):
    raise InputError(f"{name}: {raw!r} is not a finite number")
  if low is not None and value < low:
    raise InputError(f"{name}: {value} is below its least value {low}")
  return value


def parse_settings(raw: dict, defaults: Settings) -> Settings:
  """The page's form (strings or numbers; missing keys take `defaults`) -> Settings, or InputError."""
  get = lambda key: raw.get(key, getattr(defaults, key))
  temperature = _number(get("temperature"), "temperature", float, low=0.0, allow_empty=True)
  penalty = _number(get("repetition_penalty"), "repetition penalty", float)
  if penalty <= 0:
    raise InputError(f"repetition penalty: {penalty} must be above 0 (1 is off)")
  if temperature is None and penalty != 1.0:
    raise InputError("repetition penalty applies to sampling: set a temperature (0 is greedy), "
                     "or set the penalty to 1 for beam search")
  beam_size = _number(get("beam_size"), "beam size", int, low=1)
  if beam_size > 64:
    raise InputError(f"beam size: {beam_size} is above 64, more than this page shows")
  return Settings(beam_size=beam_size, alpha=_number(get("alpha"), "length penalty", float, low=0.0),
                  max_extra_len=_number(get("max_extra_len"), "max extra length", int, low=1),
                  temperature=temperature, repetition_penalty=penalty,
                  seed=_number(get("seed"), "seed", int, low=0), truncate=bool(get("truncate")))


def _top(logits_row, vocab, k=TOP, show=lambda p: p):
  """float32 logits [vocab] -> (probabilities [vocab] float64, the k best as [[piece, p], ...])."""
  z = logits_row.astype(np.float64)
  p = np.exp(z - z.max())
  p /= p.sum()
  best = np.argsort(-p, kind="stable")[:k]
  return p, [[show(vocab.id_to_piece(int(i))), round(float(p[i]), DIGITS)] for i in best]


def _how(settings: Settings) -> str:
  """The search or sampling a result came from, in words (the page shows it under the output)."""
  if settings.temperature is None:
    how = f"beam search (beam {settings.beam_size}, length penalty {settings.alpha})"
  elif settings.temperature == 0:
    how = "greedy"
  else:
    how = f"a sample at temperature {settings.temperature}, seed {settings.seed}"
  if settings.repetition_penalty != 1.0:
    how += f", repetition penalty {settings.repetition_penalty}"
  return how + f", at most {settings.max_extra_len} pieces more than the input"


class Explorer:
  """A run directory opened for the page: answers `analyze(text, settings)` with a JSON-ready dict, or
  raises InputError. A run that cannot be opened (no checkpoint yet, a wrong directory) is retried at
  every request, so the page works as soon as training writes a checkpoint."""

  def __init__(self, workdir, checkpoint=None):
    self.workdir, self.checkpoint = str(workdir), checkpoint
    self._lock = threading.Lock()   # one computation at a time; each request gets its own answer
    self._run, self._error = None, None
    self._open()

  # --- the run -----------------------------------------------------------------------------------------

  def _open(self):
    import run
    from run.user_errors import USER_ERRORS
    try:
      self._run, self._error = run.load_run(self.workdir, self.checkpoint), None
    except USER_ERRORS as error:
      self._error = " ".join(str(error).split())
    return self._run

  def opened(self):
    """The opened run, or InputError saying why there is none."""
    with self._lock:
      if self._run is None and self._open() is None:
        raise InputError(f"cannot open the run {self.workdir}: {self._error}")
      return self._run

  def _task(self):
    from data import tasks
    return tasks.task_of(self._run.config.data)

  def defaults(self) -> Settings:
    """The run's decoding settings (config.decode, else decode.DEFAULTS), as `python -m decode` takes them."""
    from decode import DEFAULTS
    decode = self._run.config.get("decode", {}) if self._run is not None else {}
    value = lambda key: type(DEFAULTS[key])(decode.get(key, DEFAULTS[key]))
    return Settings(beam_size=value("beam_size"), alpha=value("alpha"), max_extra_len=value("max_extra_len"))

  def info(self) -> dict:
    """What the page shows about the run: directory, checkpoint step, model, the whole config."""
    with self._lock:
      if self._run is None:
        self._open()
    out = {"workdir": self.workdir, "error": None if self._run else f"cannot open the run {self.workdir}: "
           f"{self._error}", "mask": MASK_TEXT}
    if self._run is None:
      return out
    cfg = self._run.model.cfg
    task = self._task()
    mode = {"lm": "continue", "mlm": "fill"}.get(task, "translate")
    out.update(
        step=self._run.step, averaged=self.checkpoint == "averaged", arch=cfg.arch, task=task, mode=mode,
        defaults=dataclasses.asdict(self.defaults()), max_pieces=self.max_pieces(),
        summary=(f"{cfg.arch}, {cfg.num_encoder_layers if cfg.arch != 'decoder_only' else 0} encoder + "
                 f"{cfg.num_decoder_layers if cfg.arch != 'encoder_only' else 0} decoder layers, "
                 f"{cfg.num_heads} heads, d_model {cfg.d_model}, {cfg.vocab_size} pieces, "
                 f"max_len {cfg.max_len}, positions {cfg.positions}"),
        config=self._run.config.to_dict())
    return out

  def max_pieces(self) -> int:
    """The longest input the model reads, in pieces (EOS included where the run's sources end with it)."""
    cfg = self._run.model.cfg
    if self._task() == "decoder_only_mt":
      return cfg.max_len // 2 - 2            # decode.translate's room for BOS source SEP + translation
    if self._task() == "lm":
      return cfg.max_len - 2                 # BOS + prompt, and room for at least one more piece
    return cfg.max_len

  # --- one request -------------------------------------------------------------------------------------

  def analyze(self, text, raw_settings=None) -> dict:
    """One sentence and the page's settings -> the page's view of it (see the module docstring)."""
    opened = self.opened()
    if not isinstance(text, str) or not text.strip():
      raise InputError("the input is empty: type a sentence")
    if "\n" in text.strip():
      raise InputError("one sentence at a time: the input has more than one line")
    settings = parse_settings(raw_settings or {}, self.defaults())
    with self._lock:
      task = self._task()
      if task == "mlm":
        return self._fill(opened, text, settings)
      if task == "lm":
        return self._continue(opened, text, settings)
      return self._translate(opened, text, settings)

  def _encode(self, opened, text, side):
    """text -> ids, refusing characters the vocabulary cannot encode (they would be read as <unk>)."""
    from data.vocab import UNK
    vocab = opened.vocab
    ids = vocab.encode(text, side)
    if UNK in ids:
      bad = [c for c in dict.fromkeys(text) if not c.isspace() and UNK in vocab.encode(c, side)]
      what = (", ".join(f"{c!r} (U+{ord(c):04X})" for c in bad[:8]) + (" ..." if len(bad) > 8 else "")
              if bad else "some of its text")
      raise InputError(f"the vocabulary of this run cannot encode {what}: the model would read <unk> "
                       f"in its place; remove or replace it")
    return ids

  def _check_length(self, ids, extra, truncate, what="sentence"):
    """Returns the notes about the length; raises InputError for a text too long unless truncating."""
    limit = self.max_pieces()
    if len(ids) + extra <= limit:
      return []
    cfg = self._run.model.cfg
    why = (f"model.max_len {cfg.max_len}" + (", halved for the prompt and its translation"
                                             if self._task() == "decoder_only_mt" else ""))
    eos = " + EOS" if extra else ""
    if not truncate:
      raise InputError(f"the {what} has {len(ids)} pieces{eos}, more than the {limit} the model reads "
                       f"({why}): shorten it, or tick 'truncate' to use its first {limit - extra} pieces")
    return [f"the {what} has {len(ids)} pieces{eos}, more than the {limit} the model reads ({why}): "
            f"only its first {limit - extra} pieces were used"]

  def _translate(self, opened, text, settings):
    """Encoder-decoder or decoder-only translation: decode.translate.translate, as python -m decode."""
    import jax

    from data import tasks
    from data.lm import SEP
    from data.vocab import BOS, EOS
    from decode import DEFAULTS
    from decode.translate import translate
    from run.mesh import make_mesh
    model, vocab, cfg = opened.model, opened.vocab, opened.model.cfg
    eos = tasks.source_eos(opened.config.data)
    ids = self._encode(opened, text, "source")
    notes = self._check_length(ids, int(eos), settings.truncate)
    limit = self.max_pieces()
    src_ids = ids[:limit]                                   # what translate() reads (it truncates alike)
    if eos:
      src_ids = src_ids[:limit - 1] + [EOS]
    # One sentence, one device: the same translation as on all of them (tests/test_translate.py), without
    # the filler rows that would give every other device a share.
    common = dict(beam_size=settings.beam_size, alpha=settings.alpha, max_extra_len=settings.max_extra_len,
                  batch_tokens=int(opened.config.get("decode", {}).get("batch_tokens", DEFAULTS["batch_tokens"])),
                  source_eos=eos, mesh=make_mesh(jax.local_devices()[:1]))
    with warnings.catch_warnings():   # translate's warning about the truncation is in `notes`
      warnings.simplefilter("ignore")
      if settings.temperature is None:
        nbest = translate(model, opened.params, vocab, [text], nbest=settings.beam_size, **common)[0]
      else:
        sampling = dict(temperature=settings.temperature, top_k=0, top_p=1.0,
                        repetition_penalty=settings.repetition_penalty)
        nbest = [(translate(model, opened.params, vocab, [text], sampling=sampling, seed=settings.seed,
                            **common)[0], None)]
    best = nbest[0][0]
    hyp_ids = vocab.encode(best, "target")
    src_pieces = self._pieces(src_ids)
    if cfg.arch == "decoder_only":
      seq = [BOS, *src_ids, SEP, *hyp_ids]
      first = len(src_ids) + 1                              # the position of SEP predicts the first piece
      logits, maps = self._forward([], seq)
      axes = {"dec_self": (self._pieces(seq), self._pieces(seq))}
    else:
      tgt_in = [BOS, *hyp_ids]
      first = 0
      logits, maps = self._forward(src_ids, tgt_in)
      tgt_pieces = self._pieces(tgt_in)
      axes = {"enc_self": (src_pieces, src_pieces), "dec_self": (tgt_pieces, tgt_pieces),
              "cross": (tgt_pieces, src_pieces)}
    tokens, log_prob = self._token_rows(logits, hyp_ids + [EOS], first, ["dec_self", "cross"])
    how = _how(settings)
    return dict(mode="translate", input=text, output=best, how=how, settings=dataclasses.asdict(settings),
                source_pieces=src_pieces, notes=notes,
                nbest=[{"text": t, "score": None if s is None else round(float(s), DIGITS)}
                       for t, s in nbest],
                log_prob=log_prob,
                tokens=tokens, attention=self._attention(maps, axes))

  def _continue(self, opened, text, settings):
    """A decoder-only language model: the prompt's continuation (decode.prompt), as python -m decode
    --prompt, with beam search when no temperature is given."""
    import jax
    import jax.numpy as jnp

    from data import tasks
    from data.vocab import BOS, EOS
    from decode.prompt import prompt_sample, prompt_search
    model, vocab, cfg = opened.model, opened.vocab, opened.model.cfg
    ids = self._encode(opened, text, tasks.text_side(opened.config.data))
    notes = self._check_length(ids, 0, settings.truncate, what="prompt")
    prompt = [BOS, *ids[:self.max_pieces()]]
    steps = min(settings.max_extra_len, cfg.max_len - len(prompt))
    array = jnp.asarray([prompt], jnp.int32)
    if settings.temperature is None:
      seqs, scores = prompt_search(model, opened.params, array, beam_size=settings.beam_size, max_len=steps,
                                   alpha=settings.alpha)
      found = [([int(t) for t in seqs[0, j]], float(scores[0, j])) for j in range(settings.beam_size)]
    else:
      seqs, _ = prompt_sample(model, opened.params, array, jax.random.key(settings.seed), max_len=steps,
                              temperature=settings.temperature,
                              repetition_penalty=settings.repetition_penalty)
      found = [([int(t) for t in seqs[0]], None)]
    ends = lambda seq: seq[:seq.index(EOS)] if EOS in seq else seq
    cont = ends(found[0][0])
    seq = prompt + cont
    logits, maps = self._forward([], seq)
    pieces = self._pieces(seq)
    predicted = cont + ([EOS] if EOS in found[0][0] else [])
    tokens, log_prob = self._token_rows(logits, predicted, len(prompt) - 1, ["dec_self"])
    how = _how(settings)
    return dict(mode="continue", input=text, output=vocab.decode(cont), how=how, notes=notes,
                settings=dataclasses.asdict(settings), source_pieces=self._pieces(prompt),
                nbest=[{"text": vocab.decode(ends(s)), "score": None if sc is None else round(sc, DIGITS)}
                       for s, sc in found],
                log_prob=log_prob,
                tokens=tokens, attention=self._attention(maps, {"dec_self": (pieces, pieces)}))

  def _fill(self, opened, text, settings):
    """An encoder-only masked LM: every [MASK] filled with the model's most probable piece."""
    from data import tasks
    from data.lm import MASK
    side = tasks.text_side(opened.config.data)
    parts = text.split(MASK_TEXT)
    ids = []
    for i, part in enumerate(parts):
      ids += ([MASK] if i else []) + (self._encode(opened, part, side) if part.strip() else [])
    if not ids:
      raise InputError("the input is empty: type a sentence")
    notes = self._check_length(ids, 0, settings.truncate)
    ids = ids[:self.max_pieces()]
    masked = [i for i, t in enumerate(ids) if t == MASK]
    if not masked:
      notes.append(f"no {MASK_TEXT} in the sentence: write {MASK_TEXT} where the model should fill in a "
                   f"piece; the table shows its prediction at every position")
    logits, maps = self._forward(ids, [])
    filled = list(ids)
    tokens = []
    for position, token in enumerate(ids):
      p, top = _top(logits[position], opened.vocab)
      best = int(np.argmax(p))
      if token == MASK:
        filled[position] = best
      shown = None if token == MASK else round(float(p[token]), DIGITS)   # (a mask's own p means nothing)
      tokens.append({"piece": self._pieces([token])[0], "p": shown, "top": top,
                     "masked": token == MASK, "query": position, "kinds": ["enc_self"]})
    pieces = self._pieces(ids)
    return dict(mode="fill", input=text, output=opened.vocab.decode(filled), how="masked LM", notes=notes,
                settings=None, source_pieces=pieces, nbest=[], log_prob=None, tokens=tokens,
                attention=self._attention(maps, {"enc_self": (pieces, pieces)}))

  # --- shared pieces -----------------------------------------------------------------------------------

  def _pieces(self, ids):
    from data.lm import MASK
    mask = self._task() == "mlm"
    return [MASK_TEXT if mask and i == MASK else self._run.vocab.id_to_piece(int(i)) for i in ids]

  def _forward(self, src_ids, tgt_in_ids):
    from decode.attention_maps import forward_with_maps
    return forward_with_maps(self._run.model, self._run.params, src_ids, tgt_in_ids)

  def _token_rows(self, logits, predicted, first, kinds):
    """Per output piece: its probability under the model (temperature 1, no penalty) given the input and
    the pieces before it, the TOP most probable pieces there, and the query row that predicted it; and the
    sum of their log-probabilities (the output's, under the model)."""
    rows, log_prob = [], 0.0
    for i, token in enumerate(predicted):
      p, top = _top(logits[first + i], self._run.vocab)
      log_prob += math.log(max(float(p[token]), 1e-300))
      rows.append({"piece": self._run.vocab.id_to_piece(int(token)), "p": round(float(p[token]), DIGITS),
                   "top": top, "masked": False, "query": first + i, "kinds": kinds})
    return rows, round(log_prob, DIGITS)

  @staticmethod
  def _attention(maps, axes):
    """{(kind, layer): [h, q, k]} -> per kind present: its title, row and column pieces, and the weights
    [layer][head][q][k] rounded to DIGITS decimals."""
    out = []
    for kind in ("enc_self", "dec_self", "cross"):
      layers = sorted(layer for k, layer in maps if k == kind)
      if not layers or kind not in axes:
        continue
      rows, cols = axes[kind]
      out.append({"kind": kind, "title": KIND_TITLES[kind], "rows": rows, "cols": cols,
                  "weights": [np.round(maps[(kind, layer)], DIGITS).tolist() for layer in layers]})
    return out


# --- the page ----------------------------------------------------------------------------------------------

def page(info: dict, results: list | None = None, static_note: str = "") -> str:
  """The page: decode/explore_page.html with the run's info (and, for --html, the results) inlined as
  JSON. With results it is static: no form, a choice among the sentences, nothing fetched."""
  data = {"info": info, "results": results, "static": results is not None, "note": static_note}
  text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
  text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")   # safe in <script>
  title = html.escape(f"explore {info['workdir']}")
  return PAGE.read_text(encoding="utf-8").replace("__TITLE__", title).replace("__DATA__", text)


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 8080):
  """A threading HTTP server for the page: GET / (the page), GET /api/info, POST /api/analyze with JSON
  {"text": ..., "settings": {...}} -> {"result": ...} or {"error": "one line"}."""
  from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

  class Handler(BaseHTTPRequestHandler):
    server_version = "aiayn-explore"

    def _send(self, status, body: bytes, kind: str):
      self.send_response(status)
      self.send_header("Content-Type", kind)
      self.send_header("Content-Length", str(len(body)))
      self.send_header("Cache-Control", "no-store")
      self.end_headers()
      self.wfile.write(body)

    def _json(self, payload, status=200):
      self._send(status, json.dumps(payload, ensure_ascii=False).encode("utf-8"), "application/json")

    def do_GET(self):  # noqa: N802 - http.server's name
      path = self.path.split("?")[0]
      if path in ("/", "/index.html"):
        self._send(200, page(explorer.info()).encode("utf-8"), "text/html; charset=utf-8")
      elif path == "/api/info":
        self._json(explorer.info())
      else:
        self._json({"error": f"no such page {path!r}: open /"}, 404)

    def do_POST(self):  # noqa: N802
      if self.path.split("?")[0] != "/api/analyze":
        self._json({"error": f"no such endpoint {self.path!r}"}, 404)
        return
      try:
        size = int(self.headers.get("Content-Length") or 0)
        if size > MAX_BODY:
          raise InputError(f"the request has {size} bytes, more than the {MAX_BODY} this page takes")
        try:
          request = json.loads(self.rfile.read(size).decode("utf-8") or "{}")
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
          raise InputError(f"the request is not JSON ({error})") from None
        if not isinstance(request, dict):
          raise InputError("the request is not a JSON object")
        self._json({"result": explorer.analyze(request.get("text"), request.get("settings") or {})})
      except InputError as error:
        self._json({"error": " ".join(str(error).split())})
      except Exception as error:  # noqa: BLE001 - a bug: one line on the page, the traceback here
        traceback.print_exc()
        what = " ".join(str(error).split())[:300]
        self._json({"error": f"internal error ({type(error).__name__}: {what}); the server's console has "
                             f"the details"})

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
      if not (args and str(args[0]).startswith(("GET /api", "POST /api"))):
        sys.stderr.write(f"[explore] {self.address_string()} {format % args}\n")

  server = ThreadingHTTPServer((host, port), Handler)
  server.daemon_threads = True
  return server


def write_html(explorer: Explorer, path, sentences, settings: dict | None = None) -> pathlib.Path:
  """The view of `sentences` as one self-contained HTML file (no server, no network). A sentence the
  page would answer with a message is an InputError naming it; nothing is written then."""
  results = []
  for i, text in enumerate(sentences, 1):
    try:
      results.append(explorer.analyze(text, settings or {}))
    except InputError as error:
      raise InputError(f"--input {i} ({text[:60]!r}): {error}") from None
  from run.workdir import write_atomically
  note = f"{len(results)} sentence(s), written by python -m decode.explore --html"
  return write_atomically(path, page(explorer.info(), results, note))


def main(argv=None) -> None:
  from run.console import log_to_console
  from run.user_errors import fail, reported
  parser = argparse.ArgumentParser(prog="python -m decode.explore", description=__doc__.split("\n")[0],
                                   epilog=__doc__.split("\n", 2)[2],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="a run directory written by python -m train")
  parser.add_argument("--checkpoint", default=None, help="a step number, 'averaged' or 'latest' (default)")
  parser.add_argument("--host", default="127.0.0.1",
                      help="the address to serve on (default 127.0.0.1: this machine only; 0.0.0.0: any)")
  parser.add_argument("--port", type=int, default=8080, help="the port (0: any free one)")
  parser.add_argument("--html", default=None, metavar="FILE",
                      help="write the view of the --input sentences to FILE (one offline HTML file) and exit")
  parser.add_argument("--input", action="append", default=[], metavar="TEXT",
                      help="with --html: a sentence (a prompt for a language model; a sentence with "
                           f"{MASK_TEXT} for a masked LM); repeat it for more")
  how = parser.add_argument_group("decoding, with --html (the page has them as controls)")
  how.add_argument("--beam_size", type=int, default=None, help="default: the run's config.decode.beam_size")
  how.add_argument("--alpha", type=float, default=None, help="GNMT length penalty ((5 + length) / 6) ** alpha (default: config.decode.alpha)")
  how.add_argument("--max_extra_len", type=int, default=None, help="default: config.decode.max_extra_len")
  how.add_argument("--temperature", type=float, default=None,
                   help="sample instead of beam search (0: greedy)")
  how.add_argument("--repetition_penalty", type=float, default=1.0, help="sampling: CTRL's penalty")
  how.add_argument("--seed", type=int, default=0, help="sampling: random seed")
  how.add_argument("--truncate", action="store_true", help="cut a sentence longer than the model reads")
  args = parser.parse_args(argv)
  if args.html is None and args.input:
    parser.error("--input goes with --html FILE (the served page takes sentences as you type them)")
  if args.html is not None and not args.input:
    parser.error("--html FILE needs at least one --input TEXT")
  log_to_console()
  import run
  try:
    checkpoint = run.checkpoint_arg(args.checkpoint)
  except argparse.ArgumentTypeError as error:
    parser.error(str(error))
  with reported():
    explorer = Explorer(args.workdir, checkpoint)
    if args.html is not None:
      if explorer.info()["error"]:
        fail(explorer.info()["error"])
      settings = {k: v for k, v in vars(args).items() if k in Settings.__dataclass_fields__ and v is not None}
      try:
        path = write_html(explorer, args.html, args.input, settings)
      except InputError as error:
        fail(str(error))
      print(path)
      return
  try:
    server = make_server(explorer, args.host, args.port)
  except OSError as error:
    fail(f"cannot serve on {args.host}:{args.port} ({error.strerror}): choose another --port "
         f"(0: any free one)")
  host, port = server.server_address[:2]
  state = explorer.info()
  where = f"step {state['step']}" if not state["error"] else state["error"]
  print(f"[explore] {args.workdir} ({where}) at http://{host}:{port}/  (Ctrl-C stops)", flush=True)
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  finally:
    server.server_close()


if __name__ == "__main__":
  main()
