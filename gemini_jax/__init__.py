"""gemini_jax: long-context LLM decoding under a memory wall."""
