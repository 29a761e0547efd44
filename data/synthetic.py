"""The embedded corpus: a synthetic English-like -> German-like language pair, generated from a seed.

It needs no download, yet a model must learn real translation phenomena to score well on it:
- a lexicon of about 1,200 source word types (nouns, adjectives, verbs, adverbs, prepositions), each
  mapped to a target stem;
- word order: SVO becomes SOV, adjectives follow their noun, a prepositional phrase moves before the
  object and an adverb to just after the subject;
- agreement: target determiners and adjectives take the noun's gender (3) and number, and the verb,
  which comes last in its clause, agrees with the subject across the object in between;
- tense: present, past (a target prefix) and future (an auxiliary in the source, a suffix in the target);
- one to three clauses joined by conjunctions: 3 to about 30 words.
Every source sentence has exactly one translation, so a model can in principle score 100 BLEU.
"""
from __future__ import annotations

import dataclasses
import random

SPLITS = ("train", "dev", "test")
DEFAULT_SIZES = {"train": 200_000, "dev": 1_000, "test": 1_000}
MAX_WORDS = 30

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "pr",
           "st", "tr", "gl", "fl", "sk", "sp", "ch", "sh"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "n", "r", "l", "s", "t", "m", "k"]


@dataclasses.dataclass(frozen=True)
class Lexicon:
  nouns: list          # [(src, tgt_stem, gender)]
  adjectives: list     # [(src, tgt_stem)]
  verbs: list          # [(src, tgt_stem, transitive)]
  adverbs: list        # [(src, tgt)]
  prepositions: list   # [(src, tgt)]


def _words(rng, count, syllables, taken):
  out = []
  while len(out) < count:
    n = rng.choice(syllables)
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))
    if word not in taken and len(word) > 2:
      taken.add(word)
      out.append(word)
  return out


def make_lexicon(seed: int = 0, nouns=600, adjectives=250, verbs=250, adverbs=60, prepositions=20) -> Lexicon:
  """Pseudo-words for both languages; the two vocabularies never share a word."""
  rng = random.Random(seed)
  taken = {"the", "a", "some", "and", "but", "while", "will", "did", "not"}
  pick = lambda n, s: _words(rng, n, s, taken)
  src_nouns, tgt_nouns = pick(nouns, [1, 2]), pick(nouns, [1, 2, 2])
  genders = [rng.randrange(3) for _ in range(nouns)]
  src_adj, tgt_adj = pick(adjectives, [1, 2]), pick(adjectives, [2])
  src_verbs, tgt_verbs = pick(verbs, [1, 2]), pick(verbs, [2])
  transitive = [rng.random() < 0.7 for _ in range(verbs)]
  src_adv, tgt_adv = pick(adverbs, [2, 3]), pick(adverbs, [2, 3])
  src_prep, tgt_prep = pick(prepositions, [1]), pick(prepositions, [1, 2])
  return Lexicon(
      nouns=[(s, t, int(g)) for s, t, g in zip(src_nouns, tgt_nouns, genders)],
      adjectives=list(zip(src_adj, tgt_adj)),
      verbs=[(s, t, bool(x)) for s, t, x in zip(src_verbs, tgt_verbs, transitive)],
      adverbs=list(zip(src_adv, tgt_adv)),
      prepositions=list(zip(src_prep, tgt_prep)))


# Target function words and inflections, by gender (0, 1, 2) and number.
_TGT_DEF = {(0, "sg"): "der", (1, "sg"): "die", (2, "sg"): "das", "pl": "dei"}
_TGT_INDEF = {0: "ein", 1: "eine", 2: "eun"}
_TGT_SOME = "manche"
_ADJ_SUFFIX = {(0, "sg"): "er", (1, "sg"): "e", (2, "sg"): "es", "pl": "en"}
_NOUN_PLURAL = {0: "e", 1: "en", 2: "er"}
_VERB_SUFFIX = {(0, "sg"): "t", (1, "sg"): "et", (2, "sg"): "it", "pl": "en"}
_CONJ = {"and": "und", "but": "aber", "while": "wahrend"}


def _key(gender, number):
  return "pl" if number == "pl" else (gender, "sg")


def _noun_phrase(rng, lex: Lexicon):
  """Returns (src_words, tgt_words, gender, number)."""
  src, stem, gender = rng.choice(lex.nouns)
  number = "pl" if rng.random() < 0.35 else "sg"
  det = rng.choice(["the", "a"]) if number == "sg" else rng.choice(["the", "some"])
  num_adj = rng.choice([0, 0, 1, 1, 2])
  adjs = [rng.choice(lex.adjectives) for _ in range(num_adj)]
  key = _key(gender, number)
  src_words = [det] + [a for a, _ in adjs] + [src + ("s" if number == "pl" else "")]
  if det == "the":
    tgt_det = _TGT_DEF[key]
  elif det == "a":
    tgt_det = _TGT_INDEF[gender]
  else:
    tgt_det = _TGT_SOME
  noun = stem + (_NOUN_PLURAL[gender] if number == "pl" else "")
  # Adjectives follow the noun and agree with it.
  tgt_words = [tgt_det, noun] + [t + _ADJ_SUFFIX[key] for _, t in adjs]
  return src_words, tgt_words, gender, number


def _clause(rng, lex: Lexicon):
  subj_src, subj_tgt, gender, number = _noun_phrase(rng, lex)
  verb_src, verb_tgt, transitive = rng.choice(lex.verbs)
  tense = rng.choice(["present", "past", "future"])
  if tense == "present":
    v_src = [verb_src + ("s" if number == "sg" else "")]
    v_tgt = [verb_tgt + _VERB_SUFFIX[_key(gender, number)]]
  elif tense == "past":
    v_src = [verb_src + "ed"]
    v_tgt = ["ge" + verb_tgt + _VERB_SUFFIX[_key(gender, number)]]
  else:
    v_src = ["will", verb_src]
    v_tgt = [verb_tgt + "ra" + _VERB_SUFFIX[_key(gender, number)]]
  obj_src, obj_tgt = [], []
  if transitive:
    obj_src, obj_tgt, _, _ = _noun_phrase(rng, lex)
  pp_src, pp_tgt = [], []
  if rng.random() < 0.35:
    prep_src, prep_tgt = rng.choice(lex.prepositions)
    np_src, np_tgt, _, _ = _noun_phrase(rng, lex)
    pp_src, pp_tgt = [prep_src] + np_src, [prep_tgt] + np_tgt
  adv_src, adv_tgt = [], []
  if rng.random() < 0.25:
    a_src, a_tgt = rng.choice(lex.adverbs)
    adv_src, adv_tgt = [a_src], [a_tgt]
  # Source: S V O PP ADV.  Target: S ADV PP O V.
  src = subj_src + v_src + obj_src + pp_src + adv_src
  tgt = subj_tgt + adv_tgt + pp_tgt + obj_tgt + v_tgt
  return src, tgt


def make_pair(rng, lex: Lexicon) -> tuple[str, str]:
  """One (source, target) sentence pair."""
  clauses = rng.choices([1, 2, 3], weights=[0.7, 0.25, 0.05])[0]
  src, tgt = _clause(rng, lex)
  for _ in range(clauses - 1):
    conj = rng.choice(sorted(_CONJ))
    s, t = _clause(rng, lex)
    if len(src) + 1 + len(s) > MAX_WORDS:
      break
    src, tgt = src + [conj] + s, tgt + [_CONJ[conj]] + t
  return " ".join(src) + ".", " ".join(tgt) + "."


def generate(seed: int = 0, sizes: dict | None = None) -> dict:
  """{'train'|'dev'|'test': [(src, tgt)]}, deterministic from seed; dev and test share no source
  sentence with train or with each other."""
  sizes = {**DEFAULT_SIZES, **(sizes or {})}
  lex = make_lexicon(seed)
  rng = random.Random(f"aiayn-synthetic-{seed}")
  out, seen = {}, set()
  for split in ("test", "dev", "train"):   # held-out splits first, so train is the one filtered
    pairs = []
    while len(pairs) < sizes[split]:
      pair = make_pair(rng, lex)
      if pair[0] in seen:
        continue
      if split != "train":
        seen.add(pair[0])
      pairs.append(pair)
    out[split] = pairs
  return out


def dictionary_translate(sentence: str, lex: Lexicon) -> str:
  """The monotone word-by-word baseline: every source word replaced by its dictionary entry, in order."""
  d = dictionary(lex)
  words = sentence.rstrip(".").split()
  return " ".join(w for w in (d.get(x, x) for x in words) if w) + "."


def dictionary(lex: Lexicon) -> dict:
  """Word-by-word source -> target dictionary (the most common target form of each source word)."""
  d = {"the": "der", "a": "ein", "some": "manche", "will": "", **_CONJ}
  for src, stem, gender in lex.nouns:
    d[src] = stem
    d[src + "s"] = stem + _NOUN_PLURAL[gender]
  for src, stem in lex.adjectives:
    d[src] = stem + _ADJ_SUFFIX[(0, "sg")]
  for src, stem, _ in lex.verbs:
    d[src] = stem + _VERB_SUFFIX["pl"]
    d[src + "s"] = stem + _VERB_SUFFIX[(0, "sg")]
    d[src + "ed"] = "ge" + stem + _VERB_SUFFIX[(0, "sg")]
  d.update(dict(lex.adverbs))
  d.update(dict(lex.prepositions))
  return d
