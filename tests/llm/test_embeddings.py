"""The embeddings client against a scripted server over real HTTP."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest

from sokratos_worker.llm.embeddings import HttpEmbedder, split_text
from sokratos_worker.llm.types import (
    EmbeddingDimensionMismatch,
    EmbeddingFailed,
    EmbeddingReplyInvalid,
    EmbeddingsMisconfigured,
    EmbeddingsUnavailable,
)
from sokratos_worker.testing import Reply, Request, ScriptedLLM, hash_embedding

Servers = Callable[..., ScriptedLLM]


@pytest.fixture
def embedders() -> Iterator[Callable[..., HttpEmbedder]]:
    made: list[HttpEmbedder] = []

    def make(url: str, **kwargs: object) -> HttpEmbedder:
        values: dict[str, object] = {
            "model": "embed",
            "dim": 4,
            "timeout": 2.0,
            "sleep": lambda _: None,  # backoff without waiting
        }
        values.update(kwargs)
        embedder = HttpEmbedder(url, **values)  # type: ignore[arg-type]
        made.append(embedder)
        return embedder

    yield make
    for embedder in made:
        embedder.close()


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def test_batched_normalised_with_suffix_and_pinned_model(servers: Servers, embedders):
    srv = servers()
    srv.on("/v1/embeddings", lambda r: Reply.embeddings([[3, 4, 0, 0]] * len(r.body["input"])))
    embedder = embedders(srv.url, suffix="<|endoftext|>", batch_size=2)

    vectors = embedder.embed(["a", "b", "c"])

    assert vectors == [[0.6, 0.8, 0.0, 0.0]] * 3
    bodies = srv.bodies("/v1/embeddings")
    assert [b["input"] for b in bodies] == [
        ["a<|endoftext|>", "b<|endoftext|>"],
        ["c<|endoftext|>"],
    ]
    assert {b["model"] for b in bodies} == {"embed"}


def test_dimension_is_checked(servers: Servers, embedders):
    srv = servers(embed_dim=8)
    # Every vector (the probe's too) has the wrong size: a configuration to fix, not the item.
    with pytest.raises(EmbeddingsMisconfigured, match=r"8 dimensions.*SOKRATOS_EMBEDDING_DIM"):
        embedders(srv.url, dim=4).embed(["x"])
    assert embedders(srv.url, dim=8).probe() is True
    assert embedders(srv.url, dim=4).probe() is False
    # Only this input's vector: the item's problem.
    srv.script(Reply.embeddings([[1.0] * 5]), path="/v1/embeddings")
    with pytest.raises(EmbeddingDimensionMismatch, match="5 dimensions"):
        embedders(srv.url, dim=8).embed(["x"])


@pytest.mark.parametrize(
    "junk",
    [
        Reply.embeddings([[float("nan")] * 4]),
        Reply(json_body={"object": "list", "data": []}),
        Reply(json_body={"detail": "not the OpenAI format"}),
    ],
    ids=["nan", "no-vectors", "not-openai"],
)
def test_junk_for_every_input_is_the_servers_fault_not_the_items(
    servers: Servers, embedders, junk: Reply
):
    srv = servers()
    srv.on("/v1/embeddings", lambda r: junk)
    with pytest.raises(EmbeddingsUnavailable, match="the server is at fault"):
        embedders(srv.url).embed(["x"])


def test_connection_errors_and_5xx_are_unavailable(servers: Servers, embedders):
    with pytest.raises(EmbeddingsUnavailable):
        embedders("http://127.0.0.1:9/v1").embed(["x"])
    srv = servers()
    # Three attempts, then the health probe: a server that keeps answering 503 is an outage.
    srv.script(*[Reply.error(503, "Loading model")] * 4, path="/v1/embeddings")
    with pytest.raises(EmbeddingsUnavailable):
        embedders(srv.url).embed(["x"])
    assert srv.count("/v1/embeddings") == 4


def test_a_transient_error_is_retried_with_backoff_before_it_counts(servers: Servers, embedders):
    srv = servers(embed_dim=4)
    srv.script(
        Reply.error(503, "Loading model"), Reply.error(429, "busy"), path="/v1/embeddings"
    )
    delays: list[float] = []

    vectors = embedders(srv.url, sleep=delays.append, backoff_base=0.5).embed(["x"])

    assert len(vectors) == 1 and math.isclose(norm(vectors[0]), 1.0)
    assert srv.count("/v1/embeddings") == 3
    assert len(delays) == 2 and 0.5 <= delays[0] <= 1.5 and 1.0 <= delays[1] <= 2.5


def test_a_permanent_error_is_not_retried(servers: Servers, embedders):
    srv = servers(embed_dim=4)
    srv.script(Reply.error(400, "bad input"), path="/v1/embeddings")
    with pytest.raises(EmbeddingFailed):
        embedders(srv.url).embed(["x"])
    # Once, and the tiny probe that shows it is this input's (a 4xx every request gets is the
    # configuration's: tests/llm/test_embeddings_refused_every_request.py).
    assert srv.count("/v1/embeddings") == 2


def test_4xx_and_bad_payloads_are_failures(servers: Servers, embedders):
    srv = servers(embed_dim=4)  # (the health probe is answered well: the items' problem)
    embedder = embedders(srv.url)
    cases = [
        (Reply.error(400, "bad input"), "400"),
        (Reply.embeddings([[0, 0, 0, 0]]), "zero"),
        (Reply.embeddings([[[1, 2, 3, 4], [1, 2, 3, 4]]]), "pooling"),
        (Reply.embeddings([[1, 0, 0, 0], [0, 1, 0, 0]]), "2 vectors for 1"),
    ]
    for reply, message in cases:
        srv.script(reply, path="/v1/embeddings")  # this input only; the probe after it is fine
        with pytest.raises(EmbeddingFailed, match=message):
            embedder.embed(["x"])


def _indexed(vectors: list[list[float]], indices: list[object]) -> Reply:
    """An embeddings reply with these ``index`` values (``...``: the item has none)."""
    data = [
        {"object": "embedding", "embedding": v} | ({} if i is ... else {"index": i})
        for v, i in zip(vectors, indices, strict=True)
    ]
    return Reply(json_body={"object": "list", "data": data, "model": "embed"})


TEXTS = ["first text", "second text", "third text", "fourth text"]


@pytest.mark.parametrize(
    ("indices", "problem"),
    [
        ([0, 0, 2, 1], "index 0 is given twice"),
        ([0.0, 0, 2, 1], "index 0 is given twice"),
        ([0, 1, 2, 4], r"index 4 is outside 0\.\.3"),
        ([0, 1, 2, 4.0], r"index 4\.0 is outside 0\.\.3"),
        ([0, 1, ..., 2], "vector 2 has no index while others have one"),
        ([0, True, 2, 3], "index True is not a number"),
        (["0", 1, 2, 3], "index '0' is not a number"),
        ([0, 1, 2, -1], "index -1 is outside"),
        ([0, 0.5, 2, 3], r"index 0\.5 is not a whole number"),
    ],
    ids=[
        "duplicate",
        "duplicate-float",
        "out-of-range",
        "out-of-range-float",
        "missing",
        "bool",
        "string",
        "negative",
        "fraction",
    ],
)
def test_indices_that_do_not_name_each_input_once_are_refused(
    servers: Servers, embedders, indices: list[object], problem: str
):
    """LiteLLM's proxy has answered a batch with indices [0, 0, 2, 1]: sorting by index then
    hands the third text the fourth's vector. Refused, as a wrong count is, never guessed,
    and the message says which index is wrong and how."""

    def respond(request: Request) -> Reply:
        inputs = request.body["input"]
        if len(inputs) == 1:  # the health probe: a well-formed answer
            return Reply.embeddings([hash_embedding(inputs[0], 8)])
        return _indexed([hash_embedding(t, 8) for t in inputs], indices)

    srv = servers()
    srv.on("/v1/embeddings", respond)
    with pytest.raises(EmbeddingReplyInvalid, match=f"indices .* for 4 inputs: {problem}"):
        embedders(srv.url, dim=8).embed(TEXTS)


def test_a_huge_index_in_a_refused_reply_is_not_copied_whole_into_the_error(
    servers: Servers, embedders
):
    """The refusal quotes the indices, and the error ends up in logs and last_error: a proxy
    answering a 1 MB string as an index made a 2 MB message."""

    def respond(request: Request) -> Reply:
        inputs = request.body["input"]
        if len(inputs) == 1:
            return Reply.embeddings([hash_embedding(inputs[0], 8)])
        return _indexed([hash_embedding(t, 8) for t in inputs], ["9" * 1_000_000, 1, 2, 3])

    srv = servers()
    srv.on("/v1/embeddings", respond)
    with pytest.raises(EmbeddingReplyInvalid, match="is not a number") as refused:
        embedders(srv.url, dim=8).embed(TEXTS)
    assert len(str(refused.value)) < 1000, len(str(refused.value))


def test_whole_numbers_written_as_floats_are_indices(servers: Servers, embedders):
    """Some proxies write every JSON number as a float: index 0.0 is index 0."""

    def respond(request: Request) -> Reply:
        vectors = [hash_embedding(t, 8) for t in request.body["input"]]
        order = range(len(vectors) - 1, -1, -1)  # reversed, so each index matters
        return _indexed([vectors[i] for i in order], [float(i) for i in order])

    srv = servers()
    srv.on("/v1/embeddings", respond)
    vectors = embedders(srv.url, dim=8).embed(TEXTS)
    for text, vector in zip(TEXTS, vectors, strict=True):
        assert vector == pytest.approx(hash_embedding(text, 8), abs=1e-12), text
    assert srv.count("/v1/embeddings") == 1  # accepted as it is: no health probe asked


@pytest.mark.parametrize("with_index", [True, False], ids=["shuffled", "no-index"])
def test_each_vector_goes_to_the_text_its_index_names(
    servers: Servers, embedders, with_index: bool
):
    def respond(request: Request) -> Reply:
        vectors = [hash_embedding(t, 8) for t in request.body["input"]]
        if not with_index:
            return _indexed(vectors, [...] * len(vectors))  # the reply's order, then
        order = [3, 0, 2, 1]
        return _indexed([vectors[i] for i in order], list(order))

    srv = servers()
    srv.on("/v1/embeddings", respond)
    vectors = embedders(srv.url, dim=8).embed(TEXTS)
    for text, vector in zip(TEXTS, vectors, strict=True):
        assert vector == pytest.approx(hash_embedding(text, 8), abs=1e-12), text


def test_huge_and_tiny_components_are_normalised_and_booleans_refused(servers: Servers, embedders):
    srv = servers(embed_dim=4)  # (the health probe is answered well: the items' problem)
    embedder = embedders(srv.url)
    for vector, unit in [([1e154] * 4, [0.5] * 4), ([3e-170, 4e-170, 0, 0], [0.6, 0.8, 0, 0])]:
        srv.script(Reply.embeddings([vector]), path="/v1/embeddings")
        assert embedder.embed(["x"])[0] == pytest.approx(unit)
    for reply, message in [
        (Reply.embeddings([[True, False, 0, 0]]), "flat list of numbers"),
        (Reply.embeddings([[10**400, 0, 0, 0]]), "non-finite"),
        (Reply.embeddings([[1e308, 1e308, float("inf"), 0]]), "non-finite"),
    ]:
        srv.script(reply, path="/v1/embeddings")
        with pytest.raises(EmbeddingReplyInvalid, match=message):
            embedder.embed(["x"])


def test_too_large_input_is_split_and_each_part_embedded(servers: Servers, embedders):
    def respond(request: Request) -> Reply:
        (text,) = request.body["input"]
        if len(text.encode()) > 120:
            return Reply.error(500, "input is too large to process. increase the batch size")
        return Reply.embeddings([hash_embedding(text, 4)])

    srv = servers()
    srv.on("/v1/embeddings", respond)
    text = "first paragraph " * 6 + "\n" + "second paragraph " * 6 + "\n" + "third " * 20
    parts = embedders(srv.url).embed_splitting(text)

    assert len(parts) >= 2
    assert all(len(part.encode()) <= 120 for part, _ in parts)
    assert "".join(p for p, _ in parts).replace(" ", "") == text.replace(" ", "").replace("\n", "")
    assert all(abs(norm(v) - 1) < 1e-9 for _, v in parts)


def test_too_large_error_on_a_4xx_is_split_too(servers: Servers, embedders):
    srv = servers()
    srv.script(
        Reply.error(400, "input (600 tokens) is too large to process"),
        path="/v1/embeddings",
    )
    srv.on("/v1/embeddings", lambda r: Reply.embeddings([hash_embedding("x", 4)]))
    parts = embedders(srv.url).embed_splitting("word " * 50)
    assert len(parts) == 2


SPLIT_LIMIT = 300  # bytes the scripted server embeds in one input
TEI_413 = Reply(
    status=413,
    json_body={
        "error": "Input validation error: `inputs` must have less than 512 tokens. Given: 700",
        "error_type": "Validation",
    },
)
OPENAI_400 = Reply.error(
    400,
    "This model's maximum context length is 8192 tokens, however you requested 9000 tokens"
    " (9000 in your prompt; 0 for the completion). Please reduce your prompt; or completion"
    " length.",
    type="invalid_request_error",
    code="context_length_exceeded",
)


@pytest.mark.parametrize("refusal", [TEI_413, OPENAI_400], ids=["413-tei", "400-context-length"])
def test_a_413_or_context_length_answer_without_too_large_is_split_too(
    servers: Servers, embedders, refusal: Reply
):
    # Hugging Face TEI's 413 and the context-length 400 of OpenAI and vLLM never say "too
    # large": they were charged to the item at every attempt and it was dead-lettered.
    def respond(request: Request) -> Reply:
        texts = request.body["input"]
        if any(len(t.encode()) > SPLIT_LIMIT for t in texts):
            return refusal
        return Reply.embeddings([hash_embedding(t, 8) for t in texts])

    srv = servers()
    srv.on("/v1/embeddings", respond)
    text = "\n".join(f"line {i}: my sister Ana moved to Porto in May" for i in range(16))
    assert len(text.encode()) > SPLIT_LIMIT
    parts = embedders(srv.url, dim=8, timeout=5.0).embed_splitting(text)

    assert len(parts) >= 2
    assert "".join(p for p, _ in parts).replace("\n", "") == text.replace("\n", "")
    assert all(len(v) == 8 for _, v in parts)


def test_small_text_is_not_split(servers: Servers, embedders):
    srv = servers()
    srv.on("/v1/embeddings", lambda r: Reply.error(400, "too large to process"))
    with pytest.raises(EmbeddingFailed):
        embedders(srv.url).embed_splitting("short")
    assert srv.count("/v1/embeddings") == 1


def test_split_text_prefers_newlines_and_utf8_boundaries():
    assert split_text("aaaa\nbbbbbbbbbb") == ("aaaa", "bbbbbbbbbb")
    first, second = split_text("ü" * 11)
    assert first + second == "ü" * 11


def test_hash_embedding_is_deterministic_and_similar_for_similar_text():
    a = hash_embedding("the cat sat on the mat", 64)
    assert a == hash_embedding("the cat sat on the mat", 64)
    assert abs(norm(a) - 1) < 1e-9
    similar = hash_embedding("the cat sat on a mat", 64)
    other = hash_embedding("quarterly revenue projections", 64)
    cos = lambda x, y: sum(i * j for i, j in zip(x, y, strict=True))  # noqa: E731
    assert cos(a, similar) > cos(a, other)


def _base64_reply(*encoded: str) -> Reply:
    data = [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(encoded)]
    return Reply(json_body={"object": "list", "data": data, "model": "embed"})


def test_a_base64_vector_is_decoded_as_openai_encodes_it(servers: Servers, embedders):
    # A server or proxy answering OpenAI's encoding_format=base64 by default (the worker never
    # asks for it) was refused as "not a flat list of numbers (no pooling?)".
    import base64
    import struct

    srv = servers(embed_dim=4)
    embedder = embedders(srv.url)
    encoded = base64.b64encode(struct.pack("<4f", 3.0, 4.0, 0.0, 0.0)).decode()
    srv.script(_base64_reply(encoded), path="/v1/embeddings")
    assert embedder.embed(["x"]) == [pytest.approx([0.6, 0.8, 0.0, 0.0])]
    for junk, message in [
        ("not base64!", "not base64"),
        (base64.b64encode(b"\x00" * 10).decode(), "10 bytes"),
        (base64.b64encode(struct.pack("<3f", 1, 2, 3)).decode(), "3 dimensions"),
        (base64.b64encode(struct.pack("<4f", float("nan"), 0, 0, 0)).decode(), "non-finite"),
    ]:
        srv.script(_base64_reply(junk), path="/v1/embeddings")
        with pytest.raises(EmbeddingFailed, match=message):
            embedder.embed(["x"])
