"""The control plane's own Prometheus series: what it refused and what Envoy refused.

    infermesh_policy_rejections_total{reason}   a policy file refused (policy.REJECTION_REASONS, or
                                                `build`: a valid policy the snapshot could not be built from)
    infermesh_policy_reloads_total              a new policy handed on to the control plane
    infermesh_xds_nacks_total{type}             a response Envoy refused (NACK), by resource type
    infermesh_xds_rollbacks_total               the last ACKed snapshot served again after a NACK

Each control plane (and each test) has its own registry; `xds_server --metrics-port` serves it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, start_http_server


class ControlPlaneMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.policy_rejections = Counter("infermesh_policy_rejections", "Policy files refused; the last good config stays served.",
                                         ["reason"], registry=self.registry)
        self.policy_reloads = Counter("infermesh_policy_reloads", "Valid policies handed on to the control plane.",
                                      registry=self.registry)
        self.xds_nacks = Counter("infermesh_xds_nacks", "xDS responses Envoy refused (NACK).", ["type"], registry=self.registry)
        self.xds_rollbacks = Counter("infermesh_xds_rollbacks", "Times the last ACKed snapshot was served again after a NACK.",
                                     registry=self.registry)

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 when never counted), e.g. value("infermesh_policy_rejections_total", reason="encoding")."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0: a free port) from a thread; the port it bound."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_address[1]

    def close(self) -> None:
        """Stop serving /metrics (the process's end stops it too)."""
        if getattr(self, "_http", None) is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
