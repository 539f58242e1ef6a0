"""KV transfer between prefill and decode workers over two-rank torch.distributed groups.

Import from the modules themselves (this package re-exports nothing, so no
module imports back through it): ``wire`` (stream layout, dtype names,
KVTransferError), ``checksum``, ``pair`` (backend choice, store server, one
live pair), ``sender`` (prefill side), ``receiver`` (decode side). See
DESIGN.md, "KV transfer", and docs/architecture.md for the wire contract.
"""
