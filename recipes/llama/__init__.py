"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) trained by the GPT recipe's entry point."""
