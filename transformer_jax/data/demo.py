"""Embedded demo task: a small English grammar translated into German.

The generator is deterministic and needs no download. It exercises what makes translation
hard for a sequence model, in a vocabulary small enough to learn in minutes on a CPU:

* agreement: article and adjective endings follow gender, number and case
  ("the old dog" -> "der alte Hund" / "den alten Hund" / "dem alten Hund");
* case government: dative verbs ("helps the man" -> "hilft dem Mann"), dative before
  accusative in ditransitives ("gives the ball to the dog" -> "gibt dem Hund den Ball");
* reordering: verb-second after a fronted adverb ("yesterday the dog saw ..." ->
  "Gestern sah der Hund ..."), participle last in the perfect ("has seen the cat" ->
  "hat die Katze gesehen"), verb-final in subordinate clauses ("that the dog sees the cat"
  -> "dass der Hund die Katze sieht").

Splits are fixed by the seed and disjoint by source sentence.
"""

from __future__ import annotations

import json
import os
import random

# (English singular, English plural, German singular, German plural, German dative plural,
#  gender m/f/n, animate)
NOUNS = [
    ("dog", "dogs", "Hund", "Hunde", "Hunden", "m", True),
    ("cat", "cats", "Katze", "Katzen", "Katzen", "f", True),
    ("child", "children", "Kind", "Kinder", "Kindern", "n", True),
    ("man", "men", "Mann", "Männer", "Männern", "m", True),
    ("woman", "women", "Frau", "Frauen", "Frauen", "f", True),
    ("horse", "horses", "Pferd", "Pferde", "Pferden", "n", True),
    ("teacher", "teachers", "Lehrer", "Lehrer", "Lehrern", "m", True),
    ("bird", "birds", "Vogel", "Vögel", "Vögeln", "m", True),
    ("girl", "girls", "Mädchen", "Mädchen", "Mädchen", "n", True),
    ("mouse", "mice", "Maus", "Mäuse", "Mäusen", "f", True),
    ("friend", "friends", "Freund", "Freunde", "Freunden", "m", True),
    ("neighbour", "neighbours", "Nachbarin", "Nachbarinnen", "Nachbarinnen", "f", True),
    ("book", "books", "Buch", "Bücher", "Büchern", "n", False),
    ("ball", "balls", "Ball", "Bälle", "Bällen", "m", False),
    ("apple", "apples", "Apfel", "Äpfel", "Äpfeln", "m", False),
    ("flower", "flowers", "Blume", "Blumen", "Blumen", "f", False),
    ("letter", "letters", "Brief", "Briefe", "Briefen", "m", False),
    ("picture", "pictures", "Bild", "Bilder", "Bildern", "n", False),
    ("key", "keys", "Schlüssel", "Schlüssel", "Schlüsseln", "m", False),
    ("cup", "cups", "Tasse", "Tassen", "Tassen", "f", False),
]

# English adjective -> German adjective stem (ending added by declension).
ADJECTIVES = [
    ("small", "klein"), ("big", "groß"), ("old", "alt"), ("young", "jung"),
    ("tired", "müd"), ("red", "rot"), ("happy", "glücklich"), ("clever", "klug"),
    ("lazy", "faul"), ("new", "neu"), ("beautiful", "schön"), ("brave", "mutig"),
]

# Verb: English (3sg, plural, past, participle), German (3sg, 3pl, past sg, past pl,
# participle, auxiliary), and the case of its object.
TRANSITIVE = [
    (("sees", "see", "saw", "seen"), ("sieht", "sehen", "sah", "sahen", "gesehen"), "acc"),
    (("finds", "find", "found", "found"), ("findet", "finden", "fand", "fanden", "gefunden"), "acc"),
    (("likes", "like", "liked", "liked"), ("mag", "mögen", "mochte", "mochten", "gemocht"), "acc"),
    (("visits", "visit", "visited", "visited"),
     ("besucht", "besuchen", "besuchte", "besuchten", "besucht"), "acc"),
    (("watches", "watch", "watched", "watched"),
     ("beobachtet", "beobachten", "beobachtete", "beobachteten", "beobachtet"), "acc"),
    (("feeds", "feed", "fed", "fed"), ("füttert", "füttern", "fütterte", "fütterten", "gefüttert"),
     "acc"),
    (("helps", "help", "helped", "helped"), ("hilft", "helfen", "half", "halfen", "geholfen"), "dat"),
    (("thanks", "thank", "thanked", "thanked"), ("dankt", "danken", "dankte", "dankten", "gedankt"),
     "dat"),
]
# Ditransitive: subject gives/shows an accusative thing to a dative recipient.
DITRANSITIVE = [
    (("gives", "give", "gave", "given"), ("gibt", "geben", "gab", "gaben", "gegeben")),
    (("shows", "show", "showed", "shown"), ("zeigt", "zeigen", "zeigte", "zeigten", "gezeigt")),
    (("brings", "bring", "brought", "brought"),
     ("bringt", "bringen", "brachte", "brachten", "gebracht")),
]
# Fronted time adverbs and the tenses they combine with.
ADVERBS = [
    ("yesterday", "gestern", ("past", "perfect")),
    ("today", "heute", ("present", "perfect")),
    ("now", "jetzt", ("present",)),
    ("often", "oft", ("present", "past")),
]
# Matrix clauses that take a "that"-clause.
MATRIX = [("I think", "ich glaube"), ("we know", "wir wissen"), ("she says", "sie sagt"),
          ("he hopes", "er hofft"), ("they believe", "sie glauben")]

_DEFINITE = {"nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
             "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
             "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"}}
# Endings of ein-words (ein, mein, unser); "ein" has no plural.
_EIN_ENDING = {"nom": {"m": "", "f": "e", "n": "", "pl": "e"},
               "acc": {"m": "en", "f": "e", "n": "", "pl": "e"},
               "dat": {"m": "em", "f": "er", "n": "em", "pl": "en"}}
_WEAK_ADJ = {"nom": {"m": "e", "f": "e", "n": "e", "pl": "en"},
             "acc": {"m": "en", "f": "e", "n": "e", "pl": "en"},
             "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"}}
_MIXED_ADJ = {"nom": {"m": "er", "f": "e", "n": "es", "pl": "en"},
              "acc": {"m": "en", "f": "e", "n": "es", "pl": "en"},
              "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"}}
_STRONG_PLURAL_ADJ = {"nom": "e", "acc": "e", "dat": "en"}
# English determiner -> German ein-word stem (None = definite article).
_DETERMINERS = [("the", None), ("a", "ein"), ("my", "mein"), ("our", "unser"), ("", None)]


def _noun_phrase(rng: random.Random, animate_only: bool) -> dict:
  """Samples a noun phrase; declined later, once its case is known."""
  nouns = [n for n in NOUNS if n[6]] if animate_only else NOUNS
  noun = rng.choice(nouns)
  plural = rng.random() < 0.3
  choices = [d for d in _DETERMINERS if (d[0] != "a" or not plural) and (d[0] or plural)]
  determiner = rng.choice(choices)
  adjective = rng.choice(ADJECTIVES) if rng.random() < 0.5 else None
  return {"noun": noun, "plural": plural, "det": determiner, "adj": adjective}


def _english_np(np_: dict) -> str:
  words = [np_["det"][0]] if np_["det"][0] else []
  if np_["adj"]:
    words.append(np_["adj"][0])
  words.append(np_["noun"][1] if np_["plural"] else np_["noun"][0])
  return " ".join(words)


def _german_np(np_: dict, case: str) -> str:
  """Declines a noun phrase: article, adjective ending and noun form agree."""
  _, _, sg, pl, dat_pl, gender, _ = np_["noun"]
  key = "pl" if np_["plural"] else gender
  english_det, ein_stem = np_["det"]
  words = []
  if english_det == "the":
    words.append(_DEFINITE[case][key])
    adj_ending = _WEAK_ADJ[case][key]
  elif ein_stem is not None:
    words.append(ein_stem + _EIN_ENDING[case][key])
    adj_ending = _MIXED_ADJ[case][key]
  else:  # bare plural
    adj_ending = _STRONG_PLURAL_ADJ[case]
  if np_["adj"]:
    words.append(np_["adj"][1] + adj_ending)  # every ending is non-empty: "müd" + "e"
  if np_["plural"]:
    words.append(dat_pl if case == "dat" else pl)
  else:
    words.append(sg)
  return " ".join(words)


def _clause(rng: random.Random, tense: str) -> dict:
  """Samples a clause's parts: subject, verb and objects, both languages."""
  subject = _noun_phrase(rng, animate_only=True)
  if rng.random() < 0.25:
    english_verb, german_verb = rng.choice(DITRANSITIVE)
    objects = [(_noun_phrase(rng, animate_only=True), "dat"),
               (_noun_phrase(rng, animate_only=False), "acc")]
    # English: "gives the ball to the dog"; German: dative before accusative.
    english_objects = f"{_english_np(objects[1][0])} to {_english_np(objects[0][0])}"
  else:
    english_verb, german_verb, case = rng.choice(TRANSITIVE)
    objects = [(_noun_phrase(rng, animate_only=case == "dat"), case)]
    english_objects = _english_np(objects[0][0])
  plural = subject["plural"]
  if tense == "present":
    english = english_verb[1] if plural else english_verb[0]
    finite, participle = german_verb[1] if plural else german_verb[0], None
  elif tense == "past":
    english = english_verb[2]
    finite, participle = german_verb[3] if plural else german_verb[2], None
  else:
    english = ("have " if plural else "has ") + english_verb[3]
    finite, participle = "haben" if plural else "hat", german_verb[4]
  return {
      "en_subject": _english_np(subject),
      "en_predicate": f"{english} {english_objects}",
      "de_subject": _german_np(subject, "nom"),
      "de_objects": " ".join(_german_np(np_, case) for np_, case in objects),
      "finite": finite,
      "participle": participle,
  }


def _sentence_case(text: str) -> str:
  return text[0].upper() + text[1:] + "."


def generate_pair(rng: random.Random) -> tuple[str, str]:
  """Returns one (English, German) sentence pair."""
  kind = rng.random()
  if kind < 0.4:  # plain main clause: S V O
    c = _clause(rng, rng.choice(["present", "past", "perfect"]))
    english = f"{c['en_subject']} {c['en_predicate']}"
    german = " ".join(w for w in [c["de_subject"], c["finite"], c["de_objects"], c["participle"]] if w)
  elif kind < 0.7:  # fronted adverb: verb second, subject after the verb
    adverb_en, adverb_de, tenses = rng.choice(ADVERBS)
    c = _clause(rng, rng.choice(tenses))
    english = f"{adverb_en} {c['en_subject']} {c['en_predicate']}"
    german = " ".join(
        w for w in [adverb_de, c["finite"], c["de_subject"], c["de_objects"], c["participle"]] if w)
  else:  # subordinate clause: verb final
    matrix_en, matrix_de = rng.choice(MATRIX)
    c = _clause(rng, rng.choice(["present", "past", "perfect"]))
    english = f"{matrix_en} that {c['en_subject']} {c['en_predicate']}"
    german = f"{matrix_de}, dass " + " ".join(
        w for w in [c["de_subject"], c["de_objects"], c["participle"], c["finite"]] if w)
  return _sentence_case(english), _sentence_case(german)


def generate_splits(num_train: int, num_validation: int, num_test: int,
                    seed: int = 0) -> dict[str, list[tuple[str, str]]]:
  """Generates disjoint splits: no source sentence appears in two splits."""
  rng = random.Random(seed)
  seen: set[str] = set()
  splits = {}
  for name, size in [("test", num_test), ("validation", num_validation), ("train", num_train)]:
    pairs = []
    while len(pairs) < size:
      pair = generate_pair(rng)
      if pair[0] not in seen:
        seen.add(pair[0])
        pairs.append(pair)
    splits[name] = pairs
  return splits


def load_or_generate(data_dir: str, num_train: int, num_validation: int, num_test: int,
                     seed: int = 0) -> dict[str, list[tuple[str, str]]]:
  """Loads the cached splits from `data_dir`, generating them on first use."""
  path = os.path.join(data_dir, f"demo_en_de_{num_train}_{num_validation}_{num_test}_{seed}.json")
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      return {k: [tuple(p) for p in v] for k, v in json.load(f).items()}
  splits = generate_splits(num_train, num_validation, num_test, seed)
  os.makedirs(data_dir, exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(splits, f, ensure_ascii=False)
  os.replace(tmp, path)  # atomic: a killed run never leaves a half-written cache
  return splits

