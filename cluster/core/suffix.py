"""SuffixDecoding's drafter: a cross-request suffix index over recent prompts and outputs, pure.

Oliaro et al., *SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications*: agent loops, edit
workloads and chat resend what earlier requests already produced, so the continuation of the longest suffix of
the current context that occurred before -- in this request or in any recent one -- is a draft that costs no
model.  The paper keeps a suffix tree over past outputs plus one over the current prompt, drafts by following
the most frequent continuation of the longest match, and sizes the draft by how often that continuation was
seen: each token's empirical probability (a child's count over its parent's), their product the draft's score;
drafting stops once the score falls below a threshold, and at ``spec_factor x`` the match length.

Here one trie per ``cache_salt`` holds every window of at most ``max_depth`` tokens of every indexed sequence
(a *document*: one request's whole sequence, prompt then output, so a resent prompt continues into the answer
it had), each node counting the windows through it.  A running request's document grows as tokens are
committed and shrinks on rollback, and stays indexed after it finishes until evicted: the index holds at most
``max_tokens`` tokens of finished and running documents, the oldest finished documents evicted first.
Requests of different salts never see each other's documents.

The trie is path-compressed the way suffix trees are: a node only one window passes through (``count`` 1)
keeps a reference to that window's document and start instead of children, and is expanded when a second
window arrives; so unique text costs a few nodes per token instead of ``max_depth``.  Probabilities count only
occurrences that continued (``cont``, the sum of a node's children's counts), so the running document's own
suffix, which has not continued yet, never dilutes them.  Ties between equally frequent continuations go to
the one seen last (the latest version of a re-emitted file).

Worked example (``max_depth`` 4, one salt): documents ``[1, 2, 3, 4]`` and ``[1, 2, 3, 5]``, then a request
whose context is ``[7, 1, 2]``: its longest suffix with a continuation is ``[1, 2]`` (p = 2), followed by 3
twice (probability 1), then ``[1, 2, 3]`` by 4 and 5 once each (probability 1/2; 5, seen last, wins): with
``min_prob`` 0.5 the draft is ``[3, 5]``, with 0.6 it is ``[3]``, and ``spec_factor`` 0.5 caps it at 1 token.

:class:`cluster.models.suffix.SuffixHandle` serves it behind the model-handle interface.  Its drafts are a
deterministic function of what was committed before the step (q one-hot), so verification is exact.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

DEFAULT_MAX_DEPTH = 24             # the longest window indexed (vLLM's suffix_decoding_max_tree_depth)
DEFAULT_MAX_TOKENS = 1 << 16       # tokens of documents held (finished ones evicted oldest first)
DEFAULT_SPEC_FACTOR = 1.0          # a draft is at most this many times the match length
DEFAULT_MIN_PROB = 0.1             # drafting stops where the draft's probability falls below this


class _Node:
    """The window spelled by the path from the root.  ``count``: windows through it; ``cont``: those that went
    on (the sum of the children's counts); ``stamp``: when a window last reached it; ``ref``: (document, start)
    of the one window through it while it has no children (its continuation is read from the document)."""

    __slots__ = ("token", "parent", "depth", "count", "cont", "stamp", "kids", "ref")

    def __init__(self, token: int, parent: "_Node | None", depth: int):
        self.token, self.parent, self.depth = token, parent, depth
        self.count = self.cont = self.stamp = 0
        self.kids: dict[int, _Node] | None = None
        self.ref: tuple[_Doc, int] | None = None


class _Doc:
    """A document's tokens and, for each start whose window is shorter than ``max_depth``, the deepest node with
    children (or a reference) on that window's path."""

    __slots__ = ("salt", "tokens", "front")

    def __init__(self, salt: str):
        self.salt, self.tokens = salt, []
        self.front: dict[int, _Node] = {}


class SuffixIndex:
    """Documents keyed by the caller (:meth:`sync`, :meth:`finish`), indexed per salt; :meth:`draft` proposes the
    continuation of a document's longest suffix seen before (see the module docstring)."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_tokens: int = DEFAULT_MAX_TOKENS):
        if max_depth < 2 or max_tokens < 1:
            raise ValueError(f"SuffixIndex: max_depth >= 2 and max_tokens >= 1, got {max_depth}, {max_tokens}")
        self.max_depth, self.max_tokens = max_depth, max_tokens
        self.tokens = 0                                   # tokens of every document held
        self.nodes = 0                                    # trie nodes (memory: the tests hold it bounded)
        self._roots: dict[str, _Node] = {}
        self._held: dict[str, int] = {}                   # salt -> its documents
        self._docs: dict[Hashable, _Doc] = {}
        self._finished: OrderedDict[Hashable, None] = OrderedDict()    # oldest first
        self._clock = 0

    # -- documents -------------------------------------------------------------------------------
    def sync(self, key: Hashable, salt: str, tokens: Sequence[int]) -> None:
        """Document ``key`` (under ``salt``; opened on first use) becomes ``tokens``: what follows their common
        prefix is removed, then the rest appended."""
        doc = self._docs.get(key)
        if doc is None:
            doc = self._docs[key] = _Doc(salt)
            self._roots.setdefault(salt, _Node(-1, None, 0))
            self._held[salt] = self._held.get(salt, 0) + 1
        elif doc.salt != salt:
            raise ValueError(f"SuffixIndex: document {key!r} is indexed under another salt")
        have, n = doc.tokens, min(len(doc.tokens), len(tokens))
        c = 0
        while c < n and have[c] == tokens[c]:
            c += 1
        while len(doc.tokens) > c:
            self._pop(doc)
        for t in tokens[c:]:
            self._push(doc, int(t))

    def finish(self, key: Hashable) -> None:
        """Document ``key`` stops changing; it stays indexed until evicted (oldest finished first) to keep at most
        ``max_tokens`` tokens."""
        if key in self._docs and key not in self._finished:
            self._finished[key] = None
        while self.tokens > self.max_tokens and self._finished:
            self.drop(next(iter(self._finished)))

    def drop(self, key: Hashable) -> None:
        """Forget document ``key`` (a no-op for an unknown one)."""
        doc = self._docs.pop(key, None)
        self._finished.pop(key, None)
        if doc is None:
            return
        while doc.tokens:
            self._pop(doc)
        self._held[doc.salt] -= 1
        if not self._held[doc.salt]:                      # a salt's last document: its trie is empty
            del self._roots[doc.salt], self._held[doc.salt]

    def __len__(self) -> int:
        return len(self._docs)

    def salts(self) -> list[str]:
        return list(self._roots)

    def stats(self, salt: str, window: Sequence[int]) -> tuple[int, int]:
        """(occurrences of ``window`` in ``salt``'s documents, those followed by a token), windows of at most
        ``max_depth`` tokens; (0, 0) for a window never seen."""
        if salt not in self._roots or not 0 < len(window) <= self.max_depth:
            return 0, 0
        at = self._cursor(self._roots[salt], window)
        if at is None:
            return 0, 0
        node, off = at
        return (node.count if off == 0 else 1), self._cont(node, off)

    # -- drafting --------------------------------------------------------------------------------
    def draft(self, key: Hashable, k: int, *, min_prob: float = DEFAULT_MIN_PROB,
              spec_factor: float = DEFAULT_SPEC_FACTOR) -> list[int]:
        """At most ``k`` tokens continuing document ``key``: from its longest suffix with a continuation (length p),
        the most frequent continuation (ties: the one seen last) while the product of their empirical
        probabilities stays >= ``min_prob``, at most ``spec_factor * p`` tokens."""
        doc = self._docs[key]
        node = next((f for _, f in sorted(doc.front.items()) if f.ref is None and f.cont > 0), None)
        if node is None:
            return []
        limit, out, score, off = min(k, int(spec_factor * node.depth)), [], 1.0, 0
        while len(out) < limit:
            if node.depth + off == self.max_depth:      # the deepest window: go on from its suffix one shorter
                node, off = self._cursor(self._roots[doc.salt], (doc.tokens + out)[1 - self.max_depth:])
            if node.ref is None:
                if not node.kids:
                    break
                best = max(node.kids.values(), key=lambda c: (c.count, c.stamp))
                score *= best.count / node.cont
                token, node = best.token, best
            else:                                       # one window: its document's next token
                if not self._cont(node, off):
                    break
                d, s = node.ref
                token, off = d.tokens[s + node.depth + off], off + 1
            if score < min_prob:
                break
            out.append(token)
        return out

    # -- the trie --------------------------------------------------------------------------------
    def _cont(self, node: _Node, off: int) -> int:
        if node.ref is None:
            return node.cont
        d, s = node.ref
        depth = node.depth + off
        return int(depth < self.max_depth and s + depth < len(d.tokens))

    def _cursor(self, node: _Node, window: Sequence[int]) -> tuple[_Node, int] | None:
        """Where ``window`` ends below ``node``: (node, tokens read past it in its reference's document)."""
        off = 0
        for t in window:
            if node.ref is None:
                node = node.kids.get(t) if node.kids else None
                if node is None:
                    return None
            else:
                d, s = node.ref
                pos = s + node.depth + off
                if not (self._cont(node, off) and d.tokens[pos] == t):
                    return None
                off += 1
        return node, off

    def _push(self, doc: _Doc, token: int) -> None:
        """Append ``token`` at position n: each window ending at n - 1 that can grow takes it, and a new one starts."""
        self._clock += 1
        n = len(doc.tokens)
        doc.tokens.append(token)
        for s in range(max(0, n - self.max_depth + 1), n):
            f = doc.front[s]
            if f.ref is None:                            # its path ends at f: extend it
                f = doc.front[s] = self._extend(f, token, doc, s)
            if n + 1 - s >= self.max_depth:              # full: it grows no more
                del doc.front[s]
        doc.front[n] = self._extend(self._roots[doc.salt], token, doc, n)
        self.tokens += 1

    def _extend(self, node: _Node, token: int, doc: _Doc, s: int) -> _Node:
        """The window ``(doc, s)`` through ``node`` goes on with ``token`` -> the child it reaches."""
        if node.kids is None:
            node.kids = {}
        child = node.kids.get(token)
        if child is None:
            child = node.kids[token] = _Node(token, node, node.depth + 1)
            child.ref = (doc, s)
            self.nodes += 1
        elif child.ref is not None:
            self._expand(child)
        child.count += 1
        child.stamp = self._clock
        node.cont += 1
        return child

    def _expand(self, node: _Node) -> None:
        """A second window reaches ``node``: its one window's continuation becomes a child (with the reference)."""
        (d, s), node.ref = node.ref, None
        if node.depth < self.max_depth and s + node.depth < len(d.tokens):
            t = d.tokens[s + node.depth]
            child = _Node(t, node, node.depth + 1)
            child.count, child.stamp, child.ref = 1, node.stamp, (d, s)
            node.kids, node.cont = {t: child}, 1
            self.nodes += 1
            if d.front.get(s) is node:
                d.front[s] = child

    def _pop(self, doc: _Doc) -> None:
        """Remove the last token (position n - 1): each window ending there shrinks by one (nodes left with none
        through them deleted)."""
        n = len(doc.tokens)
        for s in range(max(0, n - self.max_depth), n):
            length = n - s
            f = doc.front.get(s) or self._deepest(doc, s, length)
            if f.ref is None or f.depth == length:       # its path ends at f: one window fewer through it
                f.count -= 1
                f.parent.cont -= 1
                if f.count == 0:
                    del f.parent.kids[f.token]
                    if not f.parent.kids:
                        f.parent.kids = None
                    self.nodes -= 1
                f = f.parent
            if length == 1:
                doc.front.pop(s, None)
            else:
                doc.front[s] = f
        doc.tokens.pop()
        self.tokens -= 1

    def _deepest(self, doc: _Doc, s: int, length: int) -> _Node:
        """The deepest node with children or a reference on window ``doc.tokens[s:s + length]``'s path."""
        node = self._roots[doc.salt]
        for t in doc.tokens[s:s + length]:
            node = node.kids[t]
            if node.ref is not None:
                break
        return node
