"""Which route a request takes, read from a route table itself, for the tests that hold the
chart's VirtualService to the plain-Envoy route table: Envoy's RouteMatch (envoy_resources) and
Istio's HTTPMatchRequest as istiod translates it into one (uri exact and regex: the path without
its query; uri prefix: the :path as sent; a header StringMatch `{}`: presence; withoutHeaders: none of them;
regexes matched in full, as RE2 does). The first route whose conditions all hold wins.

What each table decides for a request is an `Outcome`: whether the Wasm filter runs on the route,
the pool and front it goes to, and the routing headers the route sets itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ROUTING_HEADER_PREFIX = "x-infermesh-"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def stripped(self) -> "Request":
        """Without client-sent x-infermesh-* headers (the HCM's early header mutation)."""
        return Request(self.method, self.path, tuple((k, v) for k, v in self.headers if not k.startswith(ROUTING_HEADER_PREFIX)))

    def with_header(self, name: str, value: str) -> "Request":
        return Request(self.method, self.path, tuple((k, v) for k, v in self.headers if k != name) + ((name, value),))


@dataclass(frozen=True)
class Outcome:
    route: str
    """The route's name (not compared: the two tables may name a route's gRPC twin alike)."""
    filter_runs: bool
    pool: str
    grpc: bool
    sets: tuple[tuple[str, str], ...] = field(default=())
    not_found: bool = False
    """The edge's 404: the path is not the serving API's (no pool, whatever else the route says)."""

    def decision(self) -> tuple:
        return ("not found",) if self.not_found else (self.filter_runs, self.pool, self.grpc, self.sets)


def _path(path: str) -> str:
    """The path without its query, as Envoy's `path` and `safe_regex` matches compare it."""
    return path.split("?", 1)[0]


# -- Envoy ---------------------------------------------------------------------------------------


def _envoy_string(sm: dict, value: str | None) -> bool:
    if value is None:
        return False
    if "exact" in sm:
        return value.lower() == sm["exact"].lower() if sm.get("ignore_case") else value == sm["exact"]
    if "prefix" in sm:
        return value.startswith(sm["prefix"])
    return re.fullmatch(sm["safe_regex"]["regex"], value) is not None


def _envoy_matches(match: dict, req: Request) -> bool:
    if "path" in match and _path(req.path) != match["path"]:
        return False
    if "safe_regex" in match and re.fullmatch(match["safe_regex"]["regex"], _path(req.path)) is None:
        return False
    if "prefix" in match and not req.path.startswith(match["prefix"]):
        return False
    for h in match.get("headers", []):
        value = req.method if h["name"] == ":method" else req.header(h["name"])
        if "present_match" in h:
            if (value is not None) != h["present_match"]:
                return False
        elif not _envoy_string(h["string_match"], value):
            return False
    return True


def envoy_outcome(routes: list[dict], wasm_filter: str, req: Request) -> Outcome | None:
    for r in routes:
        if _envoy_matches(r["match"], req):
            if "direct_response" in r:
                assert r["direct_response"]["status"] == 404, r
                return Outcome(r["name"], wasm_filter not in r.get("typed_per_filter_config", {}), "", False, not_found=True)
            cluster = r["route"]["cluster"]
            sets = tuple(sorted((h["header"]["key"], h["header"]["value"]) for h in r.get("request_headers_to_add", [])))
            return Outcome(r["name"], wasm_filter not in r.get("typed_per_filter_config", {}),
                           cluster.removeprefix("pool_").removesuffix("_grpc"), cluster.endswith("_grpc"), sets)
    return None


# -- Istio ---------------------------------------------------------------------------------------


def _istio_string(sm: dict, value: str | None, path: bool = False) -> bool:
    if value is None:
        return False
    if not sm:
        return True  # presence
    if "exact" in sm:
        return (_path(value) if path else value) == sm["exact"]
    if "prefix" in sm:
        return value.startswith(sm["prefix"])
    return re.fullmatch(sm["regex"], _path(value) if path else value) is not None


def _istio_matches(match: dict, req: Request) -> bool:
    if "uri" in match and not _istio_string(match["uri"], req.path, path=True):
        return False
    if "method" in match and not _istio_string(match["method"], req.method):
        return False
    if not all(_istio_string(sm, req.header(name)) for name, sm in match.get("headers", {}).items()):
        return False
    return not any(_istio_string(sm, req.header(name)) for name, sm in match.get("withoutHeaders", {}).items())


def istio_outcome(http: list[dict], filter_off: set[str], pool_of_host: dict[str, str], grpc_port: int, req: Request) -> Outcome | None:
    """`filter_off`: the routes an EnvoyFilter HTTP_ROUTE patch turns the filter off on."""
    for r in http:
        if "match" not in r or any(_istio_matches(m, req) for m in r["match"]):
            if "directResponse" in r:
                assert r["directResponse"]["status"] == 404, r
                return Outcome(r["name"], r["name"] not in filter_off, "", False, not_found=True)
            dest = r["route"][0]["destination"]
            request = r.get("headers", {}).get("request", {})
            sets = tuple(sorted({**request.get("set", {}), **request.get("add", {})}.items()))
            return Outcome(r["name"], r["name"] not in filter_off, pool_of_host[dest["host"]], dest["port"]["number"] == grpc_port, sets)
    return None


# -- the filter ----------------------------------------------------------------------------------


def filter_head_decision(policy, req: Request) -> tuple[str, str] | None:
    """(class, rule) the filter gives `req` on its method, path and headers alone, as
    filter/src/classify.rs judges them (methods ASCII case-insensitive, the path without its query,
    rules in order, the default class last); None where a rule that reads the body is the first
    whose other conditions hold (then the body decides), or a regex would have to be judged. A
    reference for the tests, not a second classifier: the filter's own behaviour is held to it
    with the real filter in e2e/test_native_rules_integration.py."""
    path = re.split(r"[?#]", req.path, maxsplit=1)[0]

    def text(kind: str, want: str, value: str | None) -> bool | None:
        if value is None:
            return False
        return {"exact": value == want, "prefix": value.startswith(want)}.get(kind)

    for rule in policy.rules:
        m = rule.match
        if m.methods and req.method.lower() not in {x.lower() for x in m.methods}:
            continue
        conds = [text(m.path.kind, m.path.value, path)] if m.path is not None else []
        for h in m.headers:
            value = req.header(h.name)
            conds.append((value is None) == h.must_be_absent if h.value_match is None else text(h.value_match.kind, h.value_match.value, value))
        if None in conds:
            return None  # a regex: only the filter judges it
        if all(conds):
            return None if m.needs_body else (rule.class_, rule.name)
    return policy.default_class, "default"
