import pytest

from pdserve.engine.block_manager import BlockManager, NoFreeBlocksError


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
    assert bm.allocate(2) == [first[2], first[0]]


def test_blocks_for_tokens():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.num_blocks_for_tokens(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError):
        BlockManager(0, 16)
