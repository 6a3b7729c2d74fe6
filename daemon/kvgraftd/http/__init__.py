"""The OpenAI-compatible HTTP API over the engine service (kvgraftd.http.openai_app)."""
