"""The run's figures where operators already look: `/metrics` in the Prometheus text format and `/api/state` as JSON,
on one HTTP port (`coordinator/start.py --metrics-port`).

Both are read from the metrics store at request time (the monitor's latest look, the peers' rows, the latest
validation), so they show what the dashboard shows and the coordinator keeps no second copy. One dict (`run_state`) is
the data; `/metrics` is that dict as Prometheus families, so the two never disagree on what they export.

Peer names and IDs come from volunteers: prometheus-client escapes label values, and they are cut to LABEL_LENGTH.
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, make_server

from hivetrain.metrics_store import MetricsReader, PeerRow

LABEL_LENGTH = 64  # characters of a peer's name or ID kept in a label
# Peers that left stay as series (left = 1) this long, so a graph sees them go; then they drop out, so the series of a
# long public run with churn stay bounded.
LEFT_PEERS_SHOWN = 3600.0
ROUND_OUTCOMES = ("averaged", "alone", "failed")  # diloco outer rounds (a sync run has none)


def _finite(value):
    """None for NaN and infinities: JSON has no such numbers, and a gauge without a value says less than a wrong one."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _peer(row: PeerRow) -> dict:
    return dict(
        peer_id=row.peer_id[:LABEL_LENGTH], name=row.name[:LABEL_LENGTH], left=row.left_at is not None,
        last_seen=row.last_seen, samples=row.samples, samples_per_second=_finite(row.samples_per_second),
        epoch=row.epoch, client_mode=row.client_mode, round_bytes=row.round_bytes,
        rounds={outcome: getattr(row, f"rounds_{outcome}") for outcome in ROUND_OUTCOMES},
    )


def run_state(store: str | Path, now: float | None = None) -> dict:
    """What `/api/state` returns, and `/metrics` exports: the run, the monitor's latest look at the swarm, the latest
    validation, the diloco rounds, and each peer in the swarm or gone less than LEFT_PEERS_SHOWN ago."""
    now = time.time() if now is None else now
    with MetricsReader(store) as reader:
        run, snapshot, validation = reader.run(), reader.latest_snapshot(), reader.latest_validation()
        rows = [row for row in reader.peers() if row.left_at is None or now - row.left_at < LEFT_PEERS_SHOWN]
    peers = [_peer(row) for row in rows]
    alive = [peer for peer in peers if not peer["left"]]
    return dict(
        run=run and dict(run_id=run.run_id, preset=run.preset, fingerprint=run.fingerprint, started=run.started),
        swarm=snapshot and dict(
            time=snapshot.time, epoch=snapshot.epoch, alive_peers=snapshot.alive_peers, clients=snapshot.clients,
            samples_per_second=_finite(snapshot.samples_per_second), mean_loss=_finite(snapshot.mean_loss),
            samples_accumulated=snapshot.samples_accumulated, target_batch_size=snapshot.target_batch_size),
        validation=validation and dict(time=validation.time, epoch=validation.epoch, loss=_finite(validation.loss),
                                       top1=_finite(validation.top1), top5=_finite(validation.top5)),
        # Summed over the peers shown: one round averaged by a group counts once per member. Sync runs have no rounds
        # of this kind (their gradients are averaged every swarm epoch): rounds and round_bytes are None there.
        rounds={outcome: sum(peer["rounds"][outcome] or 0 for peer in peers) for outcome in ROUND_OUTCOMES}
        if any(peer["rounds"]["averaged"] is not None for peer in peers) else None,
        # what the peers in the swarm sent in their last round (estimated by each peer)
        round_bytes=sum(peer["round_bytes"] for peer in alive) if any(p["round_bytes"] is not None for p in alive)
        else None,
        peers=peers,
    )


class StateCollector:
    """A prometheus-client collector that reads the store at each scrape."""

    def __init__(self, store: str | Path):
        self.store = store

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        state = run_state(self.store)

        def gauge(name: str, doc: str, value, labels: list[str] = (), values: list[tuple] = ()):
            family = GaugeMetricFamily(f"hivetrain_{name}", doc, labels=labels or None)
            if labels:
                for label_values, sample in values:
                    if sample is not None:
                        family.add_metric(label_values, sample)
            elif value is None:
                return  # nothing known yet (no look, no validation): the family is left out, not reported as 0
            else:
                family.add_metric([], value)
            families.append(family)

        families = []
        if run := state["run"]:
            info = InfoMetricFamily("hivetrain_run", "The run this coordinator keeps")
            info.add_metric([], {key: str(run[key]) for key in ("run_id", "preset", "fingerprint")})
            families.append(info)
        swarm = state["swarm"] or {}
        gauge("swarm_epoch", "The swarm's epoch (sync) or outer round (diloco)", swarm.get("epoch"))
        gauge("alive_peers", "Peers training in the swarm at the coordinator's last look", swarm.get("alive_peers"))
        gauge("clients", "Of the alive peers, those in client mode (not dialable)", swarm.get("clients"))
        gauge("samples_per_second", "Samples the peers trained per wall-clock second", swarm.get("samples_per_second"))
        gauge("mean_loss", "The peers' mean training loss", swarm.get("mean_loss"))
        gauge("last_look_timestamp_seconds", "When the coordinator last looked at the swarm", swarm.get("time"))
        validation = state["validation"] or {}
        gauge("validation_top1", "Top-1 accuracy of the latest validation", validation.get("top1"))
        gauge("validation_loss", "Loss of the latest validation", validation.get("loss"))
        gauge("validation_epoch", "Swarm epoch of the latest validation", validation.get("epoch"))
        if state["rounds"] is not None:  # diloco runs only
            rounds = CounterMetricFamily("hivetrain_rounds", "Diloco outer rounds of the peers shown, summed over the"
                                         " peers (a group's round counts once per member)", labels=["outcome"])
            for outcome, count in state["rounds"].items():
                rounds.add_metric([outcome], count)
            families.append(rounds)
        gauge("round_bytes", "Bytes the alive peers sent in their last diloco round (estimated)", state["round_bytes"])

        peers = state["peers"]
        per_peer = ["peer_id", "name"]
        gauge("peer_left", "1 once the peer has left (shown for an hour), 0 while it is in", None, per_peer,
              [((p["peer_id"], p["name"]), int(p["left"])) for p in peers])
        gauge("peer_last_seen_timestamp_seconds", "When the coordinator last saw the peer's record", None, per_peer,
              [((p["peer_id"], p["name"]), p["last_seen"]) for p in peers])
        gauge("peer_samples_per_second", "Samples the peer trained per wall-clock second", None, per_peer,
              [((p["peer_id"], p["name"]), p["samples_per_second"]) for p in peers])
        gauge("peer_round_bytes", "Bytes the peer sent in its last diloco round (estimated)", None, per_peer,
              [((p["peer_id"], p["name"]), p["round_bytes"]) for p in peers])
        samples = CounterMetricFamily("hivetrain_peer_samples", "Samples the peer contributed since it joined",
                                      labels=per_peer)
        peer_rounds = CounterMetricFamily("hivetrain_peer_rounds", "The peer's diloco outer rounds",
                                          labels=[*per_peer, "outcome"])
        for p in peers:
            samples.add_metric([p["peer_id"], p["name"]], p["samples"])
            for outcome, count in p["rounds"].items():
                if count is not None:
                    peer_rounds.add_metric([p["peer_id"], p["name"], outcome], count)
        families += [samples, peer_rounds]
        return families


def make_app(store: str | Path):
    """The WSGI app: /metrics (prometheus-client's own app) and /api/state."""
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError:
        raise ImportError("--metrics-port needs prometheus-client: pip install 'hivetrain[coordinator]'") from None

    registry = CollectorRegistry(auto_describe=False)  # no describe(): the store is read at scrapes only
    registry.register(StateCollector(store))
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/api/state":
            body = json.dumps(run_state(store), allow_nan=False).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"Served here: /metrics (Prometheus) and /api/state (JSON)\n"]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # one line per scrape would drown the coordinator's own
        pass


class MetricsServer:
    """`app` served on host:port (port 0: any free one) from a thread of its own, until close()."""

    def __init__(self, store: str | Path, host: str, port: int):
        app = make_app(store)  # first: it says which extra to install when prometheus-client is missing
        from prometheus_client.exposition import ThreadingWSGIServer

        # IPv6 hosts (e.g. ::1) need a socket of that family
        server_class = type("Server", (ThreadingWSGIServer,), dict(
            address_family=socket.AF_INET6 if ":" in host else socket.AF_INET))
        self.server = make_server(host, port, app, server_class, _QuietHandler)
        host, port = self.server.server_address[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
