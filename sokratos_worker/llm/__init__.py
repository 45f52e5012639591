"""LLM chat and embedding backends over OpenAI-compatible HTTP (the only httpx users)."""
