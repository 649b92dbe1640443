"""docs/architecture.md is true of the code: its generated parts are what scripts/gen_architecture.py
writes from the code now, and every file, module, HTTP path, gRPC method and header its
hand-written parts name exists (read from the tree and the sidecar's route registrations, no
process started)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_architecture", REPO / "scripts" / "gen_architecture.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

DOC = gen.DOC
TOP_FOLDERS = ("charts", "docs", "e2e", "filter", "infermesh", "mesh-config", "requirements", "scripts", "sidecar")
FILE_SUFFIXES = (".py", ".rs", ".md", ".yaml", ".yml", ".toml", ".json", ".proto", ".sh", ".tpl", ".go", ".txt", ".lock")
MACHINE_PATHS = ("/usr/",)
"""Backticked paths of the machine, not of an API (`/usr/bin/rustc`)."""
SKIP_DIRS = {".git", "target", "__pycache__", "node_modules", ".pytest_cache"}


def hand_written(text: str) -> str:
    """The page without its generated parts (the generator checks what those name) and without
    fenced blocks (pictures and examples)."""
    text = re.sub(r"<!-- BEGIN GENERATED (\w+).*?<!-- END GENERATED \1 -->", "", text, flags=re.S)
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def backticked(text: str) -> list[str]:
    return [" ".join(t.split()) for t in re.findall(r"`([^`]+)`", text)]


def repo_files() -> dict[str, list[Path]]:
    """Every file in the working tree by name."""
    out: dict[str, list[Path]] = {}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in files:
            out.setdefault(name, []).append(Path(root) / name)
    return out


def code_strings() -> tuple[set[str], list[re.Pattern]]:
    """String constants of the Python packages, and their f-strings (those with a fixed beginning) as
    patterns."""
    constants, patterns = set(), []
    for path in gen.modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                # A formatted value stands for one name or number, after a fixed beginning.
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else r"[\w-]+" for v in node.values]
                patterns.append(re.compile("".join(parts) + "$"))
    return constants, patterns


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


TEXT = DOC.read_text()
HAND = hand_written(TEXT)
TOKENS = backticked(HAND)


def test_the_generated_parts_are_current():
    assert gen.render(TEXT) == TEXT, (
        "docs/architecture.md's generated parts are stale: run ~/.cache/infermesh/venv/bin/python scripts/gen_architecture.py")


def test_every_top_level_folder_and_every_package_is_in_the_folder_table():
    listed = {folder for folder, _, _ in gen.FOLDERS}
    present = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and not p.name.endswith(".egg-info")}
    assert set(TOP_FOLDERS) <= present
    assert {f for f in TOP_FOLDERS if not any(entry.startswith(f + "/") for entry in listed)} == set()
    for name, folder in gen.packages().items():
        assert f"{folder.relative_to(REPO)}/" in listed, name


def test_every_module_has_a_layer_and_says_what_it_is():
    for module, path in gen.modules().items():
        if module in ("infermesh", "infermesh.sidecar.proto", *gen.COMPONENTS):
            continue
        assert gen.layer(module), module
        assert gen.module_summary(path), f"{path.relative_to(REPO)}: no docstring to say what it holds"


def _paths(text: str) -> set[str]:
    """Repository paths the page names, backticked or not: `filter/src/config.rs`, docs/filter.md,
    a bare file name such as `body.rs`."""
    found = set()
    for token in TOKENS:
        first = token.split("/", 1)[0]
        if " " in token or token.startswith(("/", "~", "$", ".")):
            continue
        if "/" in token and (first in TOP_FOLDERS or token.endswith("/")) or token.endswith(FILE_SUFFIXES) and re.fullmatch(r"[\w./-]+", token):
            found.add(token)
    for m in re.finditer(rf"(?<![\w/.`-])((?:{'|'.join(map(re.escape, TOP_FOLDERS))})/[\w./-]*[\w/])", text):
        found.add(m.group(1))
    return found


def test_every_file_and_folder_the_page_names_exists():
    by_name = repo_files()
    missing = []
    for p in sorted(_paths(HAND)):
        if "/" in p.rstrip("/"):
            if not (REPO / p).exists():
                missing.append(p)
        elif not ((REPO / p).exists() or p in by_name):
            missing.append(p)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_the_page_names_exists():
    modules = gen.modules()
    constants, patterns = code_strings()
    missing = []
    for token in TOKENS:
        if not re.fullmatch(r"infermesh(\.\w+)+", token):
            continue
        parts = token.split(".")
        prefix = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)
        rest = parts[len(prefix.split(".")):] if prefix else parts
        if prefix and (not rest or (len(rest) == 1 and rest[0] in top_level_names(modules[prefix]))):
            continue
        # Not a module: a name the code uses (a gRPC service or health name).
        if token in constants or any(p.match(token) for p in patterns) or token in {s for s, _, _ in gen.grpc_methods()}:
            continue
        missing.append(token)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_http_path_the_page_names_is_a_route():
    routes = gen.http_routes()
    patterns = {(m, re.compile(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(p)) + "$")) for m, p, _ in routes}
    named = []
    for token in TOKENS:
        m = re.fullmatch(r"(?:(GET|POST|PUT|DELETE|PATCH) )?(/[^\s?]*)(\?\S*)?", token)
        if m and not token.startswith(MACHINE_PATHS):
            named.append((m.group(1), m.group(2)))
    assert named, "the page names no HTTP path at all"
    missing = [(method, path) for method, path in named
               if not any(p.match(path) and method in (None, m) for m, p in patterns)]
    assert not missing, f"docs/architecture.md names HTTP routes the sidecar does not register: {missing}"


def test_every_grpc_method_the_page_names_exists():
    methods = {f"{service}/{method}" for service, method, _ in gen.grpc_methods()}
    named = [t for t in TOKENS if re.fullmatch(r"infermesh\.[\w.]+/\w+", t)]
    assert named and not set(named) - methods, set(named) - methods
    for t in TOKENS:
        if re.fullmatch(r"[A-Z][A-Za-z]+State", t):  # a bare Admin method
            assert any(m.endswith("/" + t) for m in methods), t


def test_every_header_the_page_names_is_in_the_code():
    sources = [*gen.modules().values(), *(REPO / "filter" / "src").rglob("*.rs")]
    code = "\n".join(p.read_text() for p in sources)
    named = {t for t in TOKENS if re.fullmatch(r"x-infermesh-[a-z-]*[a-z]", t)}
    assert named
    assert not {h for h in named if h not in code}, sorted(h for h in named if h not in code)


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\(([^)#\s]+)", TEXT))) or ["(none)"])
def test_links_stay_inside_the_repository(link):
    if link == "(none)":
        return
    assert not re.match(r"\w+://", link), link
    target = (DOC.parent / link).resolve()
    assert REPO in target.parents and target.exists(), link


def test_nothing_points_outside_the_repository():
    assert "../" not in TEXT and "/work/" not in TEXT and "DESIGN.md" not in TEXT


LAYER_RANK = {gen.BASE: 0, gen.COMPONENT: 1, gen.APPLICATION: 2, gen.HARNESS: 2}


def test_no_module_imports_a_layer_above_its_own():
    """The layers the page describes: the shared base imports no other module of infermesh, a
    component imports only the base and (the sidecar) the policy model, applications anything."""
    above = {m: sorted(d for d in deps if LAYER_RANK[gen.layer(d)] > LAYER_RANK[gen.layer(m)])
             for m, deps in gen.graph().items()}
    assert not {m: v for m, v in above.items() if v}
    assert not {m: sorted(deps) for m, deps in gen.graph().items() if gen.layer(m) == gen.BASE and deps}


def raw_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "spec_from_file_location":
            names |= {ast.unparse(a) for a in node.args}
    return names


def is_test_module(name: str) -> bool:
    parts = re.split(r"[./\"' ]+", name)
    return any(p in ("e2e", "tests", "conftest") or p.startswith("test_") for p in parts)


def test_no_package_module_and_no_benchmark_imports_a_test_module():
    files = [*gen.modules().values(), *(REPO / "filter" / "bench").glob("*.py"), *(REPO / "sidecar" / "bench").glob("*.py")]
    found = {str(f.relative_to(REPO)): sorted(n for n in raw_imports(f) if is_test_module(n)) for f in files}
    assert not {f: v for f, v in found.items() if v}
