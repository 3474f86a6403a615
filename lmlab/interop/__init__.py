"""Interop with other tools: Hugging Face transformers (hf), lm-eval."""
