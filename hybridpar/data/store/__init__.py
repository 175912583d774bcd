"""The token store: a corpus tokenised once into a folder of token shards and a manifest.

    token_store.py     the store read: its folder's layout, the manifest, TokenStore, damage recorded
    unit_plan.py       its plan: the source files cut into units (plan.json), the locks, a --part's share
    unit_build.py      one unit made, under a lock of its own
    workers.py         a share's units made, here or in worker processes; waiting for other holders
    manifest_write.py  the manifest, written once every unit is done
    prepare.py         a preparation driven step by step (prepare_store, cached_store, stores_of)
    integrity.py       every chunk checked against its checksum (`hybridpar verify`, a store made again)

The public names are hybridpar.data's (TokenStore, prepare_store, cached_store, verify_store).
"""
