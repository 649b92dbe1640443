"""Mutation fuzz of the policy loader, with a fixed seed: the bundled policies with bytes flipped,
inserted and cut, other encodings, deep nesting, alias bombs, YAML tokens and values of the wrong
type. Whatever the file holds, `load_policy` returns a Policy or raises PolicyError (never our own
bug: reason `internal`), every line of the message is `file:line: field: reason` (line `?` where
the file has none), and each file is judged within a bound. Then the watch fed the mutants in turn
still applies the valid policy that follows them."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import yaml

from infermesh.meshconfig.policy import LOCAL_POLICY, Policy, PolicyError, load_policy
from infermesh.meshconfig.watchers import PolicyFileWatcher

SEED = 28
CASES = 1500
PER_CASE_S = 2.0
"""A generous bound on one file's CPU time (the loader's limits keep each under 0.25 s; a bomb
that got past them would take minutes). CPU time, so a loaded machine does not fail it."""
SOURCES = sorted(LOCAL_POLICY.parent.glob("*.yaml"))

WEIRD_VALUES = [None, 0, -1, 2**64, 10**30, 1.5, float("inf"), True, "", "x" * 5000, "\x00", "\ud800", "é😀", "*", "&a",
                [], [1, [2, [3]]], {}, {"a": {"b": None}}, "2020-13-45", "!!binary", "\u2028"]
TOKENS = ["&a ", "*a", "*nope", "!!binary ", "!!python/object:os.system ", "!!int ", "!!float ", "!!timestamp ", "? ", "<<: ",
          "<<: *a", "---\n", "...\n", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "\t", "{", "}", "[", "]", ": ", "- ", "|\n", ">-\n",
          "'", '"', "\\", "#", "\r", "\ufeff", "\x85", "\u2028", "@", "`", "!", "%", "9" * 5000, "2001-02-30", "0x", "0o9"]


def _type_swap(rng: random.Random, text: str) -> bytes:
    data = yaml.safe_load(text)
    parent, key, node = None, None, data
    for _ in range(rng.randint(1, 6)):  # walk down to a random value
        if isinstance(node, dict) and node:
            k = rng.choice(list(node))
        elif isinstance(node, list) and node:
            k = rng.randrange(len(node))
        else:
            break
        parent, key, node = node, k, node[k]
        if not isinstance(node, (dict, list)) or rng.random() < 0.3:
            break
    if parent is None:
        data = rng.choice(WEIRD_VALUES)
    else:
        parent[key] = rng.choice(WEIRD_VALUES)
    return yaml.safe_dump(data, allow_unicode=rng.random() < 0.5).encode("utf-8", "surrogatepass")


def _nest(rng: random.Random, data: bytes) -> bytes:
    at = rng.randrange(len(data))
    depth = rng.choice([63, 64, 65, 200, 1000, 10_000])
    opener, closer = rng.choice([(b"[", b"]"), (b"{a: ", b"}"), (b"- ", b"")])
    if opener == b"- ":  # block sequences, one per line and indent
        nested = b"".join(b"\n" + b" " * i + b"- " for i in range(min(depth, 2000))) + b"x"
    else:
        nested = opener * depth + b"x" + closer * rng.choice([0, depth])
    return data[:at] + nested + data[at:]


def _bomb(rng: random.Random, data: bytes) -> bytes:
    width, levels = rng.choice([(10, 9), (2, 40), (100, 4), (3, 20)])
    lines = [b"l0: &l0 [lol]"]
    for i in range(1, levels + 1):
        lines.append(b"l%d: &l%d [%s]" % (i, i, b", ".join([b"*l%d" % (i - 1)] * width)))
    bomb = b"\n".join(lines) + b"\n"
    return bomb + data if rng.random() < 0.5 else data + b"\n" + bomb


def mutate(rng: random.Random, text: str) -> bytes:
    data = text.encode()
    kind = rng.randrange(9)
    if kind == 0:  # byte flips
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 1:  # truncation (a write caught half-way)
        return data[: rng.randrange(len(data))]
    if kind == 2:  # insertions and deletions of bytes
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(b))
            if rng.random() < 0.5:
                del b[at: at + rng.randint(1, 20)]
            else:
                b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        return bytes(b)
    if kind == 3:  # other encodings, with and without their byte-order marks
        enc = rng.choice(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1", "cp1252", "shift_jis"])
        t = text.replace("batch", rng.choice(["bätch", "batch’", "ba\u00adtch", "batch"]))
        return t.encode(enc, "replace")
    if kind == 4:
        return _nest(rng, data)
    if kind == 5:
        return _type_swap(rng, text)
    if kind == 6:
        return _bomb(rng, data)
    if kind == 7:  # YAML tokens in random places
        b = data
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(b))
            b = b[:at] + rng.choice(TOKENS).encode("utf-8", "surrogatepass") + b[at:]
        return b
    # lines shuffled or repeated (indentation and keys out of place)
    lines = data.split(b"\n")
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    if rng.random() < 0.5:
        lines[i], lines[j] = lines[j], lines[i]
    else:
        lines[i:i] = [lines[j]] * rng.randint(1, 3)
    return b"\n".join(lines)


def check_one(path: Path, data: bytes) -> str:
    """Load `path` (holding `data`): a Policy, or a well-formed PolicyError. Returns its reason."""
    path.write_bytes(data)
    t0 = time.process_time()
    try:
        result = load_policy(path)
    except PolicyError as e:
        result = e
    # Anything else escapes here and fails the test with the mutant's traceback.
    took = time.process_time() - t0
    assert took < PER_CASE_S, (took, data[:200])
    if isinstance(result, Policy):
        return "ok"
    assert result.reason != "internal", (str(result), data[:300])
    lines = str(result).split("\n")
    assert lines and len(lines) == len(result.problems)
    # YAML also breaks lines at \r, NEL and the Unicode separators.
    text = data.decode("utf-8", "replace")
    n_lines = max(data.count(b"\n"), len(re.findall("\r\n|[\r\n\x85\u2028\u2029]", text))) + 1
    for line in lines:
        m = re.fullmatch(re.escape(str(path)) + r":(\d+|\?): (.+): (.+)", line)
        assert m, line
        if m.group(1) != "?":
            assert 1 <= int(m.group(1)) <= n_lines, (line, n_lines)
    return result.reason


def test_mutated_policies_only_ever_raise_policy_errors_that_name_the_file_and_line(tmp_path):
    rng = random.Random(SEED)
    texts = [p.read_text() for p in SOURCES]
    assert len(texts) >= 2
    path = tmp_path / "policy.yaml"
    reasons: dict[str, int] = {}
    t0 = time.process_time()
    for _ in range(CASES):
        reason = check_one(path, mutate(rng, rng.choice(texts)))
        reasons[reason] = reasons.get(reason, 0) + 1
    took = time.process_time() - t0
    print(f"[policy fuzz] {CASES} mutants in {took:.1f} s of CPU: {dict(sorted(reasons.items()))}")
    # The mutations reach every kind of refusal, not only the first line of defence.
    assert {"encoding", "yaml", "depth", "size", "validation"} <= set(reasons), reasons
    assert took < 30, took


def test_the_watch_fed_mutants_in_turn_still_applies_the_next_valid_policy(tmp_path):
    rng = random.Random(SEED + 1)
    text = LOCAL_POLICY.read_text()
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    seen = []
    w = PolicyFileWatcher(path, seen.append, settle=0)
    assert w.load()
    for i in range(100):
        path.write_bytes(mutate(rng, text) + b"\n# %d\n" % i)  # a new size each time: a new signature
        w.poll()
    assert w.metrics.value("infermesh_policy_rejections_total", reason="internal") == 0
    path.write_text(text.replace("default_class: batch", "default_class: interactive"))
    assert w.poll() and seen[-1].default_class == "interactive"
