"""KV transfer between prefill and decode workers over two-rank torch.distributed groups.

Modules: ``wire`` (stream layout, dtype names, KVTransferError), ``checksum``,
``pair`` (backend choice, store server, one live pair), ``sender`` (prefill
side), ``receiver`` (decode side). See DESIGN.md, "KV transfer".
"""

from pdserve.kvtransfer.checksum import KVChecksum, combine_checksums, kv_checksum
from pdserve.kvtransfer.pair import KVPair, PairStoreServer, transfer_backend
from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV, TransferFailed, check_transfer
from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs, SendCompleter
from pdserve.kvtransfer.wire import KVTransferError, dtype_from_name, dtype_name

__all__ = [
    "DecodePairs",
    "KVChecksum",
    "KVPair",
    "KVTransferError",
    "OutgoingKV",
    "PairStoreServer",
    "PrefillPairs",
    "ReceivedKV",
    "SendCompleter",
    "TransferFailed",
    "check_transfer",
    "combine_checksums",
    "dtype_from_name",
    "dtype_name",
    "kv_checksum",
    "transfer_backend",
]
