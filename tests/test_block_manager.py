import pytest

from pdserve.engine.scheduling.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_and_free_return_blocks():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a + b)) == 8 and bm.num_free_blocks == 0
    assert bm.usage == 1.0
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
    bm.free(a)
    assert bm.num_free_blocks == 3
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_failed_allocation_takes_nothing():
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    assert bm.num_free_blocks == 1


def test_shared_block_is_freed_only_by_last_owner():
    bm = BlockManager(num_blocks=4, block_size=16)
    blocks = bm.allocate(2)
    bm.share(blocks)
    assert [bm.ref_count(b) for b in blocks] == [2, 2]
    bm.free(blocks)
    assert bm.num_free_blocks == 2
    bm.free(blocks)
    assert bm.num_free_blocks == 4


def test_double_free_and_sharing_a_free_block_raise():
    bm = BlockManager(num_blocks=4, block_size=16)
    blocks = bm.allocate(1)
    bm.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        bm.free(blocks)
    with pytest.raises(ValueError):
        bm.share(blocks)


def test_free_queue_is_fifo():
    bm = BlockManager(num_blocks=4, block_size=16)
    first = bm.allocate(4)
    bm.free([first[2]])
    bm.free([first[0]])
    assert bm.allocate(1) == [first[2]]  # the least recently freed first
    assert bm.allocate(1) == [first[0]]


def test_an_allocation_comes_in_ascending_ids_so_a_freed_requests_blocks_come_back_adjacent():
    """A request frees its blocks last-to-first (its tail is evicted first); the next allocation that takes
    them has them in ascending order, adjacent in the cache, so a KV transfer sends such runs from the cache."""
    bm = BlockManager(num_blocks=8, block_size=16)
    first = bm.allocate(8)
    assert first == list(range(8))
    bm.free(first[2:6])  # freed 5, 4, 3, 2
    bm.free(first[:2] + first[6:])  # freed 7, 6, 1, 0
    assert bm.allocate(3) == [3, 4, 5]  # the least recently freed three, 5, 4, 3, ascending
    assert bm.allocate(3) == [2, 6, 7]


def test_blocks_for_tokens():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.num_blocks_for_tokens(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def cache_sequence(bm, token_ids):
    """Allocate blocks for token_ids, name every full block, return (blocks, hashes)."""
    blocks = bm.allocate(bm.num_blocks_for_tokens(len(token_ids)))
    parent, hashes = b"", []
    for i in range(len(token_ids) // bm.block_size):
        parent = bm.cache_block(blocks[i], parent, token_ids[i * bm.block_size:(i + 1) * bm.block_size])
        hashes.append(parent)
    return blocks, hashes


def test_prefix_hit_survives_free_and_is_verified():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))
    blocks, hashes = cache_sequence(bm, tokens)
    bm.free(blocks)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # freed but still findable
    hit, hit_hashes = bm.find_cached_prefix(tokens + [99], max_tokens=10)
    assert hit == blocks[:2] and hit_hashes == hashes
    hit, _ = bm.find_cached_prefix([0, 1, 2, 3, 4, 5, 6, 77, 8], max_tokens=9)
    assert hit == blocks[:1]  # the second block differs
    hit, _ = bm.find_cached_prefix(tokens, max_tokens=7)
    assert hit == blocks[:1]  # never more than max_tokens
    bm.share(hit)
    assert bm.ref_count(hit[0]) == 1 and bm.num_free_blocks == 7


def test_hash_collision_is_a_miss_not_wrong_kv(monkeypatch):
    from pdserve.engine.scheduling import block_manager as mod
    bm = BlockManager(num_blocks=4, block_size=2)
    monkeypatch.setattr(mod, "chain_hash", lambda parent, tokens, salt=0: b"same")  # every block collides
    blocks, _ = cache_sequence(bm, [1, 2])
    assert bm.find_cached_prefix([1, 2, 3], 3)[0] == blocks[:1]
    assert bm.find_cached_prefix([5, 6, 7], 3)[0] == []


def test_lru_eviction_order_and_disabled_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, _ = cache_sequence(bm, [1, 2, 3, 4])
    b, _ = cache_sequence(bm, [5, 6, 7, 8])
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    bm.allocate(2)  # evicts a's blocks, b's stay cached
    assert bm.find_cached_prefix([1, 2, 3, 4, 0], 5)[0] == []
    assert bm.find_cached_prefix([5, 6, 7, 8, 0], 5)[0] == b
    off = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    blocks, _ = cache_sequence(off, [1, 2, 3, 4])
    off.free(blocks)
    assert off.find_cached_prefix([1, 2, 3, 4, 0], 5)[0] == [] and off.num_cached_blocks == 0


def test_salt_separates_models():
    a = BlockManager(num_blocks=4, block_size=2, salt=1)
    b = BlockManager(num_blocks=4, block_size=2, salt=2)
    assert a.cache_block(0, b"", [1, 2]) != b.cache_block(0, b"", [1, 2])


def test_cached_or_shared_blocks_are_not_writable():
    bm = BlockManager(num_blocks=4, block_size=2)
    [x, y] = bm.allocate(2)
    assert bm.is_writable(x)
    bm.share([x])
    assert not bm.is_writable(x)
    bm.cache_block(y, b"", [1, 2])
    assert not bm.is_writable(y)


def test_same_tokens_after_different_prefix_is_a_miss():
    bm = BlockManager(num_blocks=8, block_size=2)
    blocks, _ = cache_sequence(bm, [1, 2, 3, 4])
    assert bm.find_cached_prefix([9, 9, 3, 4, 0], 5)[0] == []  # block [3, 4] cached, but after [1, 2]
    assert bm.find_cached_prefix([1, 2, 3, 4, 0], 5)[0] == blocks
