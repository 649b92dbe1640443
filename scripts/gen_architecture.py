"""Writes the generated parts of docs/architecture.md from the code as it is.

    ~/.cache/infermesh/venv/bin/python scripts/gen_architecture.py          # rewrite them in place
    ~/.cache/infermesh/venv/bin/python scripts/gen_architecture.py --check  # exit 1 when stale

Each part sits between `<!-- BEGIN GENERATED name ... -->` and `<!-- END GENERATED name -->` in
the page; everything outside the markers is written by hand. The parts:

- folders: each folder, its import name (pyproject.toml's package-dir) and its layer;
- layers, meshconfig, sidecar: who imports whom (every `import` in the code, function-level ones
  included), as mermaid pictures;
- modules: each Python module's first docstring sentence, what it imports, who imports it, and
  the import cycles;
- filter, chart: each Rust source file's `//!` summary, each chart template's leading comment;
- http, grpc: the sidecar's HTTP routes (read from the route registrations in sidecar/*.py) and
  gRPC services (inference.proto, grpc_api.py);
- settings: the shared settings (infermesh/settings.py), field by field from the pydantic model.

infermesh/tests/test_architecture_doc.py fails when a part is stale, and when the page names a
file, module, endpoint or header that no longer exists.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
import types
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# ---- folders, packages, layers ----------------------------------------------------------------

BASE = "shared base"
COMPONENT = "component"
APPLICATION = "application"
HARNESS = "application (test and bench harness)"

SHARED_BASE = ("infermesh.settings", "infermesh.logs", "infermesh.paths")
"""The modules both components import: they import neither component (test_import_direction.py)."""
HARNESS_MODULES = ("infermesh.fuzz_inputs", "infermesh.chart_render", "infermesh.istiod_gateway")
"""Code that tests and benchmarks run, kept out of test modules so a benchmark imports no test."""
COMPONENTS = ("infermesh.meshconfig", "infermesh.sidecar")

# Folders that hold no Python package, with their layer and what they hold (import names of the
# Python ones come from pyproject.toml).
FOLDERS: list[tuple[str, str, str]] = [
    ("infermesh/", "", "the shared base (`settings.py`, `logs.py`, `paths.py`) and, on top of the components, the "
     "applications: the CLI, the launcher, the drills, the side-by-side benchmark, the model builder, and the "
     "harness that tests and benchmarks share; the base stays in this folder"),
    ("mesh-config/meshconfig/", "", "the typed policy, every Envoy decision, its assemblies (static bootstrap, xDS "
     "snapshot, Istio objects) and the control plane"),
    ("mesh-config/policies/", "data", "the bundled policies (`local.yaml`, `production.yaml`)"),
    ("sidecar/", "", "the pool's sidecar: vLLM engines, admission, breakers, the HTTP, gRPC and admin fronts"),
    ("sidecar/proto/", "", "the gRPC API (`inference.proto`) and its generated stubs (scripts/gen-proto.sh)"),
    ("filter/", COMPONENT, "the Envoy filter (Rust): one request flow, as a proxy-wasm module or a native dynamic "
     "module"),
    ("charts/infermesh/", COMPONENT, "the Helm chart: sidecar pools and the Istio objects"),
    ("filter/bench/", APPLICATION, "the filter benchmark (scripts run as files)"),
    ("sidecar/bench/", APPLICATION, "the sidecar front benchmarks (scripts run as files)"),
    ("scripts/", APPLICATION, "set-up, build and generator scripts (this page's generator too)"),
    ("infermesh/tests/", "tests", "unit tests of the applications, the import directions, this page"),
    ("mesh-config/tests/", "tests", "unit tests of the policy, the Envoy and Istio generators, the control plane"),
    ("sidecar/tests/", "tests", "unit tests of the sidecar (fake engines, named as fakes)"),
    ("charts/tests/", "tests", "the chart: lint, schemas, golden files, chart == the policy model"),
    ("filter/tests/", "tests", "the filter's fuzz tests and their configs (cargo)"),
    ("e2e/", "tests", "tests that run real processes: Envoy + compiled filter, control plane, vLLM sidecars, drills"),
    ("e2e/istiod/", "tests", "Istio's own discovery server without Kubernetes (Go, scripts/setup-istiod.sh)"),
    ("requirements/", "", "the Python packages: what infermesh asks for (`direct.txt`) and the pinned lock (`lock.txt`)"),
    ("docs/", "", "how it works and what was measured"),
]


def packages() -> dict[str, Path]:
    """Import name -> folder, as pyproject.toml maps them."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in conf["package-dir"].items()}


def modules() -> dict[str, Path]:
    """Every module of the packages (tests, benchmarks and generated stubs left out; the stubs are
    the one module `infermesh.sidecar.proto`)."""
    out: dict[str, Path] = {}
    for package, folder in packages().items():
        for f in sorted(folder.glob("*.py")):
            out[package if f.stem == "__init__" else f"{package}.{f.stem}"] = f
    out["infermesh.sidecar.proto"] = packages()["infermesh.sidecar"] / "proto" / "__init__.py"
    return out


def layer(module: str) -> str:
    if module in SHARED_BASE:
        return BASE
    if module in HARNESS_MODULES:
        return HARNESS
    if any(module == c or module.startswith(c + ".") for c in COMPONENTS):
        return COMPONENT
    return APPLICATION


def short(module: str) -> str:
    return module.removeprefix("infermesh.")


def imported_names(module: str, path: Path) -> set[str]:
    """Every name `path` (module `module`) imports, anywhere in it (function-level imports too), as
    absolute names: `from x import y` gives both `x` and `x.y` (y may be a module or a name)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            names |= {name} | {f"{name}.{a.name}" for a in node.names}
    return names


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `path` imports, anywhere in it (function-level imports too)."""
    names = imported_names(module, path)
    found = set()
    for name in names:
        if name.startswith("infermesh.sidecar.proto"):
            found.add("infermesh.sidecar.proto")
            continue
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in known:
                found.add(candidate)
                break
    # A package's own __init__ is no dependency worth drawing (they are empty).
    return found - {module, "infermesh", *COMPONENTS}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items() if m not in ("infermesh", *COMPONENTS)}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def first_sentence(text: str | None) -> str:
    """The first sentence of a docstring or comment's first paragraph, on one line."""
    if not text:
        return ""
    lines = text.strip().split("\n\n")[0].splitlines()
    listed = next((i for i, line in enumerate(lines) if line.lstrip().startswith("- ")), None)
    para = " ".join(" ".join(lines[:listed]).split())
    m = re.search(r"(?<![ .][a-z])(?<!e\.g)(?<!i\.e)\.(\s|$)", para)
    if m:
        para = para[: m.start() + 1]
    elif listed is not None:  # a sentence that goes on as a list: its lead, then an ellipsis
        para = para.rstrip(":") + " …"
    return para.replace("|", "\\|")


def module_summary(path: Path) -> str:
    return first_sentence(ast.get_docstring(ast.parse(path.read_text())))


# ---- the parts ------------------------------------------------------------------------------


def import_name(folder: str) -> str | None:
    """The package a folder is, as pyproject.toml declares it (package-dir and packages)."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name, root in sorted(packages().items(), key=lambda kv: -len(str(kv[1]))):
        rel = (REPO / folder).relative_to(REPO)
        if rel == root.relative_to(REPO) or root.relative_to(REPO) in rel.parents:
            sub = rel.relative_to(root.relative_to(REPO)).parts
            candidate = ".".join([name, *sub])
            return candidate if candidate in conf["packages"] else None
    return None


def part_folders() -> str:
    by_folder = {str(folder.relative_to(REPO)) + "/": name for name, folder in packages().items()}
    rows = ["| folder | import name | layer | holds |", "|---|---|---|---|"]
    for folder, kind, holds in FOLDERS:
        assert (REPO / folder).is_dir(), f"{folder}: no such folder (FOLDERS in {Path(__file__).name})"
        name = import_name(folder)
        if name is not None:
            shown = f"`{name}`"
            kind = {"infermesh": f"{BASE} + {APPLICATION}"}.get(name, COMPONENT if name.startswith(COMPONENTS) else kind)
        elif folder == "filter/":
            crate = tomllib.loads((REPO / "filter" / "Cargo.toml").read_text())["package"]["name"]
            shown = f"crate `{crate.replace('-', '_')}`"
        else:
            shown = "—"
        rows.append(f"| `{folder}` | {shown} | {kind or '—'} | {holds} |")
    unmapped = set(by_folder) - {f for f, _, _ in FOLDERS}
    assert not unmapped, f"packages without a row in FOLDERS: {sorted(unmapped)}"
    return "\n".join(rows)


def _node(name: str) -> str:
    return re.sub(r"\W", "_", name)


def part_layers() -> str:
    """Applications and the shared base module by module, each component as one box; an arrow
    to a component names the modules of it that are imported."""
    g = graph()

    def box(m: str) -> str:
        return next((c for c in COMPONENTS if m.startswith(c + ".")), m)

    edges: dict[tuple[str, str], set[str]] = {}
    for m, deps in g.items():
        for d in deps:
            a, b = box(m), box(d)
            if a != b:
                edges.setdefault((a, b), set()).add(short(d).split(".", 1)[1] if b in COMPONENTS else "")
    groups = {
        APPLICATION: sorted(m for m in g if layer(m) == APPLICATION),
        HARNESS: sorted(m for m in g if layer(m) == HARNESS),
        COMPONENT: list(COMPONENTS),
        BASE: sorted(m for m in g if layer(m) == BASE),
    }
    lines = ["```mermaid", "flowchart TB"]
    for i, (title, members) in enumerate(groups.items()):
        lines.append(f'  subgraph layer{i}["{title}"]')
        lines += [f'    {_node(m)}["{short(m)}"]' for m in members]
        lines.append("  end")
    for (a, b), via in sorted(edges.items()):
        label = ", ".join(sorted(v for v in via if v))
        lines.append(f'  {_node(a)} -->|"{label}"| {_node(b)}' if label else f"  {_node(a)} --> {_node(b)}")
    lines.append("```")
    return "\n".join(lines)


def part_component(component: str) -> str:
    """One component's modules and their imports among themselves and of the shared base (and,
    for the sidecar, of the policy model)."""
    g = graph()
    inside = sorted(m for m in g if m.startswith(component + "."))
    outside = sorted({d for m in inside for d in g[m] if not d.startswith(component + ".")})
    lines = ["```mermaid", "flowchart LR"]
    lines.append(f'  subgraph {_node(component)}["{component}"]')
    lines += [f'    {_node(m)}["{short(m).split(".", 1)[1]}"]' for m in inside]
    lines.append("  end")
    lines += [f'  {_node(m)}(["{short(m)}"])' for m in outside]
    for m in inside:
        lines += [f"  {_node(m)} --> {_node(d)}" for d in sorted(g[m])]
    lines.append("```")
    return "\n".join(lines)


def part_modules() -> str:
    g = graph()
    files = modules()
    users: dict[str, set[str]] = {m: set() for m in g}
    for m, deps in g.items():
        for d in deps:
            users.setdefault(d, set()).add(m)
    rows = ["| module | file | layer | what it is (its docstring) | imports | imported by |", "|---|---|---|---|---|---|"]
    order = [BASE, COMPONENT, APPLICATION, HARNESS]
    for m in sorted(g, key=lambda m: (order.index(layer(m)), m)):
        rows.append(f"| `{m}` | `{files[m].relative_to(REPO)}` | {layer(m)} | {module_summary(files[m])} | "
                    f"{', '.join(short(d) for d in sorted(g[m])) or '—'} | {', '.join(short(u) for u in sorted(users[m])) or '—'} |")
    loops = cycles(g)
    rows.append("")
    rows.append("Import cycles: " + ("; ".join(" ↔ ".join(short(m) for m in c) for c in loops) if loops else "none") + ".")
    return "\n".join(rows)


def part_filter() -> str:
    rows = ["| file | what it is (its `//!` comment) |", "|---|---|"]
    for f in sorted((REPO / "filter" / "src").rglob("*.rs")):
        doc = "\n".join(line[3:].strip() if len(line) > 3 else "" for line in f.read_text().splitlines() if line.startswith("//!"))
        rows.append(f"| `{f.relative_to(REPO)}` | {first_sentence(doc) or '—'} |")
    return "\n".join(rows)


def template_comment(text: str) -> str:
    """A template's leading comment: a `{{/* */}}` block or `#` lines, before any object."""
    m = re.search(r"\{\{-?\s*/\*(.*?)\*/\s*-?\}\}", text, re.S)
    lead = [line for line in text.splitlines() if line.strip()]
    hashes = []
    for line in lead:
        if line.startswith("#"):
            hashes.append(line.lstrip("# "))
        elif hashes or not line.startswith("{{"):
            break
    if m and (not hashes or text.index(m.group(0)) < text.index("#")):
        return m.group(1)
    return " ".join(hashes)


def part_chart() -> str:
    rows = ["| template | what it renders or decides (its leading comment) |", "|---|---|"]
    for f in sorted((REPO / "charts" / "infermesh" / "templates").iterdir()):
        rows.append(f"| `{f.relative_to(REPO)}` | {first_sentence(template_comment(f.read_text())) or '—'} |")
    return "\n".join(rows)


HTTP_METHODS = {"get", "post", "put", "delete", "patch"}


def http_routes() -> list[tuple[str, str, str]]:
    """(method, path, module.handler) of every route the sidecar registers: `@app.METHOD(path)`
    decorators and `app.add_api_route(path, handler, methods=[...])` calls, with paths built in
    a `for` over a literal list evaluated for each of its items."""
    found: list[tuple[str, str, str]] = []
    sidecar = packages()["infermesh.sidecar"]
    for f in sorted(sidecar.glob("*.py")):
        tree = ast.parse(f.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                  for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value.value, str)}
        where = f"{f.stem}"

        def value(node: ast.AST, env: dict) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.Name):
                v = env.get(node.id, consts.get(node.id))
                return v if isinstance(v, str) else None
            if isinstance(node, ast.JoinedStr):
                parts = [value(v.value if isinstance(v, ast.FormattedValue) else v, env) for v in node.values]
                return None if None in parts else "".join(parts)
            return None

        def bind(target: ast.AST, item: ast.AST, env: dict) -> dict:
            if isinstance(target, ast.Name):
                return {**env, target.id: item.value if isinstance(item, ast.Constant) else None}
            if isinstance(target, ast.Tuple) and isinstance(item, ast.Tuple) and len(target.elts) == len(item.elts):
                for t, i in zip(target.elts, item.elts):
                    env = bind(t, i, env)
            return env

        def visit(node: ast.AST, env: dict) -> None:
            if isinstance(node, ast.For) and isinstance(node.iter, (ast.List, ast.Tuple)):
                for item in node.iter.elts:
                    for child in node.body:
                        visit(child, bind(node.target, item, env))
                return
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for d in node.decorator_list:
                    if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in HTTP_METHODS and d.args
                            and (path := value(d.args[0], env)) and path.startswith("/")):
                        found.append((d.func.attr.upper(), path, f"{where}: {node.name}"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_api_route" and node.args:
                path = value(node.args[0], env)
                methods = next((k.value for k in node.keywords if k.arg == "methods"), None)
                names = [value(m, env) for m in methods.elts] if isinstance(methods, (ast.List, ast.Tuple)) else ["GET"]
                handler = node.args[1] if len(node.args) > 1 else None
                # A wrapper call (`_route(front.generate, name)`) is named by what it wraps.
                if isinstance(handler, ast.Call) and handler.args:
                    handler = handler.args[0]
                label = ast.unparse(handler) if handler is not None else "?"
                for method in names:
                    if path and method:
                        found.append((method.upper(), path, f"{where}: {label}"))
            for child in ast.iter_child_nodes(node):
                visit(child, env)

        visit(tree, {})
    return sorted(set(found), key=lambda r: (r[2].split(":")[0], r[1], r[0]))


ADMIN_MODULES = ("admin_api",)
"""Modules whose routes are on the admin port (127.0.0.1 by default); the others' on the serving port."""


def part_http() -> str:
    rows = ["| method | path | port | registered in: handler |", "|---|---|---|---|"]
    for method, path, handler in http_routes():
        module, name = handler.split(": ", 1)
        port = "admin" if module in ADMIN_MODULES else "serving"
        rows.append(f"| {method} | `{path}` | {port} | `{module}.py`: `{name}` |")
    return "\n".join(rows)


PROTO = REPO / "sidecar" / "proto" / "infermesh" / "v1" / "inference.proto"


def grpc_methods() -> list[tuple[str, str, bool]]:
    """(service, method, server-streaming) of inference.proto."""
    text = re.sub(r"//[^\n]*", "", PROTO.read_text())
    package = re.search(r"^\s*package\s+([\w.]+)\s*;", text, re.M).group(1)
    out = []
    for service, body in re.findall(r"service\s+(\w+)\s*\{(.*?)\}", text, re.S):
        for method, returns in re.findall(r"rpc\s+(\w+)\s*\([^)]*\)\s*returns\s*\(([^)]*)\)", body):
            out.append((f"{package}.{service}", method, returns.strip().startswith("stream ")))
    return out


def part_grpc() -> str:
    api = (packages()["infermesh.sidecar"] / "grpc_api.py").read_text()
    tree = ast.parse(api)
    # Which start function registers which service: the Admin servicer on the admin port.
    port_of: dict[str, str] = {}
    reflection_on: list[str] = []
    for fn in tree.body:
        if isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef) and fn.name.startswith("start_"):
            body = ast.unparse(fn)
            port = "admin" if "admin" in fn.name else "serving"
            for service, _, _ in grpc_methods():
                name = service.rsplit(".", 1)[1]
                if f"add_{name}Servicer" in body or f"add_{name.lower()}_servicer" in body:
                    port_of[service] = port
            if "add_HealthServicer_to_server" in body:
                port_of["grpc.health.v1.Health"] = port
            if "enable_server_reflection" in body:
                reflection_on.append(port)
    rows = ["| method | streaming | port |", "|---|---|---|"]
    for service, method, stream in grpc_methods():
        rows.append(f"| `{service}/{method}` | {'server' if stream else '—'} | {port_of.get(service, '?')} |")
    if "grpc.health.v1.Health" in port_of:
        rows.append(f"| `grpc.health.v1.Health/Check`, `/Watch` | Watch: server | {port_of['grpc.health.v1.Health']} |")
    if reflection_on:
        rows.append(f"| `grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo` | both ways | {' and '.join(sorted(reflection_on))} |")
    return "\n".join(rows)


def _type(t: typing.Any) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("None" if a is type(None) else _type(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]"
    return getattr(t, "__name__", str(t))


BOUND_SIGN = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "length ≥", "max_length": "length ≤", "pattern": "matches"}


def _bounds(field: typing.Any) -> str:
    """The constraints on a field, wherever pydantic keeps them (the field, or an Annotated
    inside `X | None` or `dict[K, V]`)."""
    found: list[str] = []

    def collect(meta: list, prefix: str = "") -> None:
        for m in meta:
            for name, sign in BOUND_SIGN.items():
                v = getattr(m, name, None)
                if v is not None:
                    found.append(f"{prefix}{sign} `{v}`" if name == "pattern" else f"{prefix}{sign} {v}")
            collect(getattr(m, "metadata", []) or [], prefix)

    def walk(t: typing.Any, prefix: str = "") -> None:
        origin, args = typing.get_origin(t), typing.get_args(t)
        if origin is typing.Annotated:
            collect(list(args[1:]), prefix)
            walk(args[0], prefix)
        elif origin in (typing.Union, types.UnionType):
            for a in args:
                walk(a, prefix)
        elif origin is dict:
            walk(args[0], "key ")

    collect(field.metadata)
    walk(field.annotation)
    return ", ".join(dict.fromkeys(found)) or "—"


def _default(field: typing.Any) -> str:
    from pydantic_core import PydanticUndefined

    v = field.default
    if v is PydanticUndefined:
        return "required"
    if hasattr(v, "model_dump"):
        return f"`{type(v).__name__}()`"
    text = f"`{v!r}`".replace("'", '"')
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1 << 20 and v % (1 << 20) == 0:
        text += f" ({v >> 20} MiB)"
    return text


def part_settings() -> str:
    import pydantic

    from infermesh import settings

    out = []
    models = [v for v in vars(settings).values()
              if isinstance(v, type) and issubclass(v, pydantic.BaseModel) and v.__module__ == settings.__name__ and v.model_fields]
    for model in models:
        out.append(f"`{model.__name__}`: {' '.join((model.__doc__ or '').split())}")
        out.append("")
        out.append("| field | type | default | bounds | meaning |")
        out.append("|---|---|---|---|---|")
        for name, field in model.model_fields.items():
            meaning = " ".join((field.description or "").split()).replace("|", "\\|")
            out.append(f"| `{name}` | {_type(field.annotation)} | {_default(field)} | {_bounds(field)} | {meaning} |")
        out.append("")
    return "\n".join(out).rstrip()


PARTS = {
    "folders": part_folders,
    "layers": part_layers,
    "meshconfig": lambda: part_component("infermesh.meshconfig"),
    "sidecar": lambda: part_component("infermesh.sidecar"),
    "modules": part_modules,
    "filter": part_filter,
    "chart": part_chart,
    "http": part_http,
    "grpc": part_grpc,
    "settings": part_settings,
}

BEGIN = "<!-- BEGIN GENERATED {name}: scripts/gen_architecture.py writes this part; do not edit it by hand -->"
END = "<!-- END GENERATED {name} -->"


def render(doc: str) -> str:
    """`doc` with every generated part rewritten (each must be there once)."""
    for name, make in PARTS.items():
        begin, end = BEGIN.format(name=name), END.format(name=name)
        assert doc.count(begin) == 1 and doc.count(end) == 1, f"docs/architecture.md: markers of part {name!r} missing or repeated"
        head, rest = doc.split(begin)
        _, tail = rest.split(end)
        doc = f"{head}{begin}\n{make()}\n{end}{tail}"
    return doc


def main(argv: list[str]) -> int:
    old = DOC.read_text()
    new = render(old)
    if "--check" in argv:
        if new != old:
            print(f"{DOC.relative_to(REPO)} is stale: run {Path(__file__).relative_to(REPO)}", file=sys.stderr)
            return 1
        return 0
    if new != old:
        DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
