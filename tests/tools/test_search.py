"""BM25 (formula, hand-checked rankings) and the search/open tools over a small corpus."""

from __future__ import annotations

import asyncio
import math

import pytest

from turnrl.tools import ToolCall, run_tool_calls
from turnrl.tools.search import BM25, Document, bm25_idf, bm25_term, search_tools, tokenize

DOCS = [
    Document("d1", "Zorland", "Zorland is a country. The capital of Zorland is Quen. "
                              "The leader of Zorland is Mira Tol."),
    Document("d2", "Quen", "Quen is a city. Quen is the capital of Zorland. "
                           "The river of Quen is Avo."),
    Document("d3", "Avo", "Avo is a river. Avo is the river of Quen. The source of Avo is Mount "
                          "Ress."),
    Document("d4", "Pelia", "Pelia is a country. The capital of Pelia is Dost. Pelia trades "
                            "wool, grain, salt, timber, copper and tin with every neighbour."),
    Document("d5", "Dost", "Dost is a city. Dost is the capital of Pelia."),
]


def test_idf_and_term_weight_follow_the_formula():
    assert bm25_idf(10, 1) == pytest.approx(math.log(1 + 9.5 / 1.5))
    assert bm25_idf(10, 10) > 0  # a term in every document still counts a little
    weight = bm25_term(2.0, tf=1, length=10, mean_length=10.0)
    assert weight == pytest.approx(2.0 * 2.2 / (1 + 1.2))  # |D| = avgdl: idf * (k1+1)/(1+k1)
    many = bm25_term(2.0, tf=50, length=10, mean_length=10.0)
    assert weight < many < 2.0 * 2.2  # more occurrences help, saturating below idf * (k1+1)
    assert bm25_term(2.0, 1, 5, 10.0) > bm25_term(2.0, 1, 20, 10.0)  # shorter doc wins


@pytest.mark.parametrize("query, first", [
    ("capital of Zorland", "d1"),
    ("Quen river", "d2"),
    ("source of Avo", "d3"),
    ("capital of Pelia", "d4"),  # Pelia's page names Pelia thrice, Dost's once
    ("Dost", "d5"),
    ("Mira Tol", "d1"),
])
def test_bm25_ranks_the_right_document_first(query, first):
    assert BM25(DOCS).top(query, 3)[0][0] == first


def test_no_matching_term_finds_nothing_and_stop_words_do_not_count():
    index = BM25(DOCS)
    assert index.top("what is the of", 3) == [] and tokenize("The Capital OF x") == ["capital",
                                                                                    "x"]
    with pytest.raises(ValueError, match="share a doc_id"):
        BM25([DOCS[0], DOCS[0]])


def test_the_snippet_is_the_sentence_that_answers():
    assert BM25(DOCS).snippet("d2", "river of Quen") == "The river of Quen is Avo."


def run(tools, name, **arguments):
    (result,) = asyncio.run(run_tool_calls([ToolCall(name, arguments, "")], tools))
    return result


def test_search_and_open_through_the_tool_runner():
    tools = search_tools(BM25(DOCS), top_k=2)
    assert [t.name for t in tools] == ["search", "open"]
    hits = run(tools, "search", query="capital of Zorland").content.splitlines()
    assert len(hits) == 2 and hits[0] == "d1 | Zorland | The capital of Zorland is Quen."
    assert run(tools, "open", doc_id="d3").content.startswith("Avo\nAvo is a river.")
    missing = run(tools, "open", doc_id="d9")
    assert "no document 'd9'" in missing.error
    assert run(tools, "search", query="xyzzy").content.startswith("no document matches")
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        search_tools(BM25(DOCS), top_k=0)
