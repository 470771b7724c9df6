"""Interoperability with other model formats (Hugging Face GPT-2 and Llama)."""
