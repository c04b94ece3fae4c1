"""The prefix-cache block hash: one definition shared by the engine's block manager and the router.

A block's hash is xxh64 (seed 0) of its key: the previous block's hash as 8 little-endian bytes (absent for
a prompt's first block), then the block's token ids as 4-byte little-endian ints. engine.proto documents the
same rule for SubscribeKvEvents subscribers in other languages.
"""

import sys
from array import array
from collections.abc import Sequence

import xxhash

if sys.byteorder != "little":  # array("i") is native-endian; the documented key is little-endian
    raise ImportError("services.common.block_hash assumes a little-endian host")


def block_key(token_ids: Sequence[int], prefix_hash: int | None) -> bytes:
    """What a block's hash digests: the previous block's hash (none for the first block), then its token ids.

    The engine keeps it per cached block as its collision guard: a hit counts only if the stored key equals
    the query's, so both the tokens and the parent hash must match.
    """
    tokens = array("i", token_ids).tobytes()
    return tokens if prefix_hash is None else prefix_hash.to_bytes(8, "little") + tokens


def hash_block_key(key: bytes) -> int:
    return xxhash.xxh64_intdigest(key)


def hash_block_tokens(token_ids: Sequence[int], prefix_hash: int | None) -> int:
    """xxh64 of one block's token ids chained with the hash of the block before it (None for the first)."""
    return hash_block_key(block_key(token_ids, prefix_hash))


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of every full block of `token_ids`, first block first (a partial last block has none)."""
    hashes: list[int] = []
    previous = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash_block_tokens(token_ids[start:start + block_size], previous)
        hashes.append(previous)
    return hashes
