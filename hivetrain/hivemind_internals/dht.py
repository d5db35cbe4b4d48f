"""Inside hivemind's DHT node, which runs in the DHT's own process (reached through DHT.run_coroutine): how it names a
key, what it holds (its storage and cache), whom it knows (its routing table) and pings, and its authorizer. hivemind's
DHT offers no public API for any of these; its protocol object holds them all."""

from __future__ import annotations

from typing import Any, Callable, Optional

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

RESERVED_SUBKEYS = DHTProtocol.RESERVED_SUBKEYS  # the subkeys hivemind's protocol keeps for itself


def key_id(key: str) -> bytes:
    """The DHT's ID of `key`, as its records carry it (DHTRecord.key)."""
    return DHTID.generate(source=key).to_bytes()


def node_authorizer(node) -> Any:
    """The authorizer the node checks every DHT request and answer with (hivemind's `authorizer=`), or None."""
    return node.protocol.authorizer


def routing_table_peers(node) -> set[PeerID]:
    """The peers in the node's routing table."""
    return set(node.protocol.routing_table.peer_id_to_uid)


async def ping(node, peer_id: PeerID) -> bool:
    """Ping `peer_id` as the DHT does (each side adds the other to its routing table); True when it answered."""
    return await node.protocol.call_ping(peer_id) is not None


def drop_held_records(node, key_ids: list[bytes], valid: Callable[[DHTRecord], bool]) -> int:
    """Remove from the node's storage and cache the records under `key_ids` that `valid` refuses; returns how many. A
    dictionary keeps the expiration of its latest entry, so an entry is removed by rebuilding the dictionary without
    it."""
    dropped = 0
    for key_bytes in key_ids:
        held_key = DHTID.from_bytes(key_bytes)
        for storage in (node.protocol.storage, node.protocol.cache):
            held = storage.get(held_key)
            if held is None:
                continue
            if not isinstance(held.value, DictionaryDHTValue):
                if not valid(DHTRecord(key_bytes, DHTProtocol.IS_REGULAR_VALUE, held.value, held.expiration_time)):
                    del storage[held_key]
                    dropped += 1
                continue
            kept = DictionaryDHTValue()
            entries = list(held.value.items())
            for subkey, (value, expiration_time) in entries:
                if valid(DHTRecord(key_bytes, DHTProtocol.serializer.dumps(subkey), value, expiration_time)):
                    kept.store(subkey, value, expiration_time)
            if len(kept) < len(entries):
                dropped += len(entries) - len(kept)
                del storage[held_key]
                if len(kept):
                    storage.store(held_key, kept, kept.latest_expiration_time)
    return dropped


def node_validator(node) -> Optional[Any]:
    """The record validator the node checks every stored record with (all validators added so far, merged)."""
    return node.protocol.record_validator
