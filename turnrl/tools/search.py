"""Search over a local corpus: a small BM25 index and the ``search`` / ``open`` tools.

    index = BM25([Document("doc-1", "Quen", "Quen is a city. The river of Quen is Avo."), ...])
    tools = search_tools(index, top_k=3)   # search(query) and open(doc_id), for a ToolEnv

Pure Python, no dependency: corpora here are thousands of documents at most.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

from turnrl.tools.schema import Tool, make_tool

_WORD = re.compile(r"[a-z0-9]+")
_SENTENCE = re.compile(r"(?<=[.!?])\s+")
STOPWORDS = frozenset("a an and are in is it of on or the to what which who".split())
"""Words that carry no meaning in a query (BM25's IDF would shrink them anyway; dropping them
keeps a snippet from being chosen for its "the")."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


def tokenize(text: str) -> list[str]:
    """Lower-cased words and numbers, stop words left out."""
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


def bm25_idf(documents: int, containing: int) -> float:
    """IDF(t) = ln(1 + (N - n(t) + 0.5) / (n(t) + 0.5)): the Robertson-Sparck Jones weight
    with the +1 inside the log that keeps it positive for terms in over half the documents
    (Robertson & Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and Beyond", eq.
    3.26 with 1 added, as Lucene does)."""
    return math.log(1.0 + (documents - containing + 0.5) / (containing + 0.5))


def bm25_term(idf: float, tf: int, length: int, mean_length: float, k1: float = 1.2,
              b: float = 0.75) -> float:
    """One query term's share of BM25 (Robertson & Zaragoza 2009, eq. 3.15):
    IDF(t) * tf (k1 + 1) / (tf + k1 (1 - b + b |D| / avgdl)). ``k1`` saturates repeated
    terms, ``b`` normalises by the document's length."""
    return idf * tf * (k1 + 1.0) / (tf + k1 * (1.0 - b + b * length / mean_length))


class BM25:
    """Okapi BM25 over ``documents`` (title and text both indexed)."""

    def __init__(self, documents: list[Document], k1: float = 1.2, b: float = 0.75):
        if not documents:
            raise ValueError("BM25 needs at least one document")
        self.documents = {d.doc_id: d for d in documents}
        if len(self.documents) != len(documents):
            raise ValueError("BM25: two documents share a doc_id; give each its own")
        self.k1, self.b = k1, b
        self.rank = {d.doc_id: n for n, d in enumerate(documents)}
        self.counts = {d.doc_id: Counter(tokenize(f"{d.title}. {d.text}")) for d in documents}
        self.lengths = {i: sum(c.values()) for i, c in self.counts.items()}
        self.mean_length = sum(self.lengths.values()) / len(documents) or 1.0
        containing = Counter(t for c in self.counts.values() for t in c)
        self.idf = {t: bm25_idf(len(documents), n) for t, n in containing.items()}
        self.postings: dict[str, list[str]] = {}
        for doc_id, counts in self.counts.items():
            for term in counts:
                self.postings.setdefault(term, []).append(doc_id)

    def scores(self, query: str) -> dict[str, float]:
        """doc_id -> BM25 score, for the documents holding at least one query term."""
        scores: dict[str, float] = {}
        for term in set(tokenize(query)):
            for doc_id in self.postings.get(term, ()):
                scores[doc_id] = scores.get(doc_id, 0.0) + bm25_term(
                    self.idf[term], self.counts[doc_id][term], self.lengths[doc_id],
                    self.mean_length, self.k1, self.b)
        return scores

    def top(self, query: str, k: int) -> list[tuple[str, float]]:
        """The ``k`` best (doc_id, score), best first; ties go to the earlier doc_id."""
        scores = self.scores(query)
        return sorted(scores.items(), key=lambda s: (-s[1], self.rank[s[0]]))[:k]

    def snippet(self, doc_id: str, query: str, limit: int = 160) -> str:
        """The document's sentence sharing the most query weight (the first on ties)."""
        terms = set(tokenize(query))
        sentences = _SENTENCE.split(self.documents[doc_id].text.strip())
        best = max(sentences, key=lambda s: sum(self.idf.get(t, 0.0)
                                                for t in terms & set(tokenize(s))))
        return best if len(best) <= limit else best[:limit - 3] + "..."


def search_tools(index: BM25, top_k: int = 3) -> list[Tool]:
    """``search(query)``: the ``top_k`` hits, one "doc_id | title | snippet" line each; and
    ``open(doc_id)``: a document's whole text."""
    if top_k < 1:
        raise ValueError(f"search top_k must be >= 1, got {top_k}")

    def search(query: str) -> str:
        """Find documents: a "doc_id | title | snippet" line per match.

        Args:
            query: keywords
        """
        hits = index.top(query, top_k)
        if not hits:
            return "no document matches; try other keywords"
        return "\n".join(f"{i} | {index.documents[i].title} | {index.snippet(i, query)}"
                         for i, _ in hits)

    def open_document(doc_id: str) -> str:
        """Read a document.

        Args:
            doc_id: from search
        """
        found = index.documents.get(doc_id.strip())
        if found is None:
            raise KeyError(f"no document '{doc_id}'; use a doc_id from the search results")
        return f"{found.title}\n{found.text}"

    return [make_tool(search), make_tool(open_document, name="open")]
