"""README.md of an export directory: the exact calls that translate as `python -m decode` does.

Each format's library takes the run's conventions from the files the export writes (CTranslate2's
config.json appends the source EOS itself; generation_config.json holds the beam and length penalty),
except one: MarianTokenizer always appends </s>, so a run trained without source EOS is called with
add_special_tokens=False. The README says which, for this run.
"""
from __future__ import annotations

import pathlib

CT2_CALL = '''```python
import ctranslate2, sentencepiece as spm
sp = spm.SentencePieceProcessor(model_file="{out}/source.spm")
translator = ctranslate2.Translator("{out}", device="cpu")
results = translator.translate_batch(sp.encode(sentences, out_type=str), beam_size={beam},
                                     length_penalty={alpha}, patience=2, max_decoding_length={max_len},
                                     min_decoding_length=0)
translations = [sp.decode(r.hypotheses[0]) for r in results]
```

{eos} Greedy search: `beam_size=1`. `min_decoding_length=0` lets a translation be empty, as ours can
(CTranslate2's default, 1, forbids </s> as the first token). `patience=2` searches on after the first
{beam} hypotheses have ended (the default, 1, stops there), as ours searches while a live hypothesis can
still win.'''

HF_CALL = '''```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained("{out}")
model = AutoModelForSeq2SeqLM.from_pretrained("{out}")   # {cls}
batch = tokenizer(sentences, padding=True, return_tensors="pt"{special})
translations = tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True)
```

{eos} generation_config.json sets `num_beams={beam}` and `length_penalty={alpha}`; greedy search:
`model.generate(**batch, num_beams=1)`.'''

LENGTH_PENALTY = ("Length penalty: `python -m decode` divides a finished hypothesis's log-probability by "
                  "GNMT's ((5 + L) / 6) ** alpha, this library by L ** alpha; the same alpha ranks some "
                  "beam hypotheses differently, so beam translations can differ where greedy ones do not.")


def usage(fmt: str, out, *, source_eos: bool, beam_size: int, alpha: float, max_len: int,
          hf_class: str = "") -> str:
  """The README.md text of export directory `out` in format `fmt` ('hf' or 'ctranslate2')."""
  out = pathlib.Path(out)
  if fmt == "ctranslate2":
    eos = ("The run ends every source with </s>: config.json's add_source_eos appends it." if source_eos
           else "The run's sources carry no </s> (config.json: add_source_eos false).")
    call = CT2_CALL.format(out=out, beam=beam_size, alpha=alpha, max_len=max_len, eos=eos)
  else:
    eos = ("The run ends every source with </s>, as MarianTokenizer does by default." if source_eos else
           "The run's sources carry no </s>, and MarianTokenizer always appends one: call it with "
           "`add_special_tokens=False`.")
    call = HF_CALL.format(out=out, cls=hf_class, beam=beam_size, alpha=alpha, eos=eos,
                          special="" if source_eos else ", add_special_tokens=False")
  return (f"# Translate with this export\n\n`sentences` is a list of source strings.\n\n{call}\n\n"
          f"{LENGTH_PENALTY}\n")
