"""Bounded matching of the patterns a checkpoint supplies (exclusion globs and ``re:`` regexes).

A checkpoint's configs name the modules to keep unquantized with globs and regular expressions, and its
headers name the modules: both come from whoever made the checkpoint, so neither may make matching slow.

- **globs** (fnmatch's ``*``, ``?``, ``[...]``, ``[!...]``): :class:`Glob` splits the pattern at its ``*``
  into segments of one-character tokens and matches them left to right, each segment at its leftmost place,
  in ``O(len(name) x len(pattern))`` time whatever the pattern (``fnmatch.translate`` builds a backtracking
  regex, and SGLang's own ``*`` -> ``.*`` translation backtracks exponentially on ``*a*a*a*...*ab``).
  Character classes are read exactly as :func:`fnmatch.translate` reads them;
- **regexes** (compressed-tensors' ``re:`` entries, SGLang's globs that hold other regex syntax): checked
  with :mod:`re` (the engines' module: a pattern it refuses is refused), then matched with the ``regex``
  module (:mod:`re`-compatible ``VERSION0``), whose matching stops at a timeout (CPU seconds): a pattern that
  runs past :data:`REGEX_CALL_SECONDS` on one name, or a list whose regexes together run past
  :data:`REGEX_BUDGET_SECONDS`, is a :class:`BadPattern` (the engine's own :mod:`re` would hang on it). The
  ``regex`` module also answers some patterns that make :mod:`re` backtrack for hours (``(a+)+$``) at once:
  those get their answer, not a problem.
  At most :data:`MAX_REGEXES` regexes of at most :data:`MAX_REGEX_CHARS` characters, each expanding to at
  most :data:`MAX_REGEX_NODES` nodes (:func:`regex_nodes`: ``regex`` multiplies counted repeats out while it
  compiles, where no timeout acts), are compiled, within the list's budget;
- **indexes**: :class:`GlobIndex` keeps exact names in a set and buckets the globs by their literal head
  (or tail), so that one name is tried against the few globs that can match it, not against the whole list;
  :class:`SubstringIndex` answers "is some entry a substring of this name" with one set look-up per
  substring length, and :func:`dotted_runs` lists the runs of whole components of a dotted name;
- **bounds**: every loop of the globs, the substring rule and the ancestor rule whose length depends on the
  list or the name checks the list's :class:`Budget` (:data:`MATCH_BUDGET_SECONDS` of CPU time, plus
  :data:`NAME_ALLOWANCE_SECONDS` per name); past it, a :class:`BadPattern` names the entry being tried and the name. A glob is at most
  :data:`MAX_GLOB_CHARS` characters (its tokens take memory per character).
"""

from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass

import regex

__all__ = ["BadPattern", "Budget", "Glob", "GlobIndex", "SubstringIndex", "RegexList", "dotted_runs", "entries",
           "REGEX_CALL_SECONDS", "REGEX_BUDGET_SECONDS", "MAX_REGEXES", "MAX_REGEX_CHARS", "MATCH_BUDGET_SECONDS",
           "MAX_GLOB_CHARS", "MAX_REGEX_NODES", "regex_nodes", "NAME_ALLOWANCE_SECONDS"]

#: the longest one regex may take on one name, in CPU seconds (a real exclusion regex takes microseconds)
REGEX_CALL_SECONDS = 0.25
#: the longest the regexes of one exclusion list may take together, over every name they are tried on
REGEX_BUDGET_SECONDS = 2.0
#: regexes compiled per list, and characters per regex (real lists hold a handful of short ones)
MAX_REGEXES = 10_000
MAX_REGEX_CHARS = 10_000


#: the longest the glob, substring and ancestor rules of one exclusion list may take together, over every name
#: they are tried on, in CPU seconds (a real list decides a real model's names in milliseconds)
MATCH_BUDGET_SECONDS = 2.0
#: and this much more per name tried (a real list takes microseconds a name: a 70,000-module model's names
#: against 8 globs took 1.1 s here, so a fixed budget alone would refuse big models' real lists)
NAME_ALLOWANCE_SECONDS = 1e-3
#: characters per glob (a real one is under a few hundred; fnmatch-style tokens take memory per character)
MAX_GLOB_CHARS = 10_000


class BadPattern(ValueError):
    """An exclusion entry the engine cannot use: not a string, an invalid regex, or one that runs too long."""


def entries(value, where: str) -> list[str]:
    """``value`` as a list of strings (None: empty); :class:`BadPattern` naming ``where`` (the config field)
    and the entry otherwise."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadPattern(f"{where} is {type(value).__name__} {_short(value)}, not a list of strings")
    if set(map(type, value)) <= {str}:
        return value
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BadPattern(f"{where}[{i}] is {type(item).__name__} {_short(item)}, not a string")
    return value


class Budget:
    """The CPU time one exclusion list's rules (globs, substrings, ancestors) may spend, over every name they
    are tried on: :data:`MATCH_BUDGET_SECONDS`, plus :data:`NAME_ALLOWANCE_SECONDS` for each name (each
    outermost ``with`` block), so the bound grows with the names' count and never with the list's cost.
    :meth:`check` is called inside every loop whose length depends on the list or the name; past the budget
    it raises :class:`BadPattern` naming the entry being tried and the name, so no list of any size hangs a
    check. ``what`` names the list (its config field)."""

    def __init__(self, what: str = "an exclusion list", seconds: float | None = None):
        self.what = what
        self.seconds = MATCH_BUDGET_SECONDS if seconds is None else seconds
        self.spent = 0.0
        self._since: float | None = None
        self._depth = 0  # rules of one list nest (a glob index inside a per-component loop)
        self._calls = 0

    def __enter__(self):
        if self._depth == 0:
            self.seconds += NAME_ALLOWANCE_SECONDS
            self._since = time.process_time()
        self._depth += 1
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and self._since is not None:
            self.spent += time.process_time() - self._since
            self._since = None

    def check(self, entry: str, name: str, every: int = 64) -> None:
        """Raise :class:`BadPattern` when the time spent (inside the ``with`` block too) passes the budget;
        the clock is read once per ``every`` calls."""
        self._calls += 1
        if self._calls % every:
            return
        now = self.spent + (time.process_time() - self._since if self._since is not None else 0.0)
        if now > self.seconds:
            raise BadPattern(f"{self.what}: matching took more than {self.seconds:.3g} s (CPU) at the entry "
                             f"{_short(entry)} on the {len(name)}-character name {_short(name)}; fp4pass stops "
                             "there (the engine's own matching would take as long, or hang)")


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ----------------------------------------------------------------------------------------------- globs

_STAR = None  # a segment boundary while tokenizing


@dataclass(frozen=True)
class _Segment:
    """A run of one-character tokens between two ``*``: each a str (that character) or a compiled class."""

    tokens: tuple
    literal: str | None  # the run as plain text when every token is a character

    def __len__(self) -> int:
        return len(self.tokens)

    def at(self, name: str, pos: int) -> bool:
        """Whether the segment matches ``name[pos:pos + len(self)]``."""
        if self.literal is not None:
            return name.startswith(self.literal, pos)
        for k, token in enumerate(self.tokens):
            ch = name[pos + k]
            if not (ch == token if isinstance(token, str) else token(ch)):
                return False
        return True

    def find(self, name: str, start: int, end: int, budget: Budget | None = None, entry: str = "") -> int:
        """The leftmost ``pos`` in ``[start, end - len(self)]`` where the segment matches, else -1."""
        if self.literal is not None:
            return name.find(self.literal, start, end)
        for pos in range(start, end - len(self.tokens) + 1):
            if budget is not None:
                budget.check(entry, name)
            if self.at(name, pos):
                return pos
        return -1


def _any_char(ch: str) -> bool:
    return True


def _tokens(pattern: str, classes: bool) -> list:
    """fnmatch's reading of ``pattern``: characters, ``?`` and ``[...]`` classes (when ``classes``), and
    ``_STAR`` for each run of ``*``. An unclosed ``[`` is a plain character, as in :func:`fnmatch.translate`."""
    out: list = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if not out or out[-1] is not _STAR:
                out.append(_STAR)
        elif c == "?" and classes:
            out.append(_any_char)
        elif c == "[" and classes:
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append("[")
            else:
                out.append(re.compile(fnmatch.translate(pattern[i - 1:j + 1])).match)
                i = j + 1
        else:
            out.append(c)
    return out


def _segments(tokens: list) -> list[_Segment]:
    runs: list[list] = [[]]
    for token in tokens:
        if token is _STAR:
            runs.append([])
        else:
            runs[-1].append(token)
    return [_Segment(tuple(r), "".join(r) if all(isinstance(t, str) for t in r) else None) for r in runs]


class Glob:
    """A glob matched without backtracking. ``classes``: fnmatch's ``?`` and ``[...]`` (False: only ``*`` is
    special, the other characters literal, SGLang's reading of a glob without regex syntax).

    With segments ``S0 * S1 * ... * Sk``: ``S0`` must match at the start, ``Sk`` at the end, and each middle
    segment is taken at its leftmost place after the previous one (a later place only leaves less room for the
    rest), so one pass decides.
    """

    def __init__(self, pattern: str, classes: bool = True):
        self.pattern = pattern
        tokens = _tokens(pattern, classes)
        self.segments = _segments(tokens)
        head = []
        for token in tokens:
            if not isinstance(token, str):
                break
            head.append(token)
        tail = []
        for token in reversed(tokens):
            if not isinstance(token, str):
                break
            tail.append(token)
        self.head = "".join(head)  # literal characters before the first wildcard
        self.tail = "".join(reversed(tail))  # ... after the last one

    def match(self, name: str, budget: Budget | None = None) -> bool:
        """Whether the whole of ``name`` matches (fnmatchcase); ``budget`` checked as it goes."""
        segs = self.segments
        first, last = segs[0], segs[-1]
        if len(segs) == 1:
            return len(name) == len(first) and first.at(name, 0)
        end = len(name) - len(last)
        if end < len(first) or not first.at(name, 0) or not last.at(name, end):
            return False
        pos = len(first)
        for seg in segs[1:-1]:
            if budget is not None:
                budget.check(self.pattern, name)
            found = seg.find(name, pos, end, budget, self.pattern)
            if found < 0:
                return False
            pos = found + len(seg)
        return True


_FIRST_SPECIAL = {True: re.compile(r"[*?\[]"), False: re.compile(r"\*")}
_LAST_SPECIAL = {True: re.compile(r"[*?\[\]][^*?\[\]]*\Z"), False: re.compile(r"\*[^*]*\Z")}


class GlobIndex:
    """Any of many fnmatch globs (or exact names) matching a name, without trying each: exact names in a set;
    ``X*`` globs (``X`` plain) as the prefixes ``X`` in a set; every other glob filed under its literal head
    (``model.layers.*.w1`` under ``model.layers.``), else its literal tail, else in a list tried for every
    name. A name is then tried against the globs of the heads and tails it has, one set look-up per head or
    tail length. ``classes``: as for :class:`Glob`. Globs are compiled when first tried."""

    def __init__(self, patterns, classes: bool = True, exact: bool = True, budget: Budget | None = None):
        """``exact``: False when the caller looks plain names up itself (they are then not kept here).
        ``budget``: the list's (:class:`Budget`), shared with its other rules; a glob longer than
        :data:`MAX_GLOB_CHARS` is a :class:`BadPattern`."""
        self.classes = classes
        self.budget = budget if budget is not None else Budget()
        first, last = _FIRST_SPECIAL[classes], _LAST_SPECIAL[classes]
        self.exact: set[str] = set()
        self.prefixes: set[str] = set()
        self.by_head: dict[str, list[str]] = {}
        self.by_tail: dict[str, list[str]] = {}
        rest: set[str] = set()
        for p in patterns:
            special = first.search(p)
            if special is not None and len(p) > MAX_GLOB_CHARS:
                raise BadPattern(f"{self.budget.what}: the glob {_short(p)} is {len(p)} characters long; at most "
                                 f"{MAX_GLOB_CHARS}")
            if special is None:
                if exact:
                    self.exact.add(p)
            elif special.start() == len(p) - 1 and p[-1] == "*":
                self.prefixes.add(p[:-1])
            elif special.start():
                self.by_head.setdefault(p[:special.start()], []).append(p)
            else:
                tail = p[last.search(p).start() + 1:]
                if tail:
                    self.by_tail.setdefault(tail, []).append(p)
                else:
                    rest.add(p)
        self.rest = [Glob(p, classes) for p in sorted(rest)]
        self.compiled: dict[str, Glob] = {}
        self.prefix_lengths = sorted({len(h) for h in self.prefixes})
        self.head_lengths = sorted({len(h) for h in self.by_head})
        self.tail_lengths = sorted({len(t) for t in self.by_tail})

    def __bool__(self) -> bool:
        return bool(self.exact or self.prefixes or self.by_head or self.by_tail or self.rest)

    def _glob(self, pattern: str) -> Glob:
        glob = self.compiled.get(pattern)
        if glob is None:
            glob = self.compiled[pattern] = Glob(pattern, self.classes)
        return glob

    def match(self, name: str) -> bool:
        """Whether any glob matches ``name``; :class:`BadPattern` once the list's budget is spent."""
        if name in self.exact:
            return True
        with self.budget as budget:
            return self._match(name, budget)

    def _match(self, name: str, budget: Budget) -> bool:
        n = len(name)
        for length in self.prefix_lengths:
            if length > n:
                break
            budget.check(name[:length], name)
            if name[:length] in self.prefixes:
                return True
        for lengths, table, cut in ((self.head_lengths, self.by_head, lambda k: name[:k]),
                                    (self.tail_lengths, self.by_tail, lambda k: name[n - k:])):
            for length in lengths:
                if length > n:
                    break
                for p in table.get(cut(length), ()):
                    budget.check(p, name, every=1)
                    if self._glob(p).match(name, budget):
                        return True
        for glob in self.rest:
            budget.check(glob.pattern, name, every=1)
            if glob.match(name, budget):
                return True
        return False


class SubstringIndex:
    """Whether some entry is a substring of a name (vLLM's ``p in name``): the entries in a set, and the name's
    substrings of each entry length looked up."""

    def __init__(self, patterns, budget: Budget | None = None):
        self.entries = set(patterns)
        self.lengths = sorted({len(p) for p in self.entries})
        self.budget = budget if budget is not None else Budget()

    def found_in(self, name: str) -> bool:
        """Whether an entry is a substring of ``name``; :class:`BadPattern` once the list's budget is spent."""
        n = len(name)
        with self.budget as budget:
            if len(self.entries) <= 10 * len(self.lengths):  # few entries per length: str's own search is quicker
                for p in self.entries:
                    budget.check(p, name, every=1)
                    if p in name:
                        return True
                return False
            for length in self.lengths:
                if length > n:
                    break
                for i in range(n - length + 1):
                    budget.check(f"(an entry of {length} characters)", name)
                    if name[i:i + length] in self.entries:
                        return True
        return False


def dotted_runs(name: str, dots_in_run: set[int] | None = None, budget: Budget | None = None):
    """Every ``X`` with ``".X."`` in ``"." + name + "."``: the runs of whole dot-separated components of
    ``name`` (``a.b.c``: ``a``, ``a.b``, ``a.b.c``, ``b``, ``b.c``, ``c``); only those holding a number of dots
    in ``dots_in_run`` when given. One run at a time (memory of one run); ``budget`` checked per run, so a
    name of very many components fails with :class:`BadPattern` instead of taking hours."""
    framed = f".{name}."
    dots = [i for i, ch in enumerate(framed) if ch == "."]
    counts = range(len(dots) - 1) if dots_in_run is None else sorted(c for c in dots_in_run if c < len(dots) - 1)
    for count in counts:
        for a in range(len(dots) - 1 - count):
            if budget is not None:
                budget.check(f"(an entry of {count} dots)", name)
            yield framed[dots[a] + 1:dots[a + count + 1]]


# ----------------------------------------------------------------------------------------------- regexes

#: the most nodes a regex may expand to (its counted repeats multiplied out: ``x{1000}`` is 1000 nodes): the
#: ``regex`` module expands them while it compiles, about a second per million, before any timeout can act
MAX_REGEX_NODES = 100_000


def _parser():
    try:
        import re._parser as parser  # Python >= 3.11
    except ImportError:  # pragma: no cover (Python 3.10)
        import sre_parse as parser
    return parser


def regex_nodes(pattern: str, cap: int = MAX_REGEX_NODES) -> int:
    """How many nodes ``pattern`` (valid for :mod:`re`) expands to: every counted repeat multiplied by its
    upper bound (an unbounded one by its lower bound), summed over the pattern; counting stops past ``cap``."""
    parser = _parser()
    repeats = {parser.MAX_REPEAT, parser.MIN_REPEAT, getattr(parser, "POSSESSIVE_REPEAT", parser.MAX_REPEAT)}

    def size(items) -> int:
        total = 0
        for op, av in items:
            if op in repeats:
                lo, hi, sub = av
                bound = lo if hi == parser.MAXREPEAT else hi
                total += max(bound, 1) * size(sub)
            elif op is parser.SUBPATTERN:
                total += size(av[-1])
            elif op is parser.BRANCH:
                total += sum(size(branch) for branch in av[1])
            elif op in (parser.ASSERT, parser.ASSERT_NOT):
                total += size(av[1])
            elif op is parser.GROUPREF_EXISTS:
                total += size(av[1]) + (size(av[2]) if av[2] else 0)
            else:
                total += 1
            if total > cap:
                return total
        return total

    return size(parser.parse(pattern).data)


class RegexList:
    """Regexes from a checkpoint, each checked with :mod:`re` and matched with a timeout (module docstring).

    ``fullmatch``: the regex must cover the whole name (SGLang's globs), else it is anchored at the start only
    (``re.match``, compressed-tensors). ``what`` names the list in messages.
    """

    def __init__(self, patterns, what: str, fullmatch: bool = False, shown=None):
        patterns = list(dict.fromkeys(patterns))
        if len(patterns) > MAX_REGEXES:
            raise BadPattern(f"{what}: {len(patterns)} regular expressions; fp4pass matches at most {MAX_REGEXES} "
                             "(a real exclusion list holds a handful)")
        self.what = what
        self.spent = 0.0
        self.compiled = []
        shown = shown or {}
        for p in patterns:
            label = shown.get(p, p)
            if len(p) > MAX_REGEX_CHARS:
                raise BadPattern(f"{what}: {_short(label)} is {len(p)} characters long; at most {MAX_REGEX_CHARS}")
            start = time.process_time()
            try:
                re.compile(p)
                nodes = regex_nodes(p)
            except (re.error, RecursionError, OverflowError, ValueError) as exc:
                raise BadPattern(f"{what}: {_short(label)} is not a valid regular expression ({exc})") from None
            if nodes > MAX_REGEX_NODES:
                raise BadPattern(f"{what}: {_short(label)} expands to more than {MAX_REGEX_NODES} nodes (its counted "
                                 "repeats multiplied out); fp4pass does not compile it")
            try:
                rx = regex.compile(p, flags=regex.VERSION0)
            except (regex.error, RecursionError, OverflowError, ValueError) as exc:
                raise BadPattern(f"{what}: {_short(label)} cannot be matched safely ({exc})") from None
            self.spent += time.process_time() - start
            if self.spent > REGEX_BUDGET_SECONDS:
                raise BadPattern(f"{what}: compiling its regular expressions took more than "
                                 f"{REGEX_BUDGET_SECONDS:g} s, at {_short(label)}; fp4pass stops there")
            self.compiled.append((label, rx.fullmatch if fullmatch else rx.match))

    def __bool__(self) -> bool:
        return bool(self.compiled)

    def search(self, name: str) -> bool:
        """Whether any regex matches ``name``; :class:`BadPattern` when one runs past its time, or the list
        past its budget."""
        for label, match in self.compiled:
            limit = min(REGEX_CALL_SECONDS, REGEX_BUDGET_SECONDS - self.spent)
            if limit <= 0:
                raise self._spent()
            start = time.process_time()
            try:
                hit = match(name, timeout=limit)
            except TimeoutError:
                self.spent += time.process_time() - start
                if limit < REGEX_CALL_SECONDS:
                    raise self._spent() from None
                raise BadPattern(f"{self.what}: {_short(label)} ran past {REGEX_CALL_SECONDS:g} s on the "
                                 f"{len(name)}-character name {_short(name)} (catastrophic backtracking: the "
                                 "engine's own re would hang on it)") from None
            self.spent += time.process_time() - start
            if hit:
                return True
        return False

    def _spent(self) -> BadPattern:
        return BadPattern(f"{self.what}: its {len(self.compiled)} regular expression(s) took more than "
                          f"{REGEX_BUDGET_SECONDS:g} s together; fp4pass stops there")
