"""Fakes shipped with the package so pipeline tests and benchmarks need no real model."""

from sokratos_worker.testing.scripted_llm import (
    PROBE,
    Reply,
    Request,
    ScriptedLLM,
    hash_embedding,
    hash_embedding_responder,
    json_responder,
)

__all__ = [
    "PROBE",
    "Reply",
    "Request",
    "ScriptedLLM",
    "hash_embedding",
    "hash_embedding_responder",
    "json_responder",
]
