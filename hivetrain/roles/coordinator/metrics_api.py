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

from hivetrain import install_hint
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
        rows = reader.peers()
    peers = [_peer(row) for row in rows if row.left_at is None or now - row.left_at < LEFT_PEERS_SHOWN]
    # The run's rounds so far, summed over every peer it has seen (not only those shown: a counter must not drop when
    # a peer's series does); one round averaged by a group counts once per member. Sync runs have no rounds of this
    # kind (their gradients are averaged every swarm epoch): rounds and round_bytes are None there.
    diloco = [row for row in rows if row.rounds_averaged is not None]
    rounds = {outcome: sum(getattr(row, f"rounds_{outcome}") or 0 for row in diloco) for outcome in ROUND_OUTCOMES}
    sent = [peer["round_bytes"] for peer in peers if not peer["left"] and peer["round_bytes"] is not None]
    return dict(
        run=run and dict(run_id=run.run_id, preset=run.preset, fingerprint=run.fingerprint, started=run.started),
        swarm=snapshot and dict(
            time=snapshot.time, epoch=snapshot.epoch, alive_peers=snapshot.alive_peers, clients=snapshot.clients,
            samples_per_second=_finite(snapshot.samples_per_second), mean_loss=_finite(snapshot.mean_loss),
            samples_accumulated=snapshot.samples_accumulated, target_batch_size=snapshot.target_batch_size),
        validation=validation and dict(time=validation.time, epoch=validation.epoch, loss=_finite(validation.loss),
                                       top1=_finite(validation.top1), top5=_finite(validation.top5)),
        rounds=rounds if diloco else None,
        round_bytes=sum(sent) if sent else None,  # what the peers in the swarm sent in their last round (estimated)
        peers=peers,
    )


class StateCollector:
    """A prometheus-client collector that reads the store at each scrape."""

    def __init__(self, store: str | Path):
        self.store = store

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

        state = run_state(self.store)
        if run := state["run"]:
            yield InfoMetricFamily("hivetrain_run", "The run this coordinator keeps",
                                   value={key: str(run[key]) for key in ("run_id", "preset", "fingerprint")})
        swarm, validation = state["swarm"] or {}, state["validation"] or {}
        for name, doc, value in [
            ("swarm_epoch", "The swarm's epoch (sync) or outer round (diloco)", swarm.get("epoch")),
            ("alive_peers", "Peers training in the swarm at the coordinator's last look", swarm.get("alive_peers")),
            ("clients", "Of the alive peers, those in client mode (not dialable)", swarm.get("clients")),
            ("samples_per_second", "Samples the peers trained per wall-clock second", swarm.get("samples_per_second")),
            ("mean_loss", "The peers' mean training loss", swarm.get("mean_loss")),
            ("last_look_timestamp_seconds", "When the coordinator last looked at the swarm", swarm.get("time")),
            ("validation_top1", "Top-1 accuracy of the latest validation", validation.get("top1")),
            ("validation_loss", "Loss of the latest validation", validation.get("loss")),
            ("validation_epoch", "Swarm epoch of the latest validation", validation.get("epoch")),
            ("round_bytes", "Bytes the alive peers sent in their last diloco round (estimated)", state["round_bytes"]),
        ]:
            if value is not None:  # not known (no look or validation yet, a sync run): left out, not a made-up 0
                yield GaugeMetricFamily(f"hivetrain_{name}", doc, value=value)
        if state["rounds"] is not None:
            rounds = CounterMetricFamily("hivetrain_rounds", "The run's diloco outer rounds, summed over its peers (a"
                                         " group's round counts once per member)", labels=["outcome"])
            for outcome, count in state["rounds"].items():
                rounds.add_metric([outcome], count)
            yield rounds

        peers, labels = state["peers"], ["peer_id", "name"]
        for name, doc, key in [
            ("peer_left", "1 once the peer has left (it stays a series for an hour), 0 while it is in", "left"),
            ("peer_last_seen_timestamp_seconds", "When the coordinator last saw the peer's record", "last_seen"),
            ("peer_samples_per_second", "Samples the peer trained per wall-clock second", "samples_per_second"),
            ("peer_round_bytes", "Bytes the peer sent in its last diloco round (estimated)", "round_bytes"),
        ]:
            family = GaugeMetricFamily(f"hivetrain_{name}", doc, labels=labels)
            for peer in peers:
                if peer[key] is not None:
                    family.add_metric([peer["peer_id"], peer["name"]], float(peer[key]))
            yield family
        samples = CounterMetricFamily("hivetrain_peer_samples", "Samples the peer contributed since it joined",
                                      labels=labels)
        peer_rounds = CounterMetricFamily("hivetrain_peer_rounds", "The peer's diloco outer rounds",
                                          labels=[*labels, "outcome"])
        for peer in peers:
            samples.add_metric([peer["peer_id"], peer["name"]], peer["samples"])
            for outcome, count in peer["rounds"].items():
                if count is not None:
                    peer_rounds.add_metric([peer["peer_id"], peer["name"], outcome], count)
        yield samples
        yield peer_rounds


def make_app(store: str | Path):
    """The WSGI app: /metrics (prometheus-client's own app) and /api/state."""
    try:
        from prometheus_client import CollectorRegistry, make_wsgi_app
    except ImportError:
        raise ImportError(f"--metrics-port needs prometheus-client: {install_hint('coordinator')}") from None

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

        class Server(ThreadingWSGIServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET  # an IPv6 host (::1) needs its family

        self.server = make_server(host, port, app, Server, _QuietHandler)
        host, port = self.server.server_address[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
