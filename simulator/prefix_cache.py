"""SGLang's radix (prefix) cache at the granularity a trace can tell: 512-token blocks.

SGLang 0.5.23 keeps every finished or running request's KV in a radix tree
(``mem_cache/radix_cache.py``); a new request reuses the longest cached prefix of its
prompt and prefills only the rest. Traces carry no token ids, only prefix block ids
(Mooncake's ``hash_ids``: equal ids at the same position mean an equal prompt up to the
end of that block, see ``simulator/traces.py``), so the tree here is a trie over block
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
from collections.abc import Sequence

from specgov.simulator.traces import PREFIX_BLOCK_TOKENS

__all__ = ["CacheNode", "PrefixCache", "block_tokens"]


def block_tokens(prompt_tokens: int, index: int, block: int = PREFIX_BLOCK_TOKENS) -> int:
    """Tokens block ``index`` of a ``prompt_tokens``-token prompt covers (0 past its end)."""
    return max(0, min(block, prompt_tokens - index * block))


class CacheNode:
    """One cached block: its id, size, children, pins (running requests) and age."""

    __slots__ = ("children", "hash_id", "last_used", "parent", "pins", "tokens")

    def __init__(self, hash_id: int, tokens: int, parent: CacheNode | None) -> None:
        self.hash_id = hash_id
        self.tokens = tokens
        self.parent = parent
        self.children: dict[int, CacheNode] = {}
        self.pins = 0
        self.last_used = (0.0, 0)  # (virtual time, sequence number): a total order


class PrefixCache:
    """The trie of cached blocks and its token accounting (module docstring).

    ``total_tokens``: tokens every cached block holds in the KV pool; ``pinned_tokens``:
    those of blocks at least one running request holds (never evicted); the rest,
    ``evictable_tokens``, count as free for admission, as SGLang's scheduler counts
    ``evictable_size`` as available.
    """

    def __init__(self, block: int = PREFIX_BLOCK_TOKENS) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1 token, got {block}")
        self.block = block
        self.root = CacheNode(-1, 0, None)
        self.root.pins = 1  # never a leaf to evict
        self.total_tokens = 0
        self.pinned_tokens = 0
        self.evicted_tokens = 0
        self.blocks = 0
        self._seq = 0
        # (last_used, node id, node): candidates for eviction, checked when popped.
        self._heap: list[tuple[tuple[float, int], int, CacheNode]] = []

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.pinned_tokens

    def _stamp(self, now_s: float) -> tuple[float, int]:
        self._seq += 1
        return (now_s, self._seq)

    def _maybe_evictable(self, node: CacheNode) -> None:
        if node.pins == 0 and not node.children and node is not self.root:
            heapq.heappush(self._heap, (node.last_used, id(node), node))

    def match(self, hash_ids: Sequence[int], prompt_tokens: int, now_s: float) -> list[CacheNode]:
        """The cached path of the longest prefix of ``hash_ids`` (touched: now recent)."""
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

    def unpinned_tokens(self, path: Sequence[CacheNode]) -> int:
        """Tokens pinning ``path`` would take out of the evictable pool."""
        return sum(n.tokens for n in path if n.pins == 0)

    def pin(self, path: Sequence[CacheNode]) -> None:
        for n in path:
            if n.pins == 0:
                self.pinned_tokens += n.tokens
            n.pins += 1

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

    def insert(
        self, hash_ids: Sequence[int], prompt_tokens: int, path: Sequence[CacheNode], now_s: float
    ) -> tuple[list[CacheNode], int, int]:
        """Add the prompt's blocks after ``path`` (its matched, pinned prefix) and pin them.

        Returns the blocks pinned now, the tokens added to the cache (they move from the
        request's own KV into the cache's) and the tokens of blocks that were already
        cached (the request's duplicate KV, freed).
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
                self.total_tokens += size
                self.blocks += 1
                new_tokens += size
            elif child.tokens != size:
                break  # inconsistent ids: keep the rest private
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
        """Free at least ``tokens`` (if that many are evictable), least recently used
        leaves first; returns the tokens freed."""
        freed = 0
        heap = self._heap
        while freed < tokens and heap:
            stamp, _, node = heapq.heappop(heap)
            parent = node.parent
            if (
                parent is None
                or node.pins
                or node.children
                or stamp != node.last_used
                or parent.children.get(node.hash_id) is not node
            ):
                continue  # pinned, no longer a leaf, touched since, or gone already
            del parent.children[node.hash_id]
            node.parent = None
            freed += node.tokens
            self.total_tokens -= node.tokens
            self.blocks -= 1
            self._maybe_evictable(parent)
        self.evicted_tokens += freed
        return freed
