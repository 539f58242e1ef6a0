"""Which layers share which block table: KV cache groups (vLLM's hybrid KV cache manager).

A model whose every layer attends the same way (full attention, or one sliding window W) needs
one block table per request: every layer keeps the same tokens. A model that mixes the two
(Gemma 3: five sliding-window layers per global one; gpt-oss: alternating) wants different
tokens kept per layer kind: a sliding layer needs only the last W positions, a full layer all
of them. One table would make every layer hold every block, so the sliding layers would save
nothing.

The layers are cut into *groups* of ``G`` layers each, all of one kind, and each group gets its
own block table per request. Every group draws its blocks from one pool, and one block id
names the same slot of every group's tensors::

    kv_cache: [G, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]

Layer ``l`` is position ``layer_slots[l]`` of the cache's first axis, in group ``layer_groups[l]``.
A block held by group ``g`` holds the K/V of group ``g``'s layers, one per position. Because
groups have equal size, a block costs the same whatever group takes it, and one free queue
serves them all. ``G`` is the smallest kind's layer count, so that kind fills one group exactly.
The other kinds are split into groups of ``G`` layers; a last, partial group pads the unused
positions. Gemma 3 1B has 22 sliding and 4 full layers: ``G = 4``, 1 full group and 6 sliding
ones, 2 padding positions.

The one-group layout is the plain cache, ``[num_layers, ...]`` with ``layer_slots[l] = l``:
every model that does not mix kinds, and mixed ones where freeing is off (pipeline stages, a
draft model; ``kv_cache_groups_for``). Group 0 is always full attention when a model has any,
so ``Request.block_table`` (group 0's) is the table that holds every token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheGroups:
    """The layer -> (group, cache position) map of one rank's layers.

    Attributes:
        windows: per group, its layers' attention window in tokens (None: full attention).
        layer_groups: per local layer, its group.
        layer_slots: per local layer, its index into the cache tensor's first axis.
        num_cache_layers: the cache tensor's first axis (``G``; the layer count for one group).
    """

    windows: tuple[int | None, ...]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    num_cache_layers: int

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> KVCacheGroups:
        """Every layer in one group, each its own cache position (``window``: all layers' shared one)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def hybrid(cls, layer_windows: list[int | None]) -> KVCacheGroups:
        """Groups of equal size for layers whose windows are ``layer_windows`` (None: full attention).

        Kinds are ordered full attention first, then windows ascending; each kind's layers fill its
        groups in layer order. Raises ValueError for no layers."""
        if not layer_windows:
            raise ValueError("a KV cache needs at least one layer")
        kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        members = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
        size = min(len(m) for m in members.values())
        windows: list[int | None] = []
        layer_groups = [0] * len(layer_windows)
        layer_slots = [0] * len(layer_windows)
        for kind in kinds:
            for j, layer in enumerate(members[kind]):
                layer_groups[layer] = len(windows) + j // size
                layer_slots[layer] = j % size
            windows.extend([kind] * -(-len(members[kind]) // size))
        return cls(tuple(windows), tuple(layer_groups), tuple(layer_slots), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_single(self) -> bool:
        return len(self.windows) == 1

    def group_layers(self, group: int) -> list[int]:
        """The local layers of ``group``, in order."""
        return [i for i, g in enumerate(self.layer_groups) if g == group]


def layer_windows(model) -> list[int | None]:
    """Each attention layer's window in tokens (None: full attention), in layer order, from the
    ``sliding_window`` attribute of ``model``'s attention modules (one per decoder layer)."""
    return [m.sliding_window for m in model.modules() if hasattr(m, "sliding_window")]


def kv_cache_groups_for(model, config) -> KVCacheGroups:
    """The layout for ``model`` (an ``nn.Module`` whose attention modules carry ``sliding_window``)
    under ``config`` (an ``EngineConfig``).

    One group when every layer shares one window or none; a group per ``G`` layers of a kind when
    they mix (module docstring). Blocks that leave a window are then freed (``KVCacheManager``).
    Window freeing is off, with every layer in one group that keeps every block (logged), for
    ``--disable-hybrid-kv-cache-manager`` (mixed models only, as vLLM's flag), pipeline stages (a
    stage sees only its own layers) and a draft model (its own layers attend over the whole context
    through the same block tables)."""
    windows = layer_windows(model)
    num_layers = int(model.num_layers)
    if len(windows) != num_layers:  # not one attention module per layer: nothing to free safely
        return KVCacheGroups.single(num_layers)
    kinds = set(windows)
    if kinds == {None}:
        return KVCacheGroups.single(num_layers)
    described = ", ".join("full attention" if w is None else f"a {w}-token window" for w in
                          sorted(kinds, key=lambda w: (w is not None, w or 0)))
    if config.parallel.pipeline_parallel_size > 1:
        logger.info("KV blocks outside the attention window are kept: pipeline stages (layers with %s)", described)
        return KVCacheGroups.single(num_layers)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        logger.info("KV blocks outside the attention window are kept: a draft model reads the whole context")
        return KVCacheGroups.single(num_layers)
    if len(kinds) == 1:
        window = windows[0]
        logger.info("sliding window of %d tokens: KV blocks that leave it are freed", window)
        return KVCacheGroups.single(num_layers, window)
    if config.disable_hybrid_kv_cache_manager:
        logger.info("KV blocks outside the attention window are kept: --disable-hybrid-kv-cache-manager (layers "
                    "with %s)", described)
        return KVCacheGroups.single(num_layers)
    groups = KVCacheGroups.hybrid(windows)
    logger.info("KV cache groups: %d of %d layers (%s); blocks that leave a window are freed",
                groups.num_groups, groups.num_cache_layers,
                ", ".join("full" if w is None else f"window {w}" for w in groups.windows))
    return groups
