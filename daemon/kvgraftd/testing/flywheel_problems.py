"""Problems with answers computed in Python, for the knowledge-library tests and bench.

Three kinds, each generated from a seed, so a set is reproducible and no
answer depends on a model:

* `arith`: arithmetic word problems (bakers, marbles, trains, tickets,
  crates); the answer is computed here, the solution shows the steps.
* `units`: unit conversions (km to m, hours and minutes to minutes, feet and
  inches to inches, kg to g, Celsius to Fahrenheit on multiples of 5).
* `facts`: invented entities (islands, observatories) with invented
  attributes: no model can know them. Each entity has a record of three
  attributes; the recurring problem asks one of them and its verified
  solution quotes the whole record, so a held-out problem can ask another
  attribute of the same entity (its answer is in the library, never in the
  model).

`recurring(n, seed)` gives n problems cycling through the kinds;
`heldout(recurring_set, n, seed)` gives new problems of the same kinds: new
numbers for arith and units, other attributes of the library's entities for
facts. Every Problem carries its kind, the verified solution and the answer
as plain text (integers without separators, names as written).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("arith", "units", "facts")


@dataclass(frozen=True)
class Problem:
    kind: str
    problem: str
    solution: str
    answer: str
    entity: Entity | None = None  # facts: the invented entity asked about
    attribute: str = ""  # facts: which of its attributes


# ----------------------------------------------------------------------
# arithmetic


def _arith(rng: random.Random) -> Problem:
    template = rng.randrange(5)
    if template == 0:
        per_day, days = rng.randint(12, 60), rng.randint(3, 14)
        sold = rng.randint(1, per_day * days - 1)
        made = per_day * days
        return Problem(
            "arith",
            f"A baker bakes {per_day} loaves of bread every day for {days} days and sells "
            f"{sold} of them. How many loaves are left?",
            f"The baker bakes {per_day} * {days} = {made} loaves in {days} days. "
            f"After selling {sold}, {made} - {sold} = {made - sold} loaves are left.",
            str(made - sold),
        )
    if template == 1:
        friends, each = rng.randint(2, 9), rng.randint(3, 25)
        start = friends * each + rng.randint(1, 80)
        given = friends * each
        return Problem(
            "arith",
            f"Mara has {start} marbles. She gives {each} marbles to each of her {friends} "
            "friends. How many marbles does she have left?",
            f"She gives away {each} * {friends} = {given} marbles. "
            f"{start} - {given} = {start - given} marbles are left.",
            str(start - given),
        )
    if template == 2:
        speed, hours = rng.randint(35, 120), rng.randint(2, 9)
        return Problem(
            "arith",
            f"A train travels at {speed} kilometres per hour for {hours} hours. "
            "How many kilometres does it travel?",
            f"Distance is speed times time: {speed} * {hours} = {speed * hours} kilometres.",
            str(speed * hours),
        )
    if template == 3:
        price, count = rng.randint(4, 19), rng.randint(3, 30)
        cost = price * count
        paid = (cost // 50 + 1) * 50
        return Problem(
            "arith",
            f"Tickets cost {price} dollars each. A class buys {count} tickets and pays with "
            f"{paid} dollars. How much change do they get?",
            f"The tickets cost {price} * {count} = {cost} dollars. "
            f"The change is {paid} - {cost} = {paid - cost} dollars.",
            str(paid - cost),
        )
    crates, per_crate, broken = rng.randint(3, 12), rng.randint(10, 48), rng.randint(1, 9)
    total = crates * per_crate
    return Problem(
        "arith",
        f"A shop receives {crates} crates with {per_crate} eggs in each crate. {broken} eggs "
        "are broken. How many eggs are not broken?",
        f"There are {crates} * {per_crate} = {total} eggs. "
        f"{total} - {broken} = {total - broken} eggs are not broken.",
        str(total - broken),
    )


# ----------------------------------------------------------------------
# unit conversions


def _units(rng: random.Random) -> Problem:
    template = rng.randrange(5)
    if template == 0:
        tenths = rng.randint(11, 99)
        km = f"{tenths // 10}.{tenths % 10}"
        return Problem(
            "units",
            f"How many metres are there in {km} kilometres?",
            f"One kilometre is 1000 metres, so {km} kilometres are {km} * 1000 = "
            f"{tenths * 100} metres.",
            str(tenths * 100),
        )
    if template == 1:
        hours, minutes = rng.randint(1, 9), rng.randint(1, 59)
        return Problem(
            "units",
            f"How many minutes are there in {hours} hours and {minutes} minutes?",
            f"One hour is 60 minutes, so {hours} hours are {hours} * 60 = {hours * 60} minutes. "
            f"{hours * 60} + {minutes} = {hours * 60 + minutes} minutes.",
            str(hours * 60 + minutes),
        )
    if template == 2:
        feet, inches = rng.randint(2, 9), rng.randint(1, 11)
        return Problem(
            "units",
            f"A plank is {feet} feet {inches} inches long. How long is it in inches?",
            f"One foot is 12 inches, so {feet} feet are {feet} * 12 = {feet * 12} inches. "
            f"{feet * 12} + {inches} = {feet * 12 + inches} inches.",
            str(feet * 12 + inches),
        )
    if template == 3:
        tenths = rng.randint(11, 79)
        kg = f"{tenths // 10}.{tenths % 10}"
        return Problem(
            "units",
            f"A parcel weighs {kg} kilograms. How many grams is that?",
            f"One kilogram is 1000 grams, so {kg} kilograms are {kg} * 1000 = "
            f"{tenths * 100} grams.",
            str(tenths * 100),
        )
    celsius = 5 * rng.randint(1, 20)
    fahrenheit = celsius * 9 // 5 + 32
    return Problem(
        "units",
        f"Convert {celsius} degrees Celsius to degrees Fahrenheit.",
        f"Fahrenheit is Celsius * 9 / 5 + 32: {celsius} * 9 / 5 = {celsius * 9 // 5}, "
        f"and {celsius * 9 // 5} + 32 = {fahrenheit} degrees Fahrenheit.",
        str(fahrenheit),
    )


# ----------------------------------------------------------------------
# invented facts

_ONSETS = ("b", "br", "d", "dr", "f", "g", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "l", "n", "r", "s", "th", "m")


def _name(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)]
    parts += [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables - 1)]
    return "".join(parts).capitalize()


@dataclass(frozen=True)
class Entity:
    """An invented island with three attributes nobody can know."""

    name: str
    capital: str
    founded: str
    animal: str

    def record(self) -> str:
        return (
            f"The island of {self.name}: capital {self.capital}, first settled in "
            f"{self.founded}, national animal the {self.animal}."
        )


_QUESTIONS = {
    "capital": "What is the capital of the island of {name}?",
    "founded": "In which year was the island of {name} first settled?",
    "animal": "Which animal is the national animal of the island of {name}?",
}
_REPHRASED = {
    "capital": "Name the capital city of {name}.",
    "founded": "{name} was first settled in which year?",
    "animal": "What is the national animal of {name}?",
}


def _entity(rng: random.Random, taken: set[str]) -> Entity:
    while True:
        name = _name(rng, 3)
        if name not in taken:
            taken.add(name)
            break
    return Entity(
        name=name,
        capital=_name(rng, 2),
        founded=str(rng.randint(1100, 1890)),
        animal=_name(rng, 2).lower(),
    )


def _fact(entity: Entity, attribute: str, questions: dict[str, str]) -> Problem:
    answer = getattr(entity, attribute)
    verb = {"capital": "its capital is", "founded": "it was first settled in"}.get(
        attribute, "its national animal is the"
    )
    return Problem(
        "facts",
        questions[attribute].format(name=entity.name),
        f"The verified atlas record reads: {entity.record()} So {verb} {answer}.",
        answer,
        entity,
        attribute,
    )


_ATTRIBUTES = ("capital", "founded", "animal")


# ----------------------------------------------------------------------
def recurring(count: int, seed: int = 0) -> list[Problem]:
    """`count` distinct problems cycling arith, units, facts."""
    rng = random.Random(seed)
    seen: set[str] = set()
    names: set[str] = set()
    out: list[Problem] = []
    while len(out) < count:
        kind = KINDS[len(out) % len(KINDS)]
        if kind == "facts":
            attribute = _ATTRIBUTES[sum(p.kind == "facts" for p in out) % len(_ATTRIBUTES)]
            problem = _fact(_entity(rng, names), attribute, _QUESTIONS)
        else:
            problem = (_arith if kind == "arith" else _units)(rng)
        if problem.problem not in seen:
            seen.add(problem.problem)
            out.append(problem)
    return out


def heldout(library: list[Problem], count: int, seed: int = 1) -> list[Problem]:
    """`count` new problems of the library's kinds, none of them in the library.

    Facts ask another attribute of a library entity (one per entity, while
    they last), phrased differently; arith and units get new numbers.
    """
    rng = random.Random(seed)
    known = {p.problem for p in library}
    facts = [p for p in library if p.kind == "facts"]
    out: list[Problem] = []
    turn = 0
    while len(out) < count:
        kind = KINDS[turn % len(KINDS)]
        turn += 1
        if kind == "facts":
            if not facts:
                continue
            asked = facts.pop(0)
            assert asked.entity is not None
            others = [a for a in _ATTRIBUTES if a != asked.attribute]
            problem = _fact(asked.entity, rng.choice(others), _REPHRASED)
        else:
            problem = (_arith if kind == "arith" else _units)(rng)
        if problem.problem not in known:
            known.add(problem.problem)
            out.append(problem)
    return out
