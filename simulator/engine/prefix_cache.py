"""SGLang's radix (prefix) cache at the granularity a trace can tell: 512-token blocks.

SGLang 0.5.23 keeps every finished or running request's KV in a radix tree
(``mem_cache/radix_cache.py``); a new request reuses the longest cached prefix of its
prompt and prefills only the rest. Traces carry no token ids, only prefix block ids
(Mooncake's ``hash_ids``: equal ids at the same position mean an equal prompt up to the
end of that block, see ``simulator/workload/traces.py``), so the tree here is a trie over block
ids: a node is one block, its path from the root the prefix it ends.

What is modelled, as SGLang does it:

* Matching walks the trie from the root over the prompt's ids; a partial block (a
  prompt's last, under 512 tokens) ends the walk. The engine caps the reuse at
  ``prompt - 1`` tokens (the last prompt token is always computed, for its logits).
* The cache lives in the KV pool (it allocates nothing of its own). A running request
  pins (SGLang's ``inc_lock_ref``) every block of its path from admission to its end;
  pinned blocks are never evicted. When requests need room, unpinned leaves are evicted
  least recently used first (``RadixCache.evict``: a heap on ``last_access_time``), and a
  parent becomes a leaf, so evictable, once its last child is gone.
* A request's prompt blocks enter the trie when its prefill completes (SGLang's
  ``cache_unfinished_req``; per chunk there, at the last chunk here). A block another
  request inserted meanwhile is reused and the duplicate freed, as SGLang frees it.

Hierarchical cache (SGLang's ``--enable-hierarchical-cache``, HiCache; a host tier of
``host_token_capacity`` tokens, see :func:`hicache_token_capacity`): as SGLang's default
``--hicache-write-policy write_through`` does, a block is backed up to host memory when
it enters the device trie (if its parent is backed up and the host tier has room after
evicting host-only blocks, LRU); a device eviction of a backed-up block keeps it in the
trie as host-only instead of dropping it; a match continues from the device part into
host-only blocks, which the engine loads back over PCIe (it charges the copy) and which
are device blocks again from then on. Host eviction takes host-only leaves only, LRU
(``evict_host``: a block still on the device keeps its host copy). Both tiers stay
prefix-closed: a block is on the device (or host) only if its parent is.

Assumed (the trace cannot say more): output tokens get no block ids, so an answer is
not reusable until it reappears inside a later prompt (SGLang caches the answer at
once: on multi-turn traffic this model under-counts hits by up to one answer per turn);
a block whose id matches but whose size differs (inconsistent ids) ends the match;
reuse is in whole 512-token blocks where SGLang matches token by token (page size 1),
so up to 511 tokens per request are not reused that SGLang would reuse. Measured on the
multi-turn synthetic trace ``synthetic:duration=600,rate=6,turns=8,think=20,turn_in=200,
phases=chat@600,chat.in=1500,chat.out=250,seed=0`` with an unbounded cache, these two
assumptions give a hit rate of 0.732 where token-level matching with cached answers
(SGLang's ideal) gives 0.860: this model under-counts reuse, it does not invent it.

Published figures (provenance; what the model can be held against):

* Mooncake (FAST'25 trace README, kvcache-ai/Mooncake ``FAST25-release/README.md``):
  its traces carry remapped 512-token block hashes and show "up to 50% cache hit
  ratio" (Section 4 of the technical report, arXiv:2407.00079). The paper's Table 1
  (LRU over the arXiv trace, as quoted in kvcache-ai/Mooncake issue #4020): hit rate
  0.30 / 0.40 / 0.48 / 0.50 / 0.51 / 0.51 at 1k / 10k / 30k / 50k / 100k / unbounded
  blocks; an independent replay of the released trace got 0.34-0.55 (same issue).
  Not checked here: no Mooncake trace is in the shared data folder.
* SGLang (Zheng et al., arXiv:2312.07104): RadixAttention's LRU radix tree; the paper
  reports cache hit rates of roughly 50-99% across its benchmarks (recalled, not
  re-read in this repository; the copies found were garbled).
* The hit-rate definition is SGLang 0.5.23's (``metrics_reporter.report_prefill_stats``):
  per prefill batch, reused / (reused + computed) prompt tokens, requests re-prefilled
  after a retraction excluded; replay's ``prefix_cache_hit_rate`` is the same ratio
  over the whole run.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

from specgov.policies.common.errors import SpecgovError
from specgov.policies.common.validation import is_int
from specgov.simulator.workload.traces import PREFIX_BLOCK_TOKENS

__all__ = ["CacheNode", "HicacheError", "PrefixCache", "block_tokens", "hicache_token_capacity"]

# SGLang's --hicache-ratio default when neither it nor --hicache-size is given
# (arg_groups/hicache_hook.py ``handle_hicache_ratio_default``, host memory mode "cache").
HICACHE_DEFAULT_RATIO = 2.0


class HicacheError(SpecgovError, ValueError):
    """An invalid hierarchical-cache setting; the message names the flag and its form."""


def hicache_token_capacity(
    kv_token_capacity: int,
    kv_bytes_per_token: float,
    *,
    hicache_ratio: float | None = None,
    hicache_size_gb: int = 0,
) -> int:
    """Host-tier tokens SGLang 0.5.23 allocates (``mem_cache/pool_host/base.py``).

    ``--hicache-size`` (GB = 1e9 bytes, per rank) wins when > 0: ``size * 1e9 //
    bytes_per_token`` with the rank's bytes per token; otherwise ``--hicache-ratio``
    (default 2.0) times the device pool's tokens. One padding page (1 token at page
    size 1) is added, as SGLang reserves it.
    """
    if hicache_ratio is not None and not (hicache_ratio > 0 and math.isfinite(hicache_ratio)):
        raise HicacheError(f"--hicache-ratio must be a number > 0, got {hicache_ratio!r}")
    if not is_int(hicache_size_gb):
        raise HicacheError(f"--hicache-size must be a whole number of GB, got {hicache_size_gb!r}")
    if hicache_size_gb < 0:
        raise HicacheError(f"--hicache-size must be >= 0 GB, got {hicache_size_gb}")
    if kv_bytes_per_token <= 0:
        raise HicacheError(f"KV bytes per token must be > 0, got {kv_bytes_per_token}")
    if hicache_size_gb > 0:
        tokens = int(hicache_size_gb * 1e9 // kv_bytes_per_token)
    else:
        ratio = HICACHE_DEFAULT_RATIO if hicache_ratio is None else hicache_ratio
        tokens = int(kv_token_capacity * ratio)
    return tokens + 1


def block_tokens(prompt_tokens: int, index: int, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """Tokens block ``index`` of a ``prompt_tokens``-token prompt covers (0 past its end)."""
    return max(0, min(block, prompt_tokens - index * block))


class CacheNode:
    """One cached block: its id, size, children, pins (running requests), age and tiers
    (``on_device``: in the KV pool; ``on_host``: backed up in the host tier;
    ``dev_kids``: children on the device, so a device leaf has none)."""

    __slots__ = (
        "children",
        "dev_kids",
        "hash_id",
        "last_used",
        "on_device",
        "on_host",
        "parent",
        "pins",
        "tokens",
    )

    def __init__(self, hash_id: int, tokens: int, parent: CacheNode | None) -> None:
        self.hash_id = hash_id
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, CacheNode] = {}
        self.pins = 0
        self.last_used = (0.0, 0)  # (virtual time, sequence number): a total order
        self.on_device = True
        self.on_host = False
        self.dev_kids = 0


class PrefixCache:
    """The trie of cached blocks and its token accounting (module docstring).

    ``total_tokens``: tokens every device-resident block holds in the KV pool;
    ``pinned_tokens``: those of blocks at least one running request holds (never
    evicted); the rest, ``evictable_tokens``, count as free for admission, as SGLang's
    scheduler counts ``evictable_size`` as available. ``host_tokens``: tokens the host
    tier holds (device blocks' backups and host-only blocks), at most
    ``host_token_capacity`` (0: no host tier, SGLang without HiCache).
    """

    def __init__(self, block: int = PREFIX_BLOCK_TOKENS, host_token_capacity: int = 0) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1 token, got {block}")
        if host_token_capacity < 0:
            raise ValueError(f"host_token_capacity must be >= 0, got {host_token_capacity}")
        self.block = block
        self.host_token_capacity = host_token_capacity
        self.root = CacheNode(-1, 0, None)
        self.root.pins = 1  # never a leaf to evict
        self.root.on_host = True  # children may be backed up
        self.total_tokens = 0
        self.pinned_tokens = 0
        self.evicted_tokens = 0  # left the device (dropped or kept as host-only)
        self.host_tokens = 0
        self.host_evicted_tokens = 0
        self.blocks = 0
        self._seq = 0
        # (last_used, node id, node): candidates for eviction, checked when popped.
        self._heap: list[tuple[tuple[float, int], int, CacheNode]] = []
        self._host_heap: list[tuple[tuple[float, int], int, CacheNode]] = []

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.pinned_tokens

    def _stamp(self, now_s: float) -> tuple[float, int]:
        self._seq += 1
        return (now_s, self._seq)

    def _maybe_evictable(self, node: CacheNode) -> None:
        if node is self.root:
            return
        if node.on_device:
            if node.pins == 0 and node.dev_kids == 0:
                heapq.heappush(self._heap, (node.last_used, id(node), node))
        elif not node.children:
            heapq.heappush(self._host_heap, (node.last_used, id(node), node))

    def match(self, hash_ids: Sequence[int], prompt_tokens: int, now_s: float) -> list[CacheNode]:
        """The cached path of the longest prefix of ``hash_ids`` (touched: now recent):
        device blocks first, then any host-only blocks that continue it."""
        path: list[CacheNode] = []
        node = self.root
        for j, hid in enumerate(hash_ids):
            child = node.children.get(hid)
            if child is None or child.tokens != block_tokens(prompt_tokens, j, self.block):
                break
            path.append(child)
            node = child
            if child.tokens < self.block:
                break  # a partial block ends a prefix
        stamp = self._stamp(now_s)
        for n in path:
            n.last_used = stamp
            self._maybe_evictable(n)  # its heap entry went stale with the new stamp
        return path

    @staticmethod
    def path_tokens(path: Sequence[CacheNode]) -> int:
        return sum(n.tokens for n in path)

    @staticmethod
    def host_only_tokens(path: Sequence[CacheNode]) -> int:
        """Tokens of ``path`` that are in the host tier only (a load-back brings them)."""
        return sum(n.tokens for n in path if not n.on_device)

    def unpinned_tokens(self, path: Sequence[CacheNode]) -> int:
        """Tokens pinning ``path`` would take out of the evictable pool (host-only
        blocks included: loading them back takes device room)."""
        return sum(n.tokens for n in path if n.pins == 0)

    def pin(self, path: Sequence[CacheNode]) -> None:
        """Pin ``path`` (a request holds it); host-only blocks on it are loaded back
        onto the device first (SGLang's ``init_load_back``), parents before children."""
        for n in path:
            if not n.on_device:
                self._to_device(n)
            if n.pins == 0:
                self.pinned_tokens += n.tokens
            n.pins += 1

    def _to_device(self, n: CacheNode) -> None:
        n.on_device = True
        self.total_tokens += n.tokens
        if n.parent is not None:
            n.parent.dev_kids += 1

    def unpin(self, path: Sequence[CacheNode], now_s: float) -> None:
        """A request let go of ``path`` (finished or retracted) at ``now_s``."""
        stamp = self._stamp(now_s)
        for n in reversed(path):  # leaf first: its parent is not a leaf while it stays
            n.pins -= 1
            if n.pins < 0:
                raise AssertionError("prefix cache: a block was unpinned more than pinned")
            n.last_used = stamp
            if n.pins == 0:
                self.pinned_tokens -= n.tokens
                self._maybe_evictable(n)

    def _backup(self, node: CacheNode) -> None:
        """write_through: copy a new device block to the host tier when its parent is
        there and room is left after evicting host-only blocks (else it stays unbacked)."""
        capacity = self.host_token_capacity
        parent = node.parent
        if capacity <= 0 or node.on_host or parent is None or not parent.on_host:
            return
        over = self.host_tokens + node.tokens - capacity
        if over > 0:
            self.evict_host(over)
            if self.host_tokens + node.tokens > capacity:
                return
        node.on_host = True
        self.host_tokens += node.tokens

    def insert(
        self, hash_ids: Sequence[int], prompt_tokens: int, path: Sequence[CacheNode], now_s: float
    ) -> tuple[list[CacheNode], int, int]:
        """Add the prompt's blocks after ``path`` (its matched, pinned prefix) and pin them.

        Returns the blocks pinned now, the tokens added to the cache (they move from the
        request's own KV into the cache's; a host-only block gets the request's copy as
        its device copy) and the tokens of blocks that were already on the device (the
        request's duplicate KV, freed).
        """
        node = path[-1] if path else self.root
        if node.tokens and node.tokens < self.block:
            return [], 0, 0
        added: list[CacheNode] = []
        new_tokens = 0
        dup_tokens = 0
        stamp = self._stamp(now_s)
        for j in range(len(path), len(hash_ids)):
            size = block_tokens(prompt_tokens, j, self.block)
            hid = hash_ids[j]
            child = node.children.get(hid)
            if child is None:
                child = CacheNode(hid, size, node)
                node.children[hid] = child
                node.dev_kids += 1
                self.total_tokens += size
                self.blocks += 1
                new_tokens += size
                self._backup(child)
            elif child.tokens != size:
                break  # inconsistent ids: keep the rest private
            elif not child.on_device:
                self._to_device(child)
                new_tokens += size
            else:
                dup_tokens += size
            child.last_used = stamp
            if child.pins == 0:
                self.pinned_tokens += size
            child.pins += 1
            added.append(child)
            node = child
            if size < self.block:
                break
        return added, new_tokens, dup_tokens

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` of the KV pool (if that many are evictable), least
        recently used device leaves first; a backed-up block stays as host-only, any
        other leaves the trie. Returns the tokens freed."""
        freed = self._evict_lru(self._heap, tokens, self._free_device_leaf)
        self.evicted_tokens += freed
        return freed

    def evict_host(self, tokens: int) -> int:
        """Free at least ``tokens`` of the host tier, least recently used host-only
        leaves first (blocks still on the device keep their backup); returns the tokens
        freed."""
        freed = self._evict_lru(self._host_heap, tokens, self._free_host_leaf)
        self.host_evicted_tokens += freed
        return freed

    def _evict_lru(
        self,
        heap: list[tuple[tuple[float, int], int, CacheNode]],
        tokens: int,
        free: Callable[[CacheNode, CacheNode], bool],
    ) -> int:
        """Pop ``heap`` least recently used first until ``tokens`` are freed or it is
        empty; ``free(node, parent)`` frees the node of an entry that is still current
        (False: it cannot go now). An entry is stale once its node was touched since,
        left the trie or was replaced under its id. Returns the tokens freed."""
        freed = 0
        while freed < tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            parent = node.parent
            if (
                parent is None
                or stamp != node.last_used
                or parent.children.get(node.hash_id) is not node
                or not free(node, parent)
            ):
                continue  # touched since, gone already, or not freeable now
            freed += node.tokens
        return freed

    def _free_device_leaf(self, node: CacheNode, parent: CacheNode) -> bool:
        """Take a device leaf off the device (False: pinned, or no longer a leaf)."""
        if not node.on_device or node.pins or node.dev_kids:
            return False
        node.on_device = False
        parent.dev_kids -= 1
        if node.on_host:
            self._maybe_evictable(node)  # host-only now
        else:
            # Not backed up, so neither is any child (the host tier is prefix-closed)
            # and no child is on the device: it has none left.
            self._unlink(node, parent)
        self.total_tokens -= node.tokens
        self._maybe_evictable(parent)
        return True

    def _free_host_leaf(self, node: CacheNode, parent: CacheNode) -> bool:
        """Drop a host-only leaf from the trie (False: back on the device, or no longer
        a leaf)."""
        if node.on_device or node.children:
            return False
        node.on_host = False
        self._unlink(node, parent)
        self.host_tokens -= node.tokens
        if not parent.on_device:
            self._maybe_evictable(parent)
        return True

    def _unlink(self, node: CacheNode, parent: CacheNode) -> None:
        """Take a childless block out of the trie."""
        del parent.children[node.hash_id]
        node.parent = None
        self.blocks -= 1
