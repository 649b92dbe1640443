"""Would the filter accept this regex? A check of the syntax of Rust's `regex` crate (1.9, the
filter's build: features std, perf, unicode-perl, unicode-case, no Unicode property tables) and of
the filter's compiled-size limits (1 MiB a regex, 16 MiB shared by a config's regexes), so
`infermesh policy check` refuses the patterns the filter would refuse, without Rust.

The dialect's one definition is the filter's: the `regex` crate at the version and features
pinned in filter/Cargo.toml, built by filter/src/config.rs `string_match` with the limits
declared there (REGEX_SIZE_LIMIT, REGEX_TOTAL_SIZE_LIMIT, REGEX_NEST_LIMIT). This module is a
model of it, checked against it by mesh-config/tests/test_rule_contract.py: the limits below
against those config.rs reports (`cargo run --example config_limits`), and the syntax and size
on a corpus of patterns (REGEXES, and configs of many regexes for the shared budget) that the
filter's own parser judges too; any different verdict fails there.

The syntax check follows regex-syntax 0.7: escapes, classes and set operations, flags, group
names, counted repetitions, the nesting limit (250), and the rules of `(?-u)` (nothing that could
match invalid UTF-8). The size is an estimate: per-atom costs measured on the filter's parser
(docs/policy-and-control-plane.md); exact far from the limit, not to the byte near it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SIZE_LIMIT = 1 << 20
"""Compiled size one regex may have (config.rs REGEX_SIZE_LIMIT)."""
TOTAL_SIZE_LIMIT = 16 << 20
"""Compiled size a config's regexes share, equally (config.rs REGEX_TOTAL_SIZE_LIMIT)."""
NEST_LIMIT = 250
"""Nesting of groups and classes (config.rs REGEX_NEST_LIMIT)."""


def size_limit(count: int) -> int:
    """The compiled size each of a config's `count` regexes may have (config.rs regex_size_limit)."""
    return min(TOTAL_SIZE_LIMIT // max(count, 1), SIZE_LIMIT)


_PUNCT = set("!\"#$%&'()*+,-./:;=?@[\\]^_`{|}~")
_LITERAL_ESCAPES = {"a": "\a", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ASCII_CLASSES = {"alnum", "alpha", "ascii", "blank", "cntrl", "digit", "graph", "lower", "print", "punct", "space", "upper",
                  "word", "xdigit"}
_FLAGS = set("imsRUux")

# Bytes of compiled program per atom (1 MiB / the longest repetition the filter accepts).
_COST_LITERAL_BYTE = 32
_COST_CASED = 80          # (?i) letter: a two-member class
_COST_ASCII_CLASS = 64    # plus _COST_RANGE per range
_COST_RANGE = 8
_COST_ANY = 1000          # `.` and negated classes: most of Unicode
_COST_WIDE_RANGE = 132    # a range beyond ASCII
_COST_PERL = {"d": 4650, "s": 680, "w": 48000, "D": 11800, "S": 1930, "W": 45000}
_COST_PERL_ASCII = 96
_COST_REPEAT = 40
_COST_CAPTURE = 64
_COST_BRANCH = 8


class RegexError(Exception):
    pass


@dataclass
class _Node:
    cost: float
    depth: int = 0


@dataclass
class _Parser:
    s: str
    i: int = 0
    names: set[str] = field(default_factory=set)

    def error(self, msg: str) -> RegexError:
        return RegexError(msg)

    def peek(self, k: int = 0) -> str | None:
        j = self.i + k
        return self.s[j] if j < len(self.s) else None

    # -- structure ------------------------------------------------------------------------------

    def parse(self) -> _Node:
        node = self.alternation({"u": True}, top=True)
        if node.depth > NEST_LIMIT:
            raise self.error(f"exceed the maximum number of nested parentheses/brackets ({NEST_LIMIT})")
        return node

    def alternation(self, flags: dict, top: bool) -> _Node:
        flags = dict(flags)  # (?flags) apply to the end of the enclosing group
        branches: list[list[_Node | None]] = [[]]
        while True:
            c = self.peek()
            if c is None:
                if not top:
                    raise self.error("unclosed group")
                break
            if flags.get("x") and c.isspace():
                self.i += 1
                continue
            if flags.get("x") and c == "#":
                while self.peek() not in (None, "\n"):
                    self.i += 1
                continue
            items = branches[-1]
            if c == ")":
                if top:
                    raise self.error("unopened group")
                self.i += 1
                break
            if c == "|":
                self.i += 1
                branches.append([])
            elif c in "*+?{":
                if not items or items[-1] is None:
                    raise self.error("repetition operator missing expression")
                items[-1] = self.repetition(items[-1])
            elif c == "(":
                items.append(self.group(flags))
            elif c == "[":
                items.append(self.bracket_class(flags))
            elif c == "\\":
                items.append(self.escape(flags))
            elif c == ".":
                self.i += 1
                if not flags.get("u"):
                    raise self.error("pattern can match invalid UTF-8")
                items.append(_Node(_COST_ANY))
            elif c in "^$":
                self.i += 1
                items.append(_Node(_COST_BRANCH))
            else:
                self.i += 1
                items.append(self.literal(c, flags))
        concats = []
        for items in branches:
            nodes = [n for n in items if n is not None]
            depth = max((n.depth for n in nodes), default=0) + (1 if len(items) > 1 else 0)
            concats.append(_Node(sum(n.cost for n in nodes), depth))
        if len(concats) == 1:
            return concats[0]
        return _Node(sum(n.cost for n in concats) + _COST_BRANCH * len(concats), max(n.depth for n in concats) + 1)

    def group(self, flags: dict) -> _Node | None:
        self.i += 1
        capture = True
        if self.peek() == "?":
            self.i += 1
            c = self.peek()
            if c in ("=", "!") or (c == "<" and self.peek(1) in ("=", "!")):
                raise self.error("look-around, including look-ahead and look-behind, is not supported")
            if c == "P" and self.peek(1) == "<" or c == "<":
                self.i += 2 if c == "P" else 1
                self.group_name()
            else:
                new, done = self.flags(flags)
                if done:  # (?flags): no group, the flags go on
                    flags.update(new)
                    return None
                flags, capture = new, False
        inner = self.alternation(flags, top=False)
        return _Node(inner.cost + (_COST_CAPTURE if capture else 0), inner.depth + 1)

    def group_name(self) -> None:
        start = self.i
        while self.peek() not in (None, ">"):
            c = self.peek()
            ok = (c.isalpha() or c == "_") if self.i == start else (c.isalnum() or c in "_.[]")
            if not ok:
                raise self.error("invalid capture group character")
            self.i += 1
        if self.peek() is None:
            raise self.error("unclosed capture group name")
        name = self.s[start:self.i]
        if not name:
            raise self.error("empty capture group name")
        if name in self.names:
            raise self.error("duplicate capture group name")
        self.names.add(name)
        self.i += 1

    def flags(self, flags: dict) -> tuple[dict, bool]:
        new, seen = dict(flags), set()
        negate = any_flag = any_after_negate = False
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unclosed group")
            self.i += 1
            if c in ":)":
                if negate and not any_after_negate:
                    raise self.error("dangling flag negation operator")
                if not any_flag and not negate and c == ")":
                    raise self.error("repetition operator missing expression")
                return new, c == ")"
            if c == "-":
                if negate:
                    raise self.error("repeated negation")
                negate, any_after_negate = True, False
                continue
            if c not in _FLAGS:
                raise self.error("unrecognized flag")
            if c in seen:
                raise self.error("duplicate flag")
            seen.add(c)
            any_flag = True
            if negate:
                any_after_negate = True
            new[c] = not negate

    def repetition(self, node: _Node) -> _Node:
        c = self.s[self.i]
        self.i += 1
        if c == "{":
            lo, hi = self.counted()
        else:
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if self.peek() == "?":
            self.i += 1
        if hi is None:
            cost = node.cost * max(lo, 1) + _COST_REPEAT
        else:
            cost = node.cost * lo + (node.cost + _COST_REPEAT) * (hi - lo)
        return _Node(cost, node.depth + 1)

    def counted(self) -> tuple[int, int | None]:
        def skip() -> None:
            while self.peek() is not None and self.peek().isspace():
                self.i += 1

        def decimal() -> int:
            skip()
            start = self.i
            while self.peek() is not None and self.peek().isdigit() and self.peek().isascii():
                self.i += 1
            if self.peek() is None:
                raise self.error("unclosed counted repetition")
            if start == self.i:
                raise self.error("repetition quantifier expects a valid decimal")
            v = int(self.s[start:self.i])
            if v > 2**32 - 1:
                raise self.error("decimal literal invalid")
            skip()
            return v

        lo = decimal()
        hi: int | None = lo
        if self.peek() == ",":
            self.i += 1
            skip()
            hi = None if self.peek() == "}" else decimal()
        if self.peek() != "}":
            raise self.error("unclosed counted repetition")
        self.i += 1
        if hi is not None and lo > hi:
            raise self.error("invalid repetition range, the start must be <= the end")
        return lo, hi

    # -- atoms ----------------------------------------------------------------------------------

    def literal(self, c: str, flags: dict) -> _Node:
        if not flags.get("u") and ord(c) > 0x7F:
            raise self.error("Unicode not allowed here")
        if flags.get("i") and c.lower() != c.upper():
            return _Node(_COST_CASED)
        return _Node(_COST_LITERAL_BYTE * len(c.encode()))

    def hex_escape(self, kind: str, flags: dict) -> str:
        if self.peek() == "{":
            end = self.s.find("}", self.i)
            if end < 0:
                raise self.error("unclosed hexadecimal literal")
            digits = self.s[self.i + 1:end]
            self.i = end + 1
            if not digits:
                raise self.error("hexadecimal literal empty")
        else:
            n = {"x": 2, "u": 4, "U": 8}[kind]
            digits = self.s[self.i:self.i + n]
            if len(digits) < n:
                raise self.error("incomplete escape sequence, reached end of pattern prematurely")
            self.i += n
        if not all(d in "0123456789abcdefABCDEF" for d in digits):
            raise self.error("invalid hexadecimal digit")
        v = int(digits, 16)
        if v > 0x10FFFF or 0xD800 <= v <= 0xDFFF:
            raise self.error("hexadecimal literal is not a Unicode scalar value")
        if not flags.get("u") and v > 0x7F:
            raise self.error("pattern can match invalid UTF-8")
        return chr(v)

    def escape_item(self, flags: dict, in_class: bool) -> tuple[str, str | _Node]:
        """("lit", char) or ("class", node) or ("assert", node)."""
        self.i += 1
        c = self.peek()
        if c is None:
            raise self.error("incomplete escape sequence, reached end of pattern prematurely")
        self.i += 1
        if c in "dswDSW":
            if not flags.get("u"):
                if c.isupper():
                    raise self.error("pattern can match invalid UTF-8")
                return "class", _Node(_COST_PERL_ASCII)
            return "class", _Node(_COST_PERL[c])
        if c in "pP":
            raise self.error("Unicode property not found")
        if c in "xuU":
            return "lit", self.hex_escape(c, flags)
        if c in _LITERAL_ESCAPES:
            return "lit", _LITERAL_ESCAPES[c]
        if c in _PUNCT:
            return "lit", c
        if not in_class and c in "bBAz":
            return "assert", _Node(_COST_BRANCH)
        if c.isdigit():
            raise self.error("backreferences are not supported")
        raise self.error("invalid escape sequence found in character class" if in_class else "unrecognized escape sequence")

    def escape(self, flags: dict) -> _Node:
        kind, v = self.escape_item(flags, in_class=False)
        return self.literal(v, flags) if kind == "lit" else v

    def bracket_class(self, flags: dict, depth: int = 1) -> _Node:
        if depth > NEST_LIMIT:
            raise self.error(f"exceed the maximum number of nested parentheses/brackets ({NEST_LIMIT})")
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        cost, deepest, ranges, first = 0.0, depth, 0, True
        wide = negated  # most of Unicode
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unclosed character class")
            if flags.get("x") and c.isspace():
                self.i += 1
                continue
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "[" and self.peek(1) == ":":
                end = self.s.find(":]", self.i + 2)
                name = self.s[self.i + 2:end] if end > 0 else ""
                neg = name.startswith("^")
                if end > 0 and name.lstrip("^") in _ASCII_CLASSES:
                    if neg and not flags.get("u"):
                        raise self.error("pattern can match invalid UTF-8")
                    self.i = end + 2
                    wide |= neg
                    ranges += 3
                    continue
            if c == "[":
                inner = self.bracket_class(flags, depth + 1)
                cost += inner.cost
                deepest = max(deepest, inner.depth)
                continue
            if self.s.startswith(("&&", "--", "~~"), self.i):
                self.i += 2
                continue
            start = self.class_atom(flags)
            if isinstance(start, _Node):
                cost += start.cost
                if self.peek() == "-" and self.peek(1) not in (None, "]"):
                    self.i += 1
                    self.class_atom(flags)
                    raise self.error("invalid range boundary, must be a literal")
                continue
            if self.peek() == "-" and self.peek(1) not in (None, "]") and not self.s.startswith("--", self.i):
                self.i += 1
                end_c = self.class_atom(flags)
                if isinstance(end_c, _Node):
                    raise self.error("invalid range boundary, must be a literal")
                if ord(start) > ord(end_c):
                    raise self.error("invalid character class range, the start must be <= the end")
                if ord(end_c) > 0x7F:
                    cost += _COST_WIDE_RANGE
            ranges += 1
        if negated and not flags.get("u"):
            raise self.error("pattern can match invalid UTF-8")
        base = _COST_ANY if wide else _COST_ASCII_CLASS + _COST_RANGE * max(ranges - 1, 0)
        return _Node(base + cost, deepest)

    def class_atom(self, flags: dict) -> str | _Node:
        c = self.peek()
        if c == "\\":
            kind, v = self.escape_item(flags, in_class=True)
            return v
        self.i += 1
        if not flags.get("u") and ord(c) > 0x7F:
            raise self.error("Unicode not allowed here")
        return c


def _size(pattern: str) -> tuple[float, str | None]:
    """(estimated compiled size, None) or (0, why the syntax is refused)."""
    try:
        return _Parser(pattern).parse().cost, None
    except RegexError as e:
        return 0, f"regex parse error: {e}"
    except RecursionError:
        return 0, f"regex parse error: exceed the maximum number of nested parentheses/brackets ({NEST_LIMIT})"


def regex_error(pattern: str, limit: int = SIZE_LIMIT) -> str | None:
    """Why the filter would refuse `pattern` (its message, or close to it), or None; `limit`: the
    compiled size it may have (below SIZE_LIMIT: its share of TOTAL_SIZE_LIMIT, `size_limit`)."""
    cost, why = _size(pattern)
    if why is None and cost > limit:
        why = f"Compiled regex exceeds size limit of {limit} bytes."
    if why is not None and limit < SIZE_LIMIT:
        why += f" (the config's regexes share {TOTAL_SIZE_LIMIT >> 20} MiB of compiled size)"
    return why
