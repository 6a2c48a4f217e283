"""A sequence restored from a peer, as an engine restores one after its worker died: a prompt's
chunk, then one chunk per decode step (977 chunks, 8.2 MB), fetched with one ``fetch`` each (one
round trip each) against ``fetch_chunks`` (up to 64 in flight), from a ``PeerServer`` in this
process over loopback TCP. Three rounds; every restore checked byte for byte.

    python3 benches/python/peer_restore.py
"""

import time

import numpy as np

import dejavu


def main() -> None:
    spec = dejavu.KvSpec(layers=8, kv_heads=2, head_dim=128, dtype="float16")
    layout = dejavu.KvLayout.per_layer(spec, 1, 1024, "bhsd")
    rng = np.random.default_rng(1)
    cache = dejavu.KvCache.wrap(layout, [rng.integers(0, 256, size=n, dtype=np.uint8) for n in layout.buffer_sizes])

    def region(tokens: range) -> dejavu.KvRegion:
        return dejavu.KvRegion(layers=range(8), slots=range(1), heads=range(2), tokens=tokens)

    chunks = [range(0, 24)] + [range(t, t + 1) for t in range(24, 1000)]
    regions = [region(c) for c in chunks]
    whole = region(range(0, 1000))
    server = dejavu.PeerServer(b"bench")
    try:
        peer = dejavu.Store.peer(server.address, b"bench", node=1, epoch=1)
        for r in regions:
            dejavu.flush(peer, cache, r, (1, 0), (1, 0), 0)
        for _ in range(3):
            one_by_one = dejavu.KvCache(layout)
            began = time.perf_counter()
            for r in regions:
                dejavu.fetch(peer, one_by_one, r, (1, 0), (1, 0), 0)
            each = time.perf_counter() - began
            in_flight = dejavu.KvCache(layout)
            began = time.perf_counter()
            outcome = dejavu.fetch_chunks(peer, in_flight, regions, (1, 0), (1, 0), 0)
            together = time.perf_counter() - began
            assert outcome["fetched"] == len(regions) and outcome["error"] is None
            for restored in (one_by_one, in_flight):
                assert bytes(restored.gather(whole)) == bytes(cache.gather(whole))
            print(f"{len(regions)} chunks ({outcome['bytes'] / 1e6:.1f} MB): one fetch each {each * 1e3:.1f} ms, "
                  f"fetch_chunks {together * 1e3:.1f} ms ({each / together:.1f}x)")
    finally:
        server.close()


if __name__ == "__main__":
    main()
